"""Prompt files: JSONL with {"prompt": ...} per line, or Spec-Bench rows {"turns": [...]}."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

# --prompts NAME: the prompt sets batchspec ships (batchspec/assets/<file>)
PROMPT_SETS = {
    "bundled": "prompts.jsonl",  # held-out code and prose openings for the bundled pair (plain completion)
    "chat": "chat.jsonl",  # 32 questions for a chat model: knowledge, how-to, advice, code, short creative
    "grounded": "grounded.jsonl",  # 32 tasks on a given text or code (summarise, rewrite, extract, edit): the
    # answer copies from the prompt; 100-210 tokens each (SmolLM2's tokenizer)
}


def default_prompts_path() -> Path:
    return prompt_set_path("bundled")


def prompt_set_path(name: str) -> Path:
    return Path(str(resources.files("batchspec") / "assets" / PROMPT_SETS[name]))


def load_prompts(path: str | Path | None = None, limit: int | None = None) -> list[str]:
    """Read prompts from a JSONL file or a named set (`PROMPT_SETS`: bundled, chat, grounded;
    default: bundled, the held-out prompts).

    Each line is {"prompt": "..."} or a Spec-Bench row {"question_id", "category",
    "turns": [...]}, of which the first turn is used. Raises ValueError naming the bad line.
    """
    if path is None or str(path) in PROMPT_SETS:
        path = prompt_set_path(str(path or "bundled"))
    path = Path(path)
    if not path.exists():
        raise ValueError(f"prompt file {path} does not exist; give a JSONL file or one of the prompt sets "
                         f"{', '.join(PROMPT_SETS)}")
    if path.is_dir():
        raise ValueError(f"prompts {path} is a folder; give a JSONL file or one of {', '.join(PROMPT_SETS)}")
    prompts = []
    for lineno, row in jsonl_rows(path):
        if isinstance(row, dict) and isinstance(row.get("prompt"), str):
            prompts.append(row["prompt"])
        elif isinstance(row, dict) and isinstance(row.get("turns"), list) and row["turns"] \
                and isinstance(row["turns"][0], str):
            prompts.append(row["turns"][0])
        else:
            raise ValueError(f'{path}:{lineno}: expected {{"prompt": "..."}} or a Spec-Bench row with "turns"')
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def jsonl_rows(path: str | Path):
    """(line number, parsed row) for each non-blank line of a JSONL file; ValueError naming a bad line."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None


def chat_token_ids(tokenizer, prompts: list[str]) -> list[list[int]]:
    """Token ids of each prompt as one user turn under the tokenizer's chat template."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("--chat was given but this tokenizer has no chat template")
    out = []
    for p in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=True,
                                            add_generation_prompt=True)
        out.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    return out


def repetitive_prompts(prompts: list[str]) -> list[str]:
    """Each prompt followed by its own text again ("prompts sent twice"): a workload in which the
    continuation often copies earlier context, as in editing, quoting or looping outputs, so
    model-free drafters (ngram, suffix) find matches.

    >>> repetitive_prompts(["def f():\\n", "x = 1"])
    ['def f():\\ndef f():\\n', 'x = 1\\nx = 1']
    """
    return [p + p if p.endswith("\n") else f"{p}\n{p}" for p in prompts]


def sent_twice(prompts: list[str]) -> list[str]:
    """The whole list, then the whole list again: by the time a prompt's second copy runs, its first
    has usually finished (unless the batch holds both), so a drafter that remembers earlier
    requests (suffix's shared trie) has seen the answer, as with a retry or a popular question.

    >>> sent_twice(["a", "b"])
    ['a', 'b', 'a', 'b']
    """
    return list(prompts) + list(prompts)


def echo_ids(prompt: list[int], answer: list[int], again: list[int]) -> list[int]:
    """A prompt, the target's own answer to it, then the prompt again (`again`: its ids without the
    BOS). The model is asked a question it has just answered, as in a retry, a regeneration or an
    agent loop, so its continuation tends to copy the earlier answer from context.

    >>> echo_ids([2, 7, 8], [9, 10], [7, 8])
    [2, 7, 8, 9, 10, 7, 8]
    """
    return [*prompt, *answer, *again]


# bench --workload: name -> how the prompts read from the file (the bundled ones by default) are sent.
# "echo" is built from token ids and the target's answers (see `echo_ids`), so it is listed here with
# no text transform and completed by the bench command.
WORKLOADS = {"plain": list, "repetitive": repetitive_prompts, "echo": list, "twice": sent_twice}


def apply_workload(name: str, prompts: list[str]) -> list[str]:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    return WORKLOADS[name](prompts)
