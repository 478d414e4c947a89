"""`batchspec generate --ray ADDRESS`: the command line's path through a Ray job.

Prompts become a Ray dataset with an id column, `workers` actors answer them, and the rows come
back to this process, which prints and writes them in input order (JSONL, or Parquet for a
.parquet path) with one progress bar for the whole job.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

import ray
import typer

from ..config import EngineConfig
from ..sampling import SamplingParams
from .job import JobIncomplete, connect, local_cpus, predict, prompt_dataset, rows_per_call, served_in_order
from .output import OutputFile

SAMPLING = ("max_new_tokens", "temperature", "top_k", "top_p", "stop")  # what `generate` takes per run


def generate_on_ray(texts: list[str], config: EngineConfig, params: SamplingParams, *, address: str, workers: int,
                    cpus_per_worker: int | None, gpus_per_worker: float, rows: int | None, target: str | None,
                    draft: str | None, seed: int | None, dtype: str, device: str, chat: bool, output: Path | None,
                    quiet: bool, console, progress_bar) -> None:
    """Run the job and print its closing stats line; exit 1 naming the prompts not served."""
    if address == "local":
        cpus, total_cpus = local_cpus(workers, cpus_per_worker)
    else:
        cpus, total_cpus = cpus_per_worker or 1, None
    rows = rows or rows_per_call(len(texts), workers, config.batch_size)
    fields = {**asdict(config), **{k: getattr(params, k) for k in SAMPLING}}
    out = OutputFile(output) if output is not None else nullcontext()
    started = connect(address, num_cpus=total_cpus)
    try:
        ds = predict(prompt_dataset(texts), workers=workers, cpus_per_worker=cpus, gpus_per_worker=gpus_per_worker,
                     rows=rows, target=target, draft=draft, seed=seed, dtype=dtype, device=device, chat=chat, **fields)
        ds.context.enable_progress_bars = False  # ours covers the whole job
        logging.getLogger("ray.data").setLevel(logging.WARNING)  # not a line per dataset execution
        logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)  # nor that its bars are off
        totals, start = Counter(), time.perf_counter()
        with progress_bar() as bar, out as sink:
            task = bar.add_task(f"{config.method} bs={config.batch_size} x {workers} Ray workers", total=len(texts),
                                toks=0)

            def arrived(batch: list[dict]) -> None:
                toks = bar.tasks[task].fields["toks"] + sum(len(r["token_ids"]) for r in batch)
                bar.update(task, advance=len(batch), toks=toks)

            for row in served_in_order(ds, len(texts), on_arrival=arrived):
                totals.update(tokens=len(row["token_ids"]), drafted=row["drafted"], accepted=row["accepted"])
                if sink is not None:
                    sink.write([row])
                if not quiet:
                    console.rule(f"[{row['id']}] {row['finish_reason']}, {len(row['token_ids'])} tokens")
                    typer.echo(row["text"] if chat else row["prompt"] + row["text"])
        wall = time.perf_counter() - start
    except JobIncomplete as exc:
        console.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(1) from None
    finally:
        if started:
            ray.shutdown()
    acc = f"{totals['accepted'] / totals['drafted']:.3f}" if totals["drafted"] else "n/a"
    console.print(f"[bold]{config.method}[/] bs={config.batch_size} on {workers} Ray workers x {cpus} CPUs: "
                  f"{len(texts)} prompts, {totals['tokens']} tokens in {wall:.2f}s (actor start-up included) = "
                  f"{totals['tokens'] / max(wall, 1e-9):.1f} tokens/s, acceptance {acc}")
