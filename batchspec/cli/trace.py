"""`batchspec trace record|replay`: record a run's rounds at fixed γ, and judge the scheduling
policy on recorded rounds against every fixed γ and the oracles (batchspec/sched/replay.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from ..config import EngineConfig
from .common import console, fail, load_engine, read_prompts, sampling_params
from .options import Chat, Device, Draft, Dtype, Prompts, Target, dataclass_options, derive

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Record decoding rounds and replay scheduling policies over them.")
ENGINE = dataclass_options(EngineConfig, exclude=("profile", "adaptive", "budget"))


@app.command()
@derive(ENGINE, into="engine")
def record(
    *,
    out: Annotated[Path, typer.Option("--out", metavar="PATH", help="Where the trace (JSON) goes")],
    target: Target = None, draft: Draft = None, prompts: Prompts = None,
    num_prompts: Annotated[int | None, typer.Option("--num-prompts", metavar="N", help="First N prompts")] = None,
    chat: Chat = False,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", metavar="N", help="Tokens per prompt")] = 48,
    walk: Annotated[bool, typer.Option("--walk", help="Record a walk: the drafter asked at every position, "
                                                      "nothing verified (sched/walk.py)")] = False,
    dtype: Dtype = "auto", device: Device = "auto",
    engine: dict | None = None,
):
    """Run the prompts at fixed γ (every row drafts its cap) and write every round to --out; with
    --walk, ask the drafter at every position of every request instead (a walk)."""
    from ..prompts import chat_token_ids
    from ..sched.replay import record as record_trace
    from ..sched.walk import record as record_walk

    try:
        texts = read_prompts(None, prompts, num_prompts)
        config = replace(EngineConfig(**engine), adaptive=False)
        if not config.speculative:
            raise ValueError("a trace records speculative rounds: use --method eqspec or exspec")
        eng = load_engine(target, draft, config, dtype, device)
        inputs = chat_token_ids(eng.pair.tokenizer, texts) if chat else texts
        meta = {"target": target or "bundled", "draft": draft, "prompts": prompts or "bundled", "chat": chat,
                "num_prompts": len(texts), "max_new_tokens": max_new_tokens}
        trace = (record_walk if walk else record_trace)(
            eng, inputs, sampling_params(max_new_tokens, 0.0, 0, 1.0, None, len(texts)), meta)
        trace.save(out)
    except ValueError as exc:
        fail(str(exc))
    console.print(f"{len(trace.rounds)} rounds -> {out}")


@app.command()
def replay(traces: Annotated[list[Path], typer.Argument(metavar="TRACE...", help="Recorded traces or walks (JSON)")]):
    """Tokens per second of the policy, plain decoding (on the recorded rounds, and on its own
    schedule: autoregressive), every fixed γ and the oracles on each trace; on a walk, the rows
    advance by what each plan accepts, and plain decoding is the engine's own."""
    from ..sched import walk as walks
    from ..sched.replay import SOURCES, Trace, compare

    table = Table("trace", "rounds", "policy", "plain", "autoregressive", "best fixed γ", "oracle", "clairvoyant",
                  "policy / oracle", "policy / best fixed", "policy / autoregressive")
    for path in traces:
        if _is_walk(path):
            _walk_rows(table, path, walks)
            continue
        try:
            trace = Trace.load(path)
        except (OSError, ValueError, KeyError) as exc:
            fail(f"{path}: not a trace ({exc})")
        for source in SOURCES if trace.alongside else SOURCES[:1]:  # (a hybrid recorded alongside: each source)
            res = compare(trace.view(source))
            best = max((k for k in res if k.startswith("fixed")), key=res.get)
            table.add_row(path.stem + (f" as {source}" if trace.alongside else ""), str(len(trace.rounds)),
                          f"{res['policy']:.1f}", f"{res['plain']:.1f}", f"{res['autoregressive']:.1f}",
                          f"{res[best]:.1f} ({best.split('=')[1]})", f"{res['oracle']:.1f}",
                          f"{res['clairvoyant']:.1f}",
                          f"{res['policy'] / res['oracle']:.3f}", f"{res['policy'] / res[best]:.3f}",
                          f"{res['policy'] / res['autoregressive']:.3f}")
    Console(width=max(console.width, 132)).print(table)


def _is_walk(path: Path) -> bool:
    try:
        return json.loads(path.read_text()).get("kind") == "walk"
    except (OSError, ValueError, AttributeError) as exc:
        fail(f"{path}: not a trace ({exc})")


def _walk_rows(table: Table, path: Path, walks) -> None:
    """A walk's rows in the replay table: `plain` and `autoregressive` are the same there; where the
    head's runner-ups were recorded, the policy verifies them as the engine does, and its rate on
    chains alone follows in brackets."""
    try:
        walk = walks.Walk.load(path)
    except (OSError, ValueError, KeyError) as exc:
        fail(f"{path}: not a walk ({exc})")
    for view in walk.views:
        res = walks.compare(walk, view)
        best = max((k for k in res if k.startswith("fixed")), key=res.get)
        chains = f" (chains {res['policy, chains']:.1f})" if "policy, chains" in res else ""  # (runner-ups recorded)
        table.add_row(f"{path.stem} as {view}", str(len(walk.rounds)), f"{res['policy']:.1f}{chains}",
                      f"{res['plain']:.1f}", f"{res['plain']:.1f}", f"{res[best]:.1f} ({best.split('=')[1]})",
                      f"{res['oracle']:.1f}", f"{res['clairvoyant']:.1f}", f"{res['policy'] / res['oracle']:.3f}",
                      f"{res['policy'] / res[best]:.3f}", f"{res['policy'] / res['plain']:.3f}")
