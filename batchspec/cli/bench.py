"""`batchspec bench`: throughput, speed-ups, overhead anatomy and the analytic limit for a grid of
settings. Each grid dimension is the comma-separated form of an EngineConfig field."""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from ..config import EngineConfig
from .common import (
    check_output_folder,
    console,
    fail,
    new_token_counts,
    parse_list,
    progress_bar,
    prompt_ids,
    read_prompts,
    sampling_params,
)
from .options import (
    Chat,
    Device,
    Draft,
    Dtype,
    JsonPath,
    Prompts,
    Seed,
    Target,
    Temperature,
    TopK,
    TopP,
    dataclass_options,
    derive,
    grid_option,
)

BENCH_PANEL = "Benchmark"
GRID = [
    grid_option(EngineConfig, "method", flag="--methods", default="autoregressive,eqspec,exspec",
                help="Comma-separated methods"),
    grid_option(EngineConfig, "batch_size", flag="--batch-sizes", default="1,4,8,16,32",
                help="Comma-separated batch sizes"),
    grid_option(EngineConfig, "gamma", help="Comma-separated γ values"),
    grid_option(EngineConfig, "drafter", flag="--drafters",
                help="Comma-separated drafters (see generate --drafter), e.g. draft_model,ngram:2,4,10,suffix"),
    grid_option(EngineConfig, "adaptive", help="Comma-separated for eqspec/exspec: on (γ chosen per round, at "
                                               "most --gamma), off (fixed γ)"),
    grid_option(EngineConfig, "window", default="4x", help="Comma-separated exspec windows: 64 = 64 sequences, "
                                                           "4x = 4 x batch size"),
    *dataclass_options(EngineConfig, include=("sort_by_length", "max_kv_tokens", "max_prefill_tokens", "profile")),
    grid_option(EngineConfig, "forward", help="Comma-separated forwards for our methods: auto, lean, hf"),
    grid_option(EngineConfig, "refill", help="Comma-separated: continuous, none (the paper's fixed batches)"),
    grid_option(EngineConfig, "budget", help="Comma-separated TETRIS budgets for eqspec/exspec: none, 24 (drafts "
                                             "verified per round) or 2x (2 x batch size)"),
    grid_option(EngineConfig, "siblings", help="Comma-separated runner-ups per depth a greedy row may verify "
                                               "(see generate --siblings): 3, 0 = chains only, or 0,3"),
    grid_option(EngineConfig, "draft_window", help="Comma-separated draft-model windows (see generate "
                                                   "--draft-window): 128, 0 = the whole context, or 128,0"),
]
COUNT = re.compile(r"[1-9][0-9]*x?")  # 24, or 2x: twice the batch size


@derive(GRID, into="grid")
def bench(
    *,
    target: Target = None, draft: Draft = None, prompts: Prompts = None,
    num_prompts: Annotated[int, typer.Option("--num-prompts", metavar="N", help="Prompts to read")] = 32,
    chat: Chat = False,
    workload: Annotated[str, typer.Option(
        "--workload", metavar="NAME",
        help="plain: the prompts as read; repetitive: each prompt's text twice; echo: prompt + the target's "
             "greedy answer + the prompt again; twice: the whole list, then again")] = "plain",
    max_new_tokens: Annotated[str, typer.Option(
        "--max-new-tokens", metavar="N|LO-HI",
        help="Tokens per prompt: N, or LO-HI for a seeded uniform draw per prompt")] = "128",
    dtype: Dtype = "auto", device: Device = "auto",
    json_path: JsonPath = None,
    plots: Annotated[Path | None, typer.Option("--plots", metavar="DIR", help="Folder for PNG plots")] = None,
    grid: dict | None = None,
    peers: Annotated[str, typer.Option(
        "--peers", metavar="NAME", rich_help_panel=BENCH_PANEL,
        help="hf: add transformers' generate and assisted generation")] = "",
    repeat: Annotated[int, typer.Option("--repeat", metavar="N", rich_help_panel=BENCH_PANEL,
                                        help="Timed rounds per cell (interleaved); medians are reported")] = 1,
    pairing: Annotated[str, typer.Option(
        "--pairing", metavar="NAME", rich_help_panel=BENCH_PANEL,
        help="steps: one batch size's engines run a round each in turn (drift falls on all alike); runs: each "
             "cell's whole run on its own")] = "steps",
    twin: Annotated[bool, typer.Option(
        "--twin", metavar="", rich_help_panel=BENCH_PANEL,
        help="Also run a second, identical autoregressive engine per batch size: its speed-up over the first "
             "is the run's noise floor")] = False,
    prompt_tokens: Annotated[int | None, typer.Option(
        "--prompt-tokens", metavar="N", rich_help_panel=BENCH_PANEL,
        help="Cut every prompt to its first N tokens and drop shorter ones")] = None,
    temperature: Temperature = 0.0, top_k: TopK = 0, top_p: TopP = 1.0, seed: Seed = None,
):
    """Benchmark a grid of settings: throughput, speed-ups, overhead anatomy, analytic limit."""
    from ..bench import run_bench
    from ..bench.runner import PAIRINGS, plan
    from ..drafters import drafter_needs_model, parse_drafter
    from ..models import load_pair
    from ..prompts import apply_workload

    try:
        g = parse_grid(grid)
        if peers not in ("", "hf"):
            raise ValueError(f"--peers takes 'hf' (transformers), got {peers!r}")
        if repeat < 1:
            raise ValueError("--repeat must be >= 1")
        if pairing not in PAIRINGS:
            raise ValueError(f"--pairing takes {' or '.join(PAIRINGS)}, got {pairing!r}")
        for d in g["drafters"]:
            parse_drafter(d)
        plan(g["methods"], g["batch_sizes"], g["gammas"], g["drafters"], False, twin=twin)  # before models load
        options = dict(max_kv_tokens=grid["max_kv_tokens"], max_prefill_tokens=grid["max_prefill_tokens"])
        for m, bs, gm, f, r, w, s in itertools.product(g["methods"], g["batch_sizes"], g["gammas"], g["forwards"],
                                                       g["refills"], g["draft_windows"], g["siblings"]):
            EngineConfig(method=m, batch_size=bs, gamma=gm, forward=f, refill=r, draft_window=w, siblings=s,
                         **options)
        check_output_folder(json_path)
        texts = apply_workload(workload, read_prompts(None, prompts, num_prompts))
        params = [replace(p, max_new_tokens=n) for p, n in
                  zip(sampling_params(1, temperature, top_k, top_p, seed, len(texts)),
                      new_token_counts(max_new_tokens, len(texts), seed))]
        needs_draft = peers == "hf" or (any(drafter_needs_model(d) for d in g["drafters"])
                                        and any(m != "autoregressive" for m in g["methods"]))
        pair = load_pair(target, draft, dtype=dtype, device=device, need_draft=needs_draft)
        ids = prompt_ids(pair.tokenizer, texts, chat)
        if prompt_tokens is not None:
            ids = [p[:prompt_tokens] for p in ids if len(p) >= prompt_tokens]
            if not ids:
                raise ValueError(f"no prompt has {prompt_tokens} tokens")
            params = params[: len(ids)]
        if workload == "echo":
            added = len(pair.tokenizer("")["input_ids"])  # what the tokenizer prepends (BOS)
            ids = echo_workload(pair, ids, [p.max_new_tokens for p in params], added)
        with progress_bar(tokens=False) as bar:
            task = bar.add_task("bench", total=None)

            def step(label: str, done: int, total: int) -> None:
                bar.update(task, description=f"bench: {label}", completed=done, total=total)

            report = run_bench(pair, ids, params, methods=g["methods"], batch_sizes=g["batch_sizes"],
                               gammas=g["gammas"], drafters=g["drafters"], peers=peers == "hf", repeat=repeat,
                               windows=g["windows"], forwards=g["forwards"], refills=g["refills"],
                               adaptives=g["adaptives"], budgets=g["budgets"], twin=twin, pairing=pairing,
                               draft_windows=g["draft_windows"], siblings=g["siblings"], engine_options=options,
                               sort_by_length=grid["sort_by_length"], profile=grid["profile"], progress=step)
    except ValueError as exc:
        fail(str(exc))
    report["config"]["workload"] = workload
    report["config"]["chat"] = chat
    print_report(report, json_path, plots)


def parse_grid(grid: dict) -> dict:
    """The comma-separated grid options as lists, each element checked (ValueError naming the option)."""
    from ..drafters import split_drafters

    drafters = split_drafters(grid["drafter"])
    if not drafters:
        raise ValueError("--drafters is empty")
    windows = parse_list(grid["window"], str, "--window")
    if not all(COUNT.fullmatch(w) for w in windows):
        raise ValueError(f"--window takes sizes like 64 or multiples like 4x, got {grid['window']!r}")
    adaptives = parse_list(grid["adaptive"], str, "--adaptive")
    if any(a not in ("off", "on") for a in adaptives):
        raise ValueError(f"--adaptive takes off, on or off,on; got {grid['adaptive']!r}")
    budgets = parse_list(grid["budget"], str, "--budget")
    if not all(b == "none" or COUNT.fullmatch(b) for b in budgets):
        raise ValueError(f"--budget takes none, counts like 24 or multiples like 2x, got {grid['budget']!r}")
    return {"methods": parse_list(grid["method"], str, "--methods"),
            "batch_sizes": parse_list(grid["batch_size"], int, "--batch-sizes"),
            "gammas": parse_list(grid["gamma"], int, "--gamma"), "drafters": drafters, "windows": windows,
            "forwards": parse_list(grid["forward"], str, "--forward"),
            "refills": parse_list(grid["refill"], str, "--refill"),
            "adaptives": [a == "on" for a in adaptives], "budgets": budgets,
            "draft_windows": [w or None for w in parse_list(grid["draft_window"], int, "--draft-window")],
            "siblings": parse_list(grid["siblings"], int, "--siblings")}


def print_report(report: dict, json_path: Path | None, plots: Path | None) -> None:
    from ..bench import markdown_table
    from ..bench.report import scheduling_table

    typer.echo(markdown_table(report["results"]))
    sched = scheduling_table(report["results"])
    if sched:
        typer.echo("\n" + sched)
    for note in report["notes"]:
        typer.echo(f"\nnote: {note}")
    m = report["machine"]
    typer.echo(f"\nmachine: {m['processor']}, {m['cpu_count']} cores, torch {m['torch']}, device {m['device']}")
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=2))
    if plots is not None:
        from ..bench.plots import plot_all

        for path in plot_all(report["results"], plots, title=f"({m['device']}, {report['config']['dtype']})"):
            console.print(f"wrote {path}")


def echo_workload(pair, ids: list[list[int]], counts: list[int], added: int) -> list[list[int]]:
    """bench --workload echo: each prompt followed by the target's greedy answer (its own `count`
    tokens, autoregressive, untimed) and the prompt again without the `added` special tokens the
    tokenizer put in front (BOS)."""
    from ..engine import SpecEngine
    from ..prompts import echo_ids
    from ..sampling import SamplingParams

    engine = SpecEngine(pair, EngineConfig(method="autoregressive", batch_size=8))
    outs = engine.generate(ids, [SamplingParams(max_new_tokens=n) for n in counts])
    return [echo_ids(p, o.token_ids, p[added:]) for p, o in zip(ids, outs)]
