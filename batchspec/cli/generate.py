"""`batchspec generate`: completions for prompts, printed with a closing stats line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from ..config import EngineConfig
from .common import check_output_folder, console, fail, load_engine, progress_bar, read_prompts, sampling_params
from .options import (
    SAMPLING_PANEL,
    Chat,
    Device,
    Draft,
    Dtype,
    Prompts,
    Seed,
    Target,
    Temperature,
    TopK,
    TopP,
    dataclass_options,
    derive,
)

RAY_PANEL = "Ray"
ENGINE = dataclass_options(EngineConfig, exclude=("profile",))


@derive(ENGINE, into="engine")
def generate(
    *,
    target: Target = None, draft: Draft = None,
    prompt: Annotated[list[str] | None, typer.Option("--prompt", metavar="TEXT",
                                                        help="A prompt (repeatable)")] = None,
    prompts: Prompts = None,
    num_prompts: Annotated[int | None, typer.Option(
        "--num-prompts", metavar="N", help="Use only the first N prompts (default: all of --prompts, or 8 of "
                                           "the bundled ones)")] = None,
    chat: Chat = False,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", metavar="N",
                                                help="Tokens to generate per prompt (exact cap)")] = 128,
    output: Annotated[Path | None, typer.Option("--output", metavar="PATH",
                                                   help="Write outputs as JSONL (--ray: .parquet for Parquet)")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", metavar="", help="Do not print completions")] = False,
    dtype: Dtype = "auto", device: Device = "auto",
    engine: dict | None = None,
    temperature: Temperature = 0.0, top_k: TopK = 0, top_p: TopP = 1.0, seed: Seed = None,
    stop: Annotated[list[str] | None, typer.Option(
        "--stop", metavar="TEXT", rich_help_panel=SAMPLING_PANEL,
        help="Stop string (repeatable): the text is cut before it")] = None,
    ray: Annotated[str | None, typer.Option(
        "--ray", metavar="ADDRESS", rich_help_panel=RAY_PANEL,
        help="Run on Ray (needs batchspec\\[ray]): 'local' starts Ray on this machine, 'auto' joins this "
             "machine's cluster, or a cluster address (ray://HOST:10001, HOST:6379); see docs/ray.md")] = None,
    workers: Annotated[int | None, typer.Option(
        "--workers", metavar="N", rich_help_panel=RAY_PANEL,
        help="Actors, each loading its own engine (default 1)")] = None,
    cpus_per_worker: Annotated[int | None, typer.Option(
        "--cpus-per-worker", metavar="N", rich_help_panel=RAY_PANEL,
        help="CPUs per actor, also its torch threads (default: 'local': this machine's cores / workers; a "
             "cluster: 1)")] = None,
    gpus_per_worker: Annotated[float | None, typer.Option(
        "--gpus-per-worker", metavar="N", rich_help_panel=RAY_PANEL,
        help="GPUs per actor, e.g. 1 for one actor per GPU (default 0)")] = None,
    rows_per_call: Annotated[int | None, typer.Option(
        "--rows-per-call", metavar="N", rich_help_panel=RAY_PANEL,
        help="Prompts per actor call, the unit a dead worker's work is retried in (default: 4 x batch size, "
             "at most an even share per worker)")] = None,
):
    """Generate completions for prompts and print them with a closing stats line.

    With --ray, --workers Ray actors share the prompts; outputs still come in input order."""
    from ..prompts import chat_token_ids

    try:
        if num_prompts is None and not prompt and prompts is None:
            num_prompts = 8
        texts = read_prompts(prompt, prompts, num_prompts)
        params = sampling_params(max_new_tokens, temperature, top_k, top_p, seed, len(texts), stop)
        config = EngineConfig(**engine)
        check_output_folder(output)
        ray_options = (workers, cpus_per_worker, gpus_per_worker, rows_per_call)
        if ray is None and any(v is not None for v in ray_options):
            raise ValueError("--workers, --cpus-per-worker, --gpus-per-worker and --rows-per-call need --ray")
        if ray is not None:
            if any(v is not None and v < 1 for v in (workers, cpus_per_worker, rows_per_call)):
                raise ValueError("--workers, --cpus-per-worker and --rows-per-call must be >= 1")
            if (gpus_per_worker or 0) < 0:
                raise ValueError(f"--gpus-per-worker must be >= 0, got {gpus_per_worker}")
            try:
                from ..ray.command import generate_on_ray
            except ImportError as exc:
                raise ValueError(str(exc)) from None
            generate_on_ray(texts, config, params[0], address=ray, workers=workers or 1,
                            cpus_per_worker=cpus_per_worker, gpus_per_worker=gpus_per_worker or 0,
                            rows=rows_per_call, target=target, draft=draft, seed=seed, dtype=dtype, device=device,
                            chat=chat, output=output, quiet=quiet, console=console, progress_bar=progress_bar)
            return
        engine_ = load_engine(target, draft, config, dtype, device)
        inputs = chat_token_ids(engine_.pair.tokenizer, texts) if chat else texts
        with progress_bar() as bar:
            task = bar.add_task(f"{config.method} bs={config.batch_size}", total=len(texts), toks=0)
            outs = engine_.generate(inputs, params,
                                    progress=lambda n: bar.update(task, advance=1,
                                                                  toks=bar.tasks[task].fields["toks"] + n))
    except ValueError as exc:
        fail(str(exc))
    if not quiet:
        for text, out in zip(texts, outs):
            console.rule(f"[{out.index}] {out.finish_reason}, {len(out.token_ids)} tokens")
            typer.echo(text + out.text if not chat else out.text)
    if output is not None:
        with open(output, "w") as f:
            for text, out in zip(texts, outs):
                f.write(json.dumps({"prompt": text, "text": out.text, "token_ids": out.token_ids,
                                    "finish_reason": out.finish_reason}) + "\n")
    print_stats(config, outs, engine_.last_run)


def print_stats(config: EngineConfig, outs, run) -> None:
    s = run.summary()
    tokens = sum(len(o.token_ids) for o in outs)
    acc = f"{s['acceptance_rate']:.3f}" if s["acceptance_rate"] is not None else "n/a"
    console.print(f"[bold]{config.method}[/] bs={config.batch_size} "
                  f"gamma={config.gamma if config.speculative else '-'}: "
                  f"{len(outs)} prompts, {tokens} tokens in {run.wall:.2f}s = "
                  f"{tokens / max(run.wall, 1e-9):.1f} tokens/s, acceptance {acc}, "
                  f"{s['tokens_per_round']:.2f} tokens/round, peak KV {s['peak_kv_tokens']} tokens")
