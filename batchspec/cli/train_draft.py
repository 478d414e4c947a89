"""`batchspec train-draft`: train an EAGLE draft head for a target by self-distillation."""

from __future__ import annotations

from typing import Annotated

import typer

from ..eagle.recipe import Recipe
from .common import console, fail
from .options import Device, dataclass_options, derive


@derive(dataclass_options(Recipe, exclude=("target", "out", "device"), panel="Training"), into="recipe")
def train_draft(
    target: Annotated[str, typer.Option("--target", metavar="MODEL", help="The target model (a folder, .gguf, "
                                                                          "hub id or a known model)")],
    out: Annotated[str, typer.Option("--out", metavar="DIR", help="Folder for data, checkpoints and the head")],
    recipe: dict,
    device: Device = "auto",
):
    """Train an EAGLE draft head: the target answers prompts (its features recorded as it writes), a
    one-layer head learns to predict its next token from them, and a held-out report says how many
    drafts it would have accepted (γ = 4). The head is saved in vLLM speculators' layout."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..eagle.recipe import run

    try:
        recipe = Recipe(target=target, out=out, device=device, **recipe)
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
