"""`batchspec train-draft` as a library call: collect data, choose the vocabulary, train, report.

Folder layout of a run (`out`):
    data.pt          the recorded sequences (train and held-out) and the vocabulary order
    checkpoint.pt    head + optimiser + schedule (`Trainer.save`), every few minutes
    config.json, model.safetensors   the head in vLLM speculators' layout (`formats.save_head`)
    report.json      held-out agreement, expected accepted length, vocabulary coverage, timings

The time budget (`minutes`) is split: data collection stops at `data_share` of it (after at least
the greedy pass over the prompts), training gets the rest less a minute for the report.

Precision: on a CPU with bfloat16 matrix units (AMX or AVX512-BF16) or a GPU, `dtype="auto"` loads
the target in bfloat16 for the whole recipe (on a 2-core Xeon with AMX: 3.7x float32's prefill
rate, 2.1x its decoding at 64 rows); the head keeps float32 weights, trains under autocast, and
is saved in bfloat16 (its frozen LM head left out: `formats.save_head`). A head serves targets of
any dtype, and recording in bfloat16 costs nothing measurable: SmolLM2's head of 2026-12-02 agrees
with the target's greedy tokens on 0.306 of the held-out answers recorded in bfloat16 and 0.304 of
the same prompts' answers recorded in float32 (`--dtype float32` records in float32, at the rates
above).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .data import Sequence, coverage, read, read_texts, record, vocab_by_frequency
from .head import new_head
from .sources import QUESTION, TOPICS, instructions, package_docs
from .train import TrainConfig, Trainer, evaluate

NAMED = ("bundled", "chat", "grounded")  # prompt sets (batchspec/assets); bundled is plain completion


@dataclass
class Recipe:
    """What `batchspec train-draft` does (its options are these fields, cli/train_draft.py).

    target          the target model (a folder, .gguf, hub id or a known model)
    out             folder for data, checkpoints and the head
    data            comma-separated: bundled, chat, grounded (prompts the target answers), ask:N (N
                    instructions from templates: a form about a topic), self:N (N questions the target
                    writes and answers), docs (installed packages' READMEs and Python's pydoc topics,
                    read teacher-forced), an earlier run's data.pt, or JSONL files of {"prompt"} or
                    {"text"} (read teacher-forced) rows (sources.py); `auto` (default): ask:2000,docs for
                    a target with a chat template, else bundled,docs (what made the shipped head)
    eval            comma-separated prompt sets held out whole, answered only for the report (e.g.
                    chat,grounded)
    minutes         time budget: data, training and the report
    kind            eagle (EAGLE-1) or eagle3
    draft_vocab     draft over the N most frequent target tokens of the data (0: the full vocabulary)
    resume          continue from the folder's data and checkpoint (same schedule)
    holdout         prompts held out of each --data set (its last ones), answered for the report
    samples         answers per training prompt: one greedy, the rest sampled at --temperature
    temperature     temperature of the sampled answers
    max_new_tokens  answer length cap
    data_share      share of --minutes spent recording data (the greedy held-out answers always)
    batch           rows the target answers at once
    ttt             training-time-test steps (1: plain teacher forcing)
    lr              peak learning rate (linear warm-up, cosine decay to 10 %)
    freeze_lm_head  EAGLE-1: keep a reduced LM head at the target's rows (not trained, not saved)
    steps           training steps (0: as many as the time budget allows, measured in the warm-up)
    seed            seed of the head, the batches and the sampled answers
    dtype           the target's dtype while recording and training: auto (bfloat16 where the CPU
                    has AMX or AVX512-BF16, or on a GPU; else float32), float32, bfloat16, ...
    device          where the recipe runs
    """

    target: str | None = None
    out: str = field(default="eagle-head", metadata={"metavar": "DIR"})
    data: str = field(default="auto", metadata={"metavar": "SETS"})
    eval: str = field(default="", metadata={"metavar": "SETS"})
    minutes: float = field(default=40.0, metadata={"metavar": "M"})
    kind: str = field(default="eagle", metadata={"metavar": "KIND"})
    draft_vocab: int = field(default=16384, metadata={"metavar": "N"})  # 0 or >= vocab: the full vocabulary
    resume: bool = False
    holdout: int = field(default=8, metadata={"metavar": "N"})
    samples: int = field(default=3, metadata={"metavar": "K"})
    temperature: float = field(default=0.8, metadata={"metavar": "T"})
    max_new_tokens: int = field(default=192, metadata={"metavar": "N"})
    data_share: float = field(default=0.45, metadata={"metavar": "F"})
    batch: int = field(default=64, metadata={"metavar": "N"})
    ttt: int = field(default=2, metadata={"metavar": "S"})
    lr: float = field(default=1e-3, metadata={"metavar": "LR"})
    freeze_lm_head: bool = True
    steps: int | None = field(default=None, metadata={"metavar": "N", "none_as": 0})
    seed: int = field(default=0, metadata={"metavar": "N"})
    dtype: str | None = field(default=None, metadata={"metavar": "NAME", "none_as": "auto"})
    device: str | None = None

    def __post_init__(self) -> None:
        if self.minutes <= 0 or self.ttt < 1 or self.samples < 1 or self.batch < 1 or self.lr <= 0:
            raise ValueError("--minutes and --lr must be > 0; --ttt, --samples and --batch >= 1")
        if not 0 < self.data_share < 1:
            raise ValueError(f"--data-share must be in (0, 1), got {self.data_share}")


def _sources(recipe: Recipe, tokenizer) -> tuple[list[tuple[list[list[int]], int]], list[list[int]], int, list]:
    """(per source: (prompt ids, how many are held out)), teacher-forced text ids, how many
    questions the target writes itself (`self:N`), earlier runs' data.pt files."""
    from ..prompts import chat_token_ids, load_prompts

    chat = getattr(tokenizer, "chat_template", None) is not None

    def token_ids(prompts: list[str], use_chat: bool) -> list[list[int]]:
        return chat_token_ids(tokenizer, prompts) if use_chat else [tokenizer(p)["input_ids"] for p in prompts]

    sets, texts, own, earlier = [], [], 0, []
    held_whole = [s.strip() for s in recipe.eval.split(",") if s.strip()]
    for name in held_whole:
        if name not in NAMED:
            raise ValueError(f"--eval {name!r} is not a prompt set ({', '.join(NAMED)})")
        ids = token_ids(load_prompts(name), chat and name != "bundled")
        sets.append((ids, len(ids)))
    data = recipe.data
    if data.strip() == "auto":
        data = "ask:2000,docs" if chat else "bundled,docs"
    for name in [s.strip() for s in data.split(",") if s.strip()]:
        if name in held_whole:
            raise ValueError(f"{name!r} is both training data (--data) and held out (--eval)")
        if name.startswith("self:") and name[5:].isdigit():
            own += int(name[5:])
            continue
        if name.endswith(".pt") and Path(name).is_file():
            earlier.append(name)
            continue
        prompts, rows, use_chat = [], [], chat  # (rows: texts read teacher-forced)
        if name == "docs":
            rows = package_docs()
        elif name.startswith("ask:") and name[4:].isdigit():
            if not chat:
                raise ValueError("ask:N needs a chat model (its tokenizer has no chat template)")
            prompts = instructions(int(name[4:]), recipe.seed)
        elif name in NAMED:
            prompts, use_chat = load_prompts(name), chat and name != "bundled"
        elif Path(name).is_file():
            prompts, rows = read_texts(name)
        else:
            raise ValueError(f"--data {name!r} is neither a prompt set ({', '.join(NAMED)}), ask:N, self:N, "
                             "docs, an earlier run's data.pt nor a JSONL file")
        texts += [tokenizer(t)["input_ids"] for t in rows]
        if prompts:
            ids = token_ids(prompts, use_chat)
            sets.append((ids, min(recipe.holdout, len(ids) // 4)))
    if not sets and not texts and not own and not earlier:
        raise ValueError(f"--data {recipe.data!r} names no prompts or texts")
    return sets, texts, own, earlier


def own_questions(recipe: Recipe, pair, count: int, deadline: float, tick=None) -> list[list[int]]:
    """`count` chat prompts the target writes itself: a question about each topic in turn, sampled."""
    from ..prompts import chat_token_ids

    tok = pair.tokenizer
    if getattr(tok, "chat_template", None) is None:
        raise ValueError("self:N needs a chat model (its tokenizer has no chat template)")
    asks = chat_token_ids(tok, [QUESTION.format(TOPICS[i % len(TOPICS)]) for i in range(count)])
    layers = (pair.target.config.get_text_config().num_hidden_layers,)
    seqs = record(pair.target, asks, layers, max_new=48, temperature=1.0, seed=recipe.seed + 7,
                  stop_ids=pair.eos_token_ids, batch=recipe.batch, progress=tick, deadline=deadline)
    texts = [tok.decode(s.tokens[s.start:], skip_special_tokens=True).strip() for s in seqs]
    texts = list(dict.fromkeys(t for t in texts if 10 <= len(t) <= 400))
    return chat_token_ids(tok, texts)


def collect(recipe: Recipe, pair, deadline: float, log: Callable[[str], None],
            tick: Callable[[int], None] | None = None) -> tuple[list[Sequence], list[Sequence]]:
    """(train, held-out) sequences: the held-out prompts answered greedily, the others greedily and
    then sampled (seeds 1, 2, ...) while time remains, and the texts read teacher-forced."""
    target, tok = pair.target, pair.tokenizer
    head_layers = new_head(target, recipe.kind).spec.layers
    sets, texts, own, earlier = _sources(recipe, tok)
    held = [p for ids, k in sets for p in ids[len(ids) - k:]]
    train_prompts = [p for ids, k in sets for p in ids[:len(ids) - k]]
    kw = dict(max_new=recipe.max_new_tokens, stop_ids=pair.eos_token_ids, batch=recipe.batch, progress=tick)
    started = time.perf_counter()
    train, evals = [], []
    for path in earlier:  # (recorded for a head reading the same layers)
        blob = torch.load(path, weights_only=False)
        train, evals = train + blob["train"], evals + blob["evals"]
    if own:
        questions = own_questions(recipe, pair, own, deadline, tick)
        log(f"the target wrote {len(questions)} questions ({time.perf_counter() - started:.0f} s)")
        train_prompts += questions
    evals += record(target, held, head_layers, **kw)
    train += record(target, train_prompts, head_layers, deadline=deadline, **kw) if train_prompts else []
    log(f"greedy answers: {len(held)} held-out, {len(train_prompts)} training prompts "
        f"({time.perf_counter() - started:.0f} s)")
    if texts:
        train += read(target, texts, head_layers)
    for k in range(1, recipe.samples):
        if time.perf_counter() > deadline or not train_prompts:
            break
        train += record(target, train_prompts, head_layers, temperature=recipe.temperature,
                        seed=recipe.seed * 1000 + k, deadline=deadline, **kw)
        log(f"sampled answers, round {k}: {sum(s.entries for s in train)} training entries")
    return train, evals


def fast_bfloat16(device: str) -> bool:
    """Whether bfloat16 matmuls are fast here: a GPU that has them, or a CPU with AMX or AVX512-BF16."""
    if device.startswith("cuda"):
        return torch.cuda.is_bf16_supported()
    probes = [getattr(torch.cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")]
    return any(probe is not None and probe() for probe in probes)


def run(recipe: Recipe, log: Callable[[str], None] = print, tick=None, on_step=None) -> dict:
    """The whole recipe (see the module docstring); returns the report."""
    from ..models import load_pair, resolve_device

    torch.manual_seed(recipe.seed)
    started = time.perf_counter()
    budget = recipe.minutes * 60
    out = Path(recipe.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = recipe.dtype
    if dtype in (None, "auto"):
        dtype = "bfloat16" if fast_bfloat16(resolve_device(recipe.device)) else "float32"
    pair = load_pair(recipe.target, need_draft=False, dtype=dtype, device=recipe.device)
    target = pair.target
    log(f"the target in {dtype}")
    vocab = target.get_output_embeddings().weight.shape[0]
    data_path, ckpt = out / "data.pt", out / "checkpoint.pt"
    if recipe.resume and data_path.is_file():
        blob = torch.load(data_path, weights_only=False)
        train, evals, order = blob["train"], blob["evals"], blob["order"]
        log(f"resuming: {len(train)} training sequences from {data_path}")
    else:
        train, evals = collect(recipe, pair, started + recipe.data_share * budget, log, tick)
        order = vocab_by_frequency(train, vocab)
        torch.save({"train": train, "evals": evals, "order": order}, data_path)
    data_s = time.perf_counter() - started
    n = recipe.draft_vocab if recipe.draft_vocab and recipe.draft_vocab < vocab else None
    cover = {str(k): round(coverage(evals, order[:k], vocab), 4) for k in (1024, 2048, 4096, 8192, 16384, 32768)
             if k < vocab}
    log(f"held-out greedy tokens covered by the N most frequent: {cover}")
    head = new_head(target, recipe.kind, draft_vocab=n, seed=recipe.seed, vocab_ids=order, dtype=torch.float32)
    config = TrainConfig(ttt=recipe.ttt, lr=recipe.lr, seed=recipe.seed, freeze_lm_head=recipe.freeze_lm_head,
                         total=recipe.steps)
    trainer = Trainer(head, train, config)
    if recipe.resume and ckpt.is_file():
        trainer.load(ckpt)
        log(f"resuming at step {trainer.state.step} of {trainer.state.total}")
    seconds = max(10.0, budget - (time.perf_counter() - started) - 60)
    state = trainer.run(seconds, checkpoint=lambda t: t.save(ckpt), on_step=on_step)
    report = {"kind": recipe.kind, "draft_vocab": n or vocab, "coverage": cover,
              "held_out": evaluate(head, evals, gamma=4), "train_entries": sum(s.entries for s in train),
              "held_out_sequences": len(evals), "steps": state.step, "total_steps": state.total,
              "train_minutes": round(state.seconds / 60, 2), "data_minutes": round(data_s / 60, 2),
              "last": state.history[-3:], "recipe": asdict(recipe)}
    from .formats import save_head

    save_head(head, out, target_name=pair.target_name, dtype=torch.bfloat16)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    return report
