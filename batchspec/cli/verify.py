"""`batchspec verify`: every method's greedy output must equal target-only greedy decoding, token
for token; with --temperature > 0, the first two sampled tokens must follow the target's exact
distribution."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from ..config import EngineConfig
from .common import check_output_folder, console, fail, parse_list, progress_bar, prompt_ids, read_prompts
from .options import (
    SAMPLING_PANEL,
    Chat,
    Device,
    Draft,
    Dtype,
    JsonPath,
    Prompts,
    Target,
    TopK,
    TopP,
    dataclass_options,
    derive,
    grid_option,
)

# the methods and batch sizes are the grid; the rest goes to every cell's EngineConfig
ENGINE = [grid_option(EngineConfig, "method", flag="--methods", default="autoregressive,eqspec,exspec",
                      help="Comma-separated methods"),
          grid_option(EngineConfig, "batch_size", flag="--batch-sizes", default="1,2,8",
                      help="Comma-separated batch sizes"),
          *dataclass_options(EngineConfig, exclude=("method", "batch_size", "profile"))]
RUN_ARGS = ("gamma", "drafter", "window", "forward")  # run_equivalence's own arguments


@derive(ENGINE, into="engine")
def verify(
    *,
    target: Target = None, draft: Draft = None, prompts: Prompts = None,
    num_prompts: Annotated[int, typer.Option("--num-prompts", metavar="N", help="Prompts to check")] = 16,
    chat: Chat = False,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", metavar="N", help="Tokens per prompt")] = 64,
    hf_check: Annotated[int, typer.Option(
        "--hf-check", metavar="N", help="Prompts on which the reference is checked against transformers' "
                                        "generate (0 = skip)")] = 3,
    dtype: Dtype = "auto", device: Device = "auto", json_path: JsonPath = None,
    engine: dict | None = None,
    temperature: Annotated[float, typer.Option(
        "--temperature", metavar="T", rich_help_panel=SAMPLING_PANEL,
        help="> 0: check the sampling distribution instead")] = 0.0,
    top_k: TopK = 0, top_p: TopP = 1.0,
    seed: Annotated[int, typer.Option("--seed", metavar="N", rich_help_panel=SAMPLING_PANEL,
                                      help="Sampling check: its seed")] = 0,
    samples: Annotated[int, typer.Option("--samples", metavar="N", rich_help_panel=SAMPLING_PANEL,
                                         help="Sampling check: samples per prompt")] = 2000,
):
    """Check exactness: every method's output must equal target-only greedy decoding, token for token.

    With --temperature > 0: the first two sampled tokens must follow the target's exact distribution.
    Exit status 1 when a check fails."""
    from ..drafters import drafter_needs_model
    from ..models import load_pair
    from ..sampling import SamplingParams

    try:
        methods = parse_list(engine.pop("method"), str, "--methods")
        sizes = parse_list(engine.pop("batch_size"), int, "--batch-sizes")
        for m in methods:
            for bs in sizes:
                EngineConfig(method=m, batch_size=bs, **cell_options(engine, m))
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p)
        if samples < 10:
            raise ValueError("--samples must be >= 10")
        check_output_folder(json_path)
        texts = read_prompts(None, prompts, num_prompts)
        needs_draft = any(m != "autoregressive" for m in methods) and drafter_needs_model(engine["drafter"])
        pair = load_pair(target, draft, dtype=dtype, device=device, need_draft=needs_draft)
        ids = prompt_ids(pair.tokenizer, texts, chat)
        config = {"target": pair.target_name, "draft": pair.draft_name,
                  "dtype": str(pair.target.dtype).removeprefix("torch."), "device": str(pair.target.device),
                  "max_new_tokens": max_new_tokens, "num_prompts": len(ids), "chat": chat,
                  "temperature": temperature, "top_k": top_k, "top_p": top_p, **engine}
        if params.greedy:
            ok = verify_greedy(pair, ids, methods, sizes, params, hf_check, engine, config, json_path)
        else:
            ok = verify_sampling(pair, ids, methods, sizes, params, samples, seed, engine, config, json_path)
    except ValueError as exc:
        fail(str(exc))
    if not ok:
        raise typer.Exit(1)


def cell_options(engine: dict, method: str) -> dict:
    """The EngineConfig fields of one method's cells: --window applies to exspec only."""
    return {**engine, "window": engine["window"] if method == "exspec" else None}


def drafts(row: dict) -> str:
    """ "accepted/drafted" of a cell, "-" when it drafted nothing."""
    return f"{row['accepted']}/{row['drafted']}" if row.get("drafted") else "-"


def verify_greedy(pair, ids, methods, sizes, params, hf_check, engine, config, json_path) -> bool:
    from ..harness import check_reference_against_hf, divergence_note, reference_outputs, run_equivalence

    with console.status("reference: target-only greedy, batch size 1"):
        refs = reference_outputs(pair, ids, params, config["forward"])
    hf = None
    if hf_check > 0:
        with console.status("checking the reference against transformers' generate"):
            hf = check_reference_against_hf(pair, ids[:hf_check], refs[:hf_check], params)
    run = {k: engine[k] for k in RUN_ARGS}
    rest = {k: v for k, v in engine.items() if k not in RUN_ARGS}
    with progress_bar(tokens=False) as bar:
        task = bar.add_task("verify", total=len(methods) * len(sizes))
        results = run_equivalence(pair, ids, methods, sizes, params=params, references=refs, engine_options=rest,
                                  on_result=lambda r: bar.update(task, advance=1), **run)
    table = Table(title=f"output equivalence vs target-only greedy (bs=1): {len(ids)} prompts, "
                        f"{params.max_new_tokens} new tokens, dtype {config['dtype']}",
                  caption="exact: share of prompts identical; partial: share of tokens before a divergence; "
                          "accepted: of the draft tokens verified")
    table.add_column("method", no_wrap=True)
    for col in ("batch", "gamma", "exact", "partial", "accepted", "acceptance"):  # accepted: of the drafted
        table.add_column(col, justify="right", no_wrap=True)
    for r in results:
        acc = f"{r['acceptance_rate']:.3f}" if r["acceptance_rate"] is not None else "-"
        table.add_row(r["method"], str(r["batch_size"]), str(r["gamma"] or "-"), f"{r['exact_match']:.3f}",
                      f"{r['partial_match']:.3f}", drafts(r), acc)
    Console().print(table)
    if hf is not None:
        verdict = "identical" if hf["identical"] else f"DIFFERENT (exact match {hf['exact_match']:.2f})"
        Console().print(f"reference vs transformers generate(do_sample=False) on {hf['prompts']} prompts: {verdict}")
    note = divergence_note(results, pair.target.dtype)
    if note is not None:
        Console().print(f"note: {note}")
    if json_path is not None:
        json_path.write_text(json.dumps({"config": config, "reference_check": hf, "results": results,
                                         "divergence_note": note}, indent=2))
    return all(r["exact_match"] == 1.0 for r in results) and (hf is None or hf["identical"])


def verify_sampling(pair, ids, methods, sizes, params, samples, seed, engine, config, json_path) -> bool:
    from ..harness import distribution_check

    options = {k: v for k, v in engine.items() if k != "gamma"}
    results = []
    with progress_bar(tokens=False) as bar:
        task = bar.add_task("sampling check", total=len(methods) * len(sizes))
        for m in methods:
            for bs in sizes:
                for row in distribution_check(pair, ids, params, method=m, batch_size=bs, gamma=engine["gamma"],
                                              samples=samples, seed=seed, engine_options=cell_options(options, m)):
                    results.append({"method": m, "batch_size": bs, **row})
                bar.update(task, advance=1)
    table = Table(title=f"first two sampled tokens vs the target's exact distribution: T={params.temperature}, "
                        f"top-k {params.top_k or 'off'}, top-p {params.top_p}, {samples} samples per prompt")
    for col in ("method", "batch", "prompt", "TV distance", "bound", "chi² p", "acceptance", "verdict"):
        table.add_column(col, justify="right")
    for r in results:
        acc = f"{r['acceptance_rate']:.3f}" if r["acceptance_rate"] is not None else "-"
        table.add_row(r["method"], str(r["batch_size"]), str(r["prompt"]), f"{r['distance']:.4f}",
                      f"{r['bound']:.4f}", f"{r['p_value']:.3g}", acc, "ok" if r["passed"] else "FAIL")
    Console().print(table)
    if json_path is not None:
        json_path.write_text(json.dumps({"config": {**config, "samples": samples, "seed": seed},
                                         "results": results}, indent=2))
    return all(r["passed"] for r in results)
