"""What the commands share: the error line, loading an engine, prompts, sampling, progress bars."""

from __future__ import annotations

import re

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

console = Console(stderr=True)


def fail(message: str) -> None:
    """The one-line `error: ...` every command ends with on bad input (exit status 2)."""
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def parse_list(text: str, kind=str, name: str = "list") -> list:
    """ "1, 4,8" -> [1, 4, 8]; ValueError naming the option on a bad or empty list."""
    try:
        items = [kind(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{name} must be a comma-separated list, got {text!r}") from None
    if not items:
        raise ValueError(f"{name} is empty")
    return items


def load_engine(target, draft, config, dtype, device):
    """`SpecEngine.from_pretrained` under a spinner. On a machine's first run it also times the
    CPU's matrix kernels (about 20 s for the bundled pair on a 2-core EPYC) and, with --adaptive
    (the default), the models' step costs; both are kept on disk (`cache.py`) for later runs."""
    from ..cache import cache_dir
    from ..engine import SpecEngine

    where = cache_dir()
    note = f"cached in {where}" if where is not None else "not cached: BATCHSPEC_CACHE=off"
    with console.status(f"loading the models (a machine's first run also times its kernels and step costs; {note})"):
        return SpecEngine.from_pretrained(target, draft, config, dtype=dtype, device=device)


def sampling_params(max_new_tokens, temperature, top_k, top_p, seed, count, stop=None):
    from ..sampling import SamplingParams, request_seed

    base = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                stop=tuple(stop or ()))
    if seed is None:
        return [SamplingParams(**base)] * count
    return [SamplingParams(**base, seed=request_seed(seed, i)) for i in range(count)]


def new_token_counts(spec: str, count: int, seed: int | None) -> list[int]:
    """"64" -> 64 for every prompt; "8-512" -> a seeded uniform draw in [8, 512] per prompt."""
    import random

    m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", spec)
    if m is None or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
        raise ValueError(f"--max-new-tokens takes N or LO-HI (LO <= HI), got {spec!r}")
    lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
    rng = random.Random(seed or 0)
    return [rng.randint(lo, hi) for _ in range(count)]


def read_prompts(prompt: list[str] | None, prompts: str | None, num_prompts: int | None) -> list[str]:
    """--prompt texts, or the prompt set --prompts names (`load_prompts`), the first `num_prompts`."""
    from ..prompts import load_prompts

    if prompt and prompts:
        raise ValueError("give --prompt or --prompts, not both")
    if prompt:
        return list(prompt)[:num_prompts] if num_prompts else list(prompt)
    return load_prompts(prompts, num_prompts)


def prompt_ids(tokenizer, texts: list[str], chat: bool) -> list[list[int]]:
    """Token ids of each prompt: as text, or (--chat) as one user turn under the chat template."""
    from ..prompts import chat_token_ids

    return chat_token_ids(tokenizer, texts) if chat else [tokenizer(t)["input_ids"] for t in texts]


def progress_bar(tokens: bool = True) -> Progress:
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn()]
    if tokens:
        columns.append(TextColumn("{task.fields[toks]} tokens"))
    return Progress(*columns, TimeElapsedColumn(), console=console, transient=True)


def check_output_folder(path) -> None:
    if path is not None and not path.parent.exists():
        raise ValueError(f"output folder {path.parent} does not exist")
