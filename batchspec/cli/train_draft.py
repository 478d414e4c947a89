"""`batchspec train-draft`: train an EAGLE draft head for a target by self-distillation."""

from __future__ import annotations

from typing import Annotated

import typer

from .common import console, fail
from .options import Device, Dtype


def train_draft(
    target: Annotated[str, typer.Option("--target", metavar="MODEL", help="The target model (a folder, .gguf, "
                                                                          "hub id or a known model)")],
    out: Annotated[str, typer.Option("--out", metavar="DIR", help="Folder for data, checkpoints and the head")],
    data: Annotated[str, typer.Option("--data", metavar="SETS", help="Comma-separated: bundled, chat, grounded "
                                      "(prompts the target answers), self:N (N questions the target writes and "
                                      "answers), an earlier run's data.pt, or JSONL files of {\"prompt\"} or "
                                      "{\"text\"} (read teacher-forced) rows")] = "chat,grounded,bundled",
    eval_sets: Annotated[str, typer.Option("--eval", metavar="SETS", help="Comma-separated prompt sets held "
                                           "out whole, answered only for the report (e.g. chat,grounded)")] = "",
    minutes: Annotated[float, typer.Option("--minutes", metavar="M", help="Time budget: data, training and "
                                           "the report")] = 40.0,
    kind: Annotated[str, typer.Option("--kind", metavar="KIND", help="eagle (EAGLE-1) or eagle3")] = "eagle",
    draft_vocab: Annotated[int, typer.Option("--draft-vocab", metavar="N", help="Draft over the N most frequent "
                                             "target tokens of the data (0: the full vocabulary)")] = 8192,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from DIR's data and checkpoint (same "
                                         "schedule)")] = False,
    ttt: Annotated[int, typer.Option("--ttt", metavar="S", help="Training-time-test steps (1: plain "
                                     "teacher forcing)")] = 1,
    data_share: Annotated[float, typer.Option("--data-share", metavar="F", help="Share of --minutes spent "
                                              "recording data (the greedy held-out answers always)")] = 0.3,
    freeze_lm_head: Annotated[bool, typer.Option("--freeze-lm-head", help="EAGLE-1: keep a reduced LM head at "
                                                 "the target's rows (not trained)")] = False,
    steps: Annotated[int, typer.Option("--steps", metavar="N", help="Training steps (0: as many as the time "
                                       "budget allows, measured after 10 steps)")] = 0,
    samples: Annotated[int, typer.Option("--samples", metavar="K", help="Answers per prompt: one greedy, the "
                                         "rest sampled")] = 4,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", metavar="N", help="Answer length cap")] = 192,
    seed: Annotated[int, typer.Option("--seed", metavar="N", help="Seed of the head, the batches and the "
                                      "sampled answers")] = 0,
    dtype: Dtype = "auto", device: Device = "auto",
):
    """Train an EAGLE draft head: the target answers prompts (its features recorded as it writes), a
    one-layer head learns to predict its next token from them, and a held-out report says how many
    drafts it would have accepted (γ = 4). The head is saved in vLLM speculators' layout."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..eagle.recipe import Recipe, run

    try:
        if minutes <= 0 or ttt < 1 or samples < 1:
            raise ValueError("--minutes must be > 0, --ttt and --samples >= 1")
        recipe = Recipe(target=target, out=out, data=data, eval=eval_sets, minutes=minutes, kind=kind,
                        draft_vocab=draft_vocab or None, resume=resume, ttt=ttt, samples=samples,
                        max_new_tokens=max_new_tokens, seed=seed, data_share=data_share,
                        freeze_lm_head=freeze_lm_head, steps=steps or None, dtype=dtype, device=device)
        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[info]}"), TimeElapsedColumn()]
        with Progress(*columns, console=console, transient=False) as bar:
            tokens = bar.add_task("recording the target", total=None, info="")
            steps = bar.add_task("training", total=None, info="", visible=False)

            def tick(n: int) -> None:
                bar.update(tokens, advance=n, info="tokens")

            def on_step(info: dict, state) -> None:
                bar.update(steps, visible=True, completed=state.step, total=state.total,
                           info=f"loss {info['loss']:.3f}  top-1 {info['top1']:.3f}  lr {info['lr']:.1e}")

            report = run(recipe, log=lambda m: bar.console.print(m, highlight=False), tick=tick, on_step=on_step)
    except ValueError as exc:
        fail(str(exc))
    h = report["held_out"]
    console.print(f"[bold]held out[/]: top-1 {h['top1']:.3f} over {h['positions']} tokens; γ=4 chain: "
                  f"{h['accepted']:.2f} drafts accepted, {h['tokens_per_pass']:.2f} tokens per pass; "
                  f"{report['steps']} steps in {report['train_minutes']} min; head in {out}")
