"""The `batchspec` command line: generate, verify, bench, serve, loadtest."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .config import EngineConfig
from .server.config import ServerConfig, field_docs

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Exact batch speculative decoding for Hugging Face causal LMs.")
console = Console(stderr=True)

TARGET = typer.Option(None, "--target", help="Target model: local path or hub id, or random:<path or id> for "
                                             "random weights from a config (default: bundled target)")
DRAFT = typer.Option(None, "--draft", help="Draft model sharing the target's tokenizer (default: bundled draft)")
DTYPE = typer.Option("auto", "--dtype", help="float32 (CPU default), bfloat16 (CUDA default), float16, float64")
DEVICE = typer.Option("auto", "--device", help="cpu, cuda or cuda:N (default: cuda if available)")
PROMPTS = typer.Option(None, "--prompts", help="JSONL prompt file (default: the bundled held-out prompts)")
GAMMA = typer.Option(EngineConfig.gamma, "--gamma", help="Draft tokens per round")
MAX_NEW = typer.Option(128, "--max-new-tokens", help="Tokens to generate per prompt (exact cap)")
TEMPERATURE = typer.Option(0.0, "--temperature", help="0 = greedy")
TOP_K = typer.Option(0, "--top-k", help="0 = off")
TOP_P = typer.Option(1.0, "--top-p", help="1.0 = off")
SEED = typer.Option(None, "--seed", help="Run seed: request i gets a seed derived from it and i")
WINDOW = typer.Option(None, "--window", help="exspec: sequences in flight (default: 4 x batch size)")
SORT = typer.Option(False, "--sort-by-length", help="Admit prompts shortest first")
FORWARD = typer.Option("auto", "--forward", help="How models run: auto (batchspec's lean forward for Llama-family "
                                                "models, transformers modules otherwise), lean, hf")
DRAFTER = typer.Option(EngineConfig.drafter, "--drafter", help="draft_model (the draft model); ngram[:min_n,max_n,k] "
                                                        "(prompt lookup, no model); "
                                                        "suffix[:depth,k,min_prob,max_tokens] (suffix decoding over "
                                                        "this and earlier requests, no model); "
                                                        "hybrid[:suffix[:...]|ngram[:...]] (the default: "
                                                        "suffix where it matches, the draft model elsewhere while "
                                                        "it pays); "
                                                        "oracle:<p> (synthetic, for overhead studies). See "
                                                        "docs/drafters.md")
REFILL = typer.Option("continuous", "--refill", help="continuous: refill a finished row at the next round; none: "
                                                     "fixed batches as in the founding paper")
MAX_KV = typer.Option(None, "--max-kv-tokens", help="KV budget per model in tokens, allocated once as one row per "
                                                    "resident request (default: rows as long as the model context, "
                                                    "at most half the free memory)")
MAX_PREFILL = typer.Option(2048, "--max-prefill-tokens", help="Prompt-token slots per prefill forward (longer prompts "
                                                              "are prefilled in chunks between decoding rounds)")


ADAPTIVE = typer.Option(True, "--adaptive/--no-adaptive",
                        help="Choose each row's draft length (0..gamma) every round from measured costs and "
                             "acceptance (the default: profiles the models for about a second the first time, "
                             "cached on disk); --no-adaptive: every row drafts gamma. Seeded sampled requests keep "
                             "fixed gamma")
RAY = typer.Option(None, "--ray", metavar="ADDRESS",
                   help="Run on Ray (needs batchspec[ray]): 'local' starts a Ray instance on this machine, 'auto' "
                        "joins the cluster this machine belongs to, or a cluster address (ray://HOST:10001, "
                        "HOST:6379). See docs/ray.md")
WORKERS = typer.Option(None, "--workers", help="--ray: actors, each loading its own engine (default 1)")
CPUS_PER_WORKER = typer.Option(None, "--cpus-per-worker", help="--ray: CPUs per actor, also its torch threads "
                                                               "(default: 'local': this machine's cores / workers; "
                                                               "a cluster: 1)")
GPUS_PER_WORKER = typer.Option(None, "--gpus-per-worker", help="--ray: GPUs per actor, e.g. 1 for one actor per GPU "
                                                               "(default 0)")
ROWS_PER_CALL = typer.Option(None, "--rows-per-call", help="--ray: prompts per actor call, the unit a dead worker's "
                                                           "work is retried in (default: 4 x batch size, at most an "
                                                           "even share per worker)")
BUDGET = typer.Option(None, "--budget", help="TETRIS: verify at most this many draft tokens per round across the "
                                             "batch, those most likely to be accepted (with --adaptive: instead of "
                                             "the budget it chooses); seeded sampled requests keep their fixed-gamma "
                                             "drafts, counted first")


DRAFT_WINDOW = typer.Option(EngineConfig.draft_window, "--draft-window",
                            help="The draft model's context per request: its first 4 tokens and its last N to 2N "
                                 "(StreamingLLM's sinks and window); 0 = the whole context. Changes no output")


def engine_options(refill: str, max_kv_tokens: int | None, max_prefill_tokens: int, adaptive: bool = True,
                   budget: int | None = None, draft_window: int | None = EngineConfig.draft_window) -> dict:
    """The serving options every command passes to EngineConfig alike (draft_window 0: None)."""
    return dict(refill=refill, max_kv_tokens=max_kv_tokens, max_prefill_tokens=max_prefill_tokens, adaptive=adaptive,
                budget=budget, draft_window=None if draft_window == 0 else draft_window)


def parse_list(text: str, kind=str, name: str = "list") -> list:
    try:
        items = [kind(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"{name} must be a comma-separated list, got {text!r}") from None
    if not items:
        raise typer.BadParameter(f"{name} is empty")
    return items


def fail(message: str) -> None:
    console.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(2)


def load_engine(target, draft, config, dtype, device):
    """`SpecEngine.from_pretrained` under a spinner. On a machine's first run it also times the
    CPU's matrix kernels (about 20 s for the bundled pair on a 2-core EPYC) and, with --adaptive
    (the default), the models' step costs; both are kept on disk (`cache.py`) for later runs."""
    from .cache import cache_dir
    from .engine import SpecEngine

    where = cache_dir()
    note = f"cached in {where}" if where is not None else "not cached: BATCHSPEC_CACHE=off"
    with console.status(f"loading the models (a machine's first run also times its kernels and step costs; {note})"):
        return SpecEngine.from_pretrained(target, draft, config, dtype=dtype, device=device)


def sampling_params(max_new_tokens, temperature, top_k, top_p, seed, count, stop=None):
    from .sampling import SamplingParams, request_seed

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


def read_prompts(prompt: list[str] | None, prompts: Path | None, num_prompts: int | None) -> list[str]:
    from .prompts import load_prompts

    if prompt and prompts:
        raise ValueError("give --prompt or --prompts, not both")
    if prompt:
        return list(prompt)[:num_prompts] if num_prompts else list(prompt)
    return load_prompts(prompts, num_prompts)


def progress_bar(tokens: bool = True) -> Progress:
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn()]
    if tokens:
        columns.append(TextColumn("{task.fields[toks]} tokens"))
    return Progress(*columns, TimeElapsedColumn(), console=console, transient=True)


@app.command()
def generate(
    target: str = TARGET, draft: str = DRAFT,
    method: str = typer.Option("eqspec", "--method", help="autoregressive, eqspec or exspec"),
    batch_size: int = typer.Option(8, "--batch-size"), gamma: int = GAMMA, max_new_tokens: int = MAX_NEW,
    prompt: list[str] = typer.Option(None, "--prompt", help="A prompt (repeatable)"), prompts: Path = PROMPTS,
    num_prompts: int = typer.Option(None, "--num-prompts",
                                    help="Use only the first N prompts (default: all of --prompts, 8 bundled ones)"),
    chat: bool = typer.Option(False, "--chat", help="Wrap prompts in the tokenizer's chat template"),
    output: Path = typer.Option(None, "--output", help="Write outputs as JSONL"),
    temperature: float = TEMPERATURE, top_k: int = TOP_K, top_p: float = TOP_P, seed: int = SEED,
    window: int = WINDOW, sort_by_length: bool = SORT, drafter: str = DRAFTER, forward: str = FORWARD,
    refill: str = REFILL, max_kv_tokens: int = MAX_KV, max_prefill_tokens: int = MAX_PREFILL, adaptive: bool = ADAPTIVE,
    budget: int = BUDGET, draft_window: int = DRAFT_WINDOW,
    stop: list[str] = typer.Option(None, "--stop", help="Stop string (repeatable): the text is cut before it"),
    dtype: str = DTYPE, device: str = DEVICE,
    quiet: bool = typer.Option(False, "--quiet", help="Do not print completions"),
    ray: str = RAY, workers: int = WORKERS, cpus_per_worker: int = CPUS_PER_WORKER,
    gpus_per_worker: float = GPUS_PER_WORKER, rows_per_call: int = ROWS_PER_CALL,
):
    """Generate completions for prompts and print them with a closing stats line.

    With --ray, `--workers` Ray actors share the prompts; outputs still come in input order, and
    --output ending in .parquet writes Parquet."""
    from .prompts import chat_token_ids

    try:
        if num_prompts is None and not prompt and prompts is None:
            num_prompts = 8
        texts = read_prompts(prompt, prompts, num_prompts)
        params = sampling_params(max_new_tokens, temperature, top_k, top_p, seed, len(texts), stop)
        config = EngineConfig(method=method, gamma=gamma, batch_size=batch_size, window=window,
                              sort_by_length=sort_by_length, drafter=drafter, forward=forward,
                              **engine_options(refill, max_kv_tokens, max_prefill_tokens, adaptive, budget,
                                               draft_window))
        if output is not None and not output.parent.exists():
            raise ValueError(f"output folder {output.parent} does not exist")
        ray_options = (workers, cpus_per_worker, gpus_per_worker, rows_per_call)
        if ray is None and any(v is not None for v in ray_options):
            raise ValueError("--workers, --cpus-per-worker, --gpus-per-worker and --rows-per-call need --ray")
        if ray is not None:
            if any(v is not None and v < 1 for v in (workers, cpus_per_worker, rows_per_call)):
                raise ValueError("--workers, --cpus-per-worker and --rows-per-call must be >= 1")
            if (gpus_per_worker or 0) < 0:
                raise ValueError(f"--gpus-per-worker must be >= 0, got {gpus_per_worker}")
            try:
                from .ray.command import generate_on_ray
            except ImportError as exc:
                raise ValueError(str(exc)) from None
            generate_on_ray(texts, config, params[0], address=ray, workers=workers or 1,
                            cpus_per_worker=cpus_per_worker, gpus_per_worker=gpus_per_worker or 0,
                            rows=rows_per_call, target=target, draft=draft, seed=seed, dtype=dtype, device=device,
                            chat=chat, output=output, quiet=quiet, console=console, progress_bar=progress_bar)
            return
        engine = load_engine(target, draft, config, dtype, device)
        inputs = chat_token_ids(engine.pair.tokenizer, texts) if chat else texts
        with progress_bar() as bar:
            task = bar.add_task(f"{method} bs={batch_size}", total=len(texts), toks=0)
            outs = engine.generate(inputs, params,
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
    run = engine.last_run
    s = run.summary()
    tokens = sum(len(o.token_ids) for o in outs)
    acc = f"{s['acceptance_rate']:.3f}" if s["acceptance_rate"] is not None else "n/a"
    console.print(f"[bold]{method}[/] bs={batch_size} gamma={gamma if config.speculative else '-'}: "
                  f"{len(outs)} prompts, {tokens} tokens in {run.wall:.2f}s = "
                  f"{tokens / max(run.wall, 1e-9):.1f} tokens/s, acceptance {acc}, "
                  f"{s['tokens_per_round']:.2f} tokens/round, peak KV {s['peak_kv_tokens']} tokens")


@app.command()
def verify(
    target: str = TARGET, draft: str = DRAFT,
    methods: str = typer.Option("autoregressive,eqspec,exspec", "--methods", help="Comma-separated methods"),
    batch_sizes: str = typer.Option("1,2,8", "--batch-sizes", help="Comma-separated batch sizes"),
    gamma: int = GAMMA, max_new_tokens: int = typer.Option(64, "--max-new-tokens"),
    prompts: Path = PROMPTS, num_prompts: int = typer.Option(16, "--num-prompts"),
    drafter: str = DRAFTER, window: int = WINDOW, forward: str = FORWARD,
    refill: str = REFILL, max_kv_tokens: int = MAX_KV, max_prefill_tokens: int = MAX_PREFILL, adaptive: bool = ADAPTIVE,
    budget: int = BUDGET, draft_window: int = DRAFT_WINDOW,
    hf_check: int = typer.Option(3, "--hf-check", help="Prompts on which the reference is checked against "
                                                        "transformers' generate (0 = skip)"),
    temperature: float = typer.Option(0.0, "--temperature", help="> 0: check the sampling distribution instead"),
    top_k: int = TOP_K, top_p: float = TOP_P, seed: int = typer.Option(0, "--seed"),
    samples: int = typer.Option(2000, "--samples", help="Sampling check: samples per prompt"),
    dtype: str = DTYPE, device: str = DEVICE,
    json_path: Path = typer.Option(None, "--json", help="Write results as JSON"),
):
    """Greedy: every method's output must equal target-only greedy decoding, token for token.
    With --temperature > 0: the first two sampled tokens must follow the target's exact distribution."""
    from .drafters import drafter_needs_model
    from .models import load_pair
    from .sampling import SamplingParams

    try:
        method_list = parse_list(methods, str, "--methods")
        sizes = parse_list(batch_sizes, int, "--batch-sizes")
        options = engine_options(refill, max_kv_tokens, max_prefill_tokens, adaptive, budget, draft_window)
        for m in method_list:
            for bs in sizes:
                EngineConfig(method=m, batch_size=bs, gamma=gamma, drafter=drafter,
                             window=window if m == "exspec" else None, forward=forward, **options)
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p)
        if samples < 10:
            raise ValueError("--samples must be >= 10")
        texts = read_prompts(None, prompts, num_prompts)
        needs_draft = any(m != "autoregressive" for m in method_list) and drafter_needs_model(drafter)
        pair = load_pair(target, draft, dtype=dtype, device=device, need_draft=needs_draft)
        ids = [pair.tokenizer(t)["input_ids"] for t in texts]
        config = {"target": pair.target_name, "draft": pair.draft_name, "gamma": gamma, "dtype": dtype,
                  "max_new_tokens": max_new_tokens, "drafter": drafter, "num_prompts": len(ids),
                  "temperature": temperature, "top_k": top_k, "top_p": top_p, "forward": forward, **options}
        if params.greedy:
            ok = _verify_greedy(pair, ids, method_list, sizes, gamma, params, drafter, window, hf_check, config,
                                json_path)
        else:
            ok = _verify_sampling(pair, ids, method_list, sizes, gamma, params, samples, seed, config, json_path)
    except ValueError as exc:
        fail(str(exc))
    if not ok:
        raise typer.Exit(1)


def _options(config: dict) -> dict:
    return {k: config[k] for k in ("refill", "max_kv_tokens", "max_prefill_tokens", "adaptive", "budget",
                                   "draft_window")}


def _verify_greedy(pair, ids, methods, sizes, gamma, params, drafter, window, hf_check, config, json_path) -> bool:
    from .harness import check_reference_against_hf, divergence_note, reference_outputs, run_equivalence

    with console.status("reference: target-only greedy, batch size 1"):
        refs = reference_outputs(pair, ids, params, config["forward"])
    hf = None
    if hf_check > 0:
        with console.status("checking the reference against transformers' generate"):
            hf = check_reference_against_hf(pair, ids[:hf_check], refs[:hf_check], params)
    with progress_bar(tokens=False) as bar:
        task = bar.add_task("verify", total=len(methods) * len(sizes))
        results = run_equivalence(pair, ids, methods, sizes, gamma, params, drafter=drafter, window=window,
                                  forward=config["forward"], references=refs, engine_options=_options(config),
                                  on_result=lambda r: bar.update(task, advance=1))
    table = Table(title=f"output equivalence vs target-only greedy (bs=1): {len(ids)} prompts, "
                        f"{params.max_new_tokens} new tokens, dtype {config['dtype']}")
    for col in ("method", "batch", "gamma", "exact match", "partial match", "acceptance"):
        table.add_column(col, justify="right")
    for r in results:
        acc = f"{r['acceptance_rate']:.3f}" if r["acceptance_rate"] is not None else "-"
        table.add_row(r["method"], str(r["batch_size"]), str(r["gamma"] or "-"), f"{r['exact_match']:.3f}",
                      f"{r['partial_match']:.3f}", acc)
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


def _verify_sampling(pair, ids, methods, sizes, gamma, params, samples, seed, config, json_path) -> bool:
    from .harness import distribution_check

    results = []
    with progress_bar(tokens=False) as bar:
        task = bar.add_task("sampling check", total=len(methods) * len(sizes))
        for m in methods:
            for bs in sizes:
                for row in distribution_check(pair, ids, params, method=m, batch_size=bs, gamma=gamma,
                                              samples=samples, seed=seed,
                                              engine_options={**_options(config), "drafter": config["drafter"]}):
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


@app.command()
def bench(
    target: str = TARGET, draft: str = DRAFT, prompts: Path = PROMPTS,
    num_prompts: int = typer.Option(32, "--num-prompts"),
    methods: str = typer.Option("autoregressive,eqspec,exspec", "--methods"),
    batch_sizes: str = typer.Option("1,4,8,16,32", "--batch-sizes"),
    gamma: str = typer.Option(str(EngineConfig.gamma), "--gamma", help="Comma-separated γ values"),
    drafters: str = typer.Option(EngineConfig.drafter, "--drafters", help="Comma-separated: draft_model, "
                                                                 "ngram[:min_n,max_n,k], "
                                                                 "suffix[:depth,k,min_prob,max_tokens], "
                                                                 "hybrid[:suffix[:...]|ngram[:...]], oracle:<p> (e.g. "
                                                                 "draft_model,ngram:2,4,10,suffix; see "
                                                                 "docs/drafters.md)"),
    workload: str = typer.Option("plain", "--workload", help="plain: the prompts as read (the bundled ones unless "
                                                             "--prompts); repetitive: each prompt's text twice; "
                                                             "echo: prompt + the target's greedy answer + the "
                                                             "prompt again (the answer is in context to copy); "
                                                             "twice: every prompt sent twice, the whole list "
                                                             "then again (earlier requests hold the answer)"),
    max_new_tokens: str = typer.Option("128", "--max-new-tokens", help="Tokens per prompt: N, or LO-HI for a seeded "
                                                                         "uniform draw per prompt (a mixed workload)"),
    refill: str = typer.Option("continuous", "--refill", help="Comma-separated: continuous, none (the paper's fixed "
                                                              "batches)"),
    max_kv_tokens: int = MAX_KV, max_prefill_tokens: int = MAX_PREFILL,
    draft_window: str = typer.Option(str(EngineConfig.draft_window), "--draft-window",
                                     help="Comma-separated windows of the draft model's context for eqspec/exspec "
                                          "(see generate --draft-window): 128, 0 = the whole context, or 128,0"),
    adaptive: str = typer.Option("on", "--adaptive", help="Comma-separated for eqspec/exspec: on (γ chosen per "
                                                          "round, at most --gamma; the default), off (fixed γ)"),
    budget: str = typer.Option("none", "--budget", help="Comma-separated TETRIS budgets for eqspec/exspec: none, "
                                                        "24 (drafts verified per round) or 2x (2 x batch size)"),
    peers: str = typer.Option("", "--peers", help="'hf' adds transformers generate / assisted generation"),
    repeat: int = typer.Option(1, "--repeat", help="Timed rounds per cell (interleaved); medians are reported"),
    pairing: str = typer.Option("steps", "--pairing", help="steps: the engines of one batch size run together, a "
                                                          "round each in turn (drift falls on all alike; the "
                                                          "default); runs: each cell's whole run on its own"),
    twin: bool = typer.Option(False, "--twin", help="Also run a second, identical autoregressive engine per batch "
                                                    "size: its speed-up over the first is the run's noise floor"),
    temperature: float = TEMPERATURE, top_k: int = TOP_K, top_p: float = TOP_P, seed: int = SEED,
    window: str = typer.Option("4x", "--window", help="exspec windows, comma-separated: 64 = 64 sequences, "
                                                     "4x = 4 x batch size"),
    forward: str = typer.Option("auto", "--forward", help="Comma-separated forwards for our methods: auto (lean "
                                                          "for Llama-family models), hf (transformers modules)"),
    sort_by_length: bool = SORT,
    prompt_tokens: int = typer.Option(None, "--prompt-tokens", help="Cut every prompt to its first N tokens and "
                                                                     "drop shorter ones: identical prompt lengths"),
    profile: bool = typer.Option(False, "--profile", help="CUDA: synchronise at stage boundaries for exact "
                                                          "time shares"),
    dtype: str = DTYPE, device: str = DEVICE,
    json_path: Path = typer.Option(None, "--json", help="Write the full report as JSON"),
    plots: Path = typer.Option(None, "--plots", help="Folder for PNG plots"),
):
    """Throughput, speed-ups, overhead anatomy and the analytic limit for a grid of settings."""
    from .bench import markdown_table, run_bench
    from .bench.report import scheduling_table
    from .bench.runner import PAIRINGS, plan
    from .drafters import drafter_needs_model, parse_drafter, split_drafters
    from .models import load_pair
    from .prompts import apply_workload

    try:
        method_list = parse_list(methods, str, "--methods")
        sizes = parse_list(batch_sizes, int, "--batch-sizes")
        gammas = parse_list(gamma, int, "--gamma")
        drafter_list = split_drafters(drafters)
        if not drafter_list:
            raise ValueError("--drafters is empty")
        if peers not in ("", "hf"):
            raise ValueError(f"--peers takes 'hf' (transformers), got {peers!r}")
        if repeat < 1:
            raise ValueError("--repeat must be >= 1")
        if pairing not in PAIRINGS:
            raise ValueError(f"--pairing takes {' or '.join(PAIRINGS)}, got {pairing!r}")
        for d in drafter_list:
            parse_drafter(d)
        windows = parse_list(window, str, "--window")
        if not all(re.fullmatch(r"[1-9][0-9]*x?", w) for w in windows):
            raise ValueError(f"--window takes sizes like 64 or multiples like 4x, got {window!r}")
        forward_list = parse_list(forward, str, "--forward")
        refills = parse_list(refill, str, "--refill")
        adaptives = parse_list(adaptive, str, "--adaptive")
        if any(a not in ("off", "on") for a in adaptives):
            raise ValueError(f"--adaptive takes off, on or off,on; got {adaptive!r}")
        budgets = parse_list(budget, str, "--budget")
        if not all(b == "none" or re.fullmatch(r"[1-9][0-9]*x?", b) for b in budgets):
            raise ValueError(f"--budget takes none, counts like 24 or multiples like 2x, got {budget!r}")
        plan(method_list, sizes, gammas, drafter_list, False, twin=twin)  # its checks, before any model loads
        options = dict(max_kv_tokens=max_kv_tokens, max_prefill_tokens=max_prefill_tokens)
        draft_windows = [w or None for w in parse_list(draft_window, int, "--draft-window")]
        for m in method_list:
            for bs in sizes:
                for g in gammas:
                    for f in forward_list:
                        for r in refills:
                            for w in draft_windows:
                                EngineConfig(method=m, batch_size=bs, gamma=g, forward=f, refill=r, draft_window=w,
                                             **options)
        texts = apply_workload(workload, read_prompts(None, prompts, num_prompts))
        params = [replace(p, max_new_tokens=n) for p, n in
                  zip(sampling_params(1, temperature, top_k, top_p, seed, len(texts)),
                      new_token_counts(max_new_tokens, len(texts), seed))]
        needs_draft = peers == "hf" or (any(drafter_needs_model(d) for d in drafter_list)
                                        and any(m != "autoregressive" for m in method_list))
        pair = load_pair(target, draft, dtype=dtype, device=device, need_draft=needs_draft)
        ids = [pair.tokenizer(t)["input_ids"] for t in texts]
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

            report = run_bench(pair, ids, params, methods=method_list, batch_sizes=sizes, gammas=gammas,
                               drafters=drafter_list, peers=peers == "hf", repeat=repeat, windows=windows,
                               forwards=forward_list, refills=refills, adaptives=[a == "on" for a in adaptives],
                               budgets=budgets, twin=twin, pairing=pairing, draft_windows=draft_windows,
                               engine_options=options,
                               sort_by_length=sort_by_length, profile=profile, progress=step)
    except ValueError as exc:
        fail(str(exc))
    report["config"]["workload"] = workload
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
        from .bench.plots import plot_all

        for path in plot_all(report["results"], plots, title=f"({m['device']}, {report['config']['dtype']})"):
            console.print(f"wrote {path}")


def echo_workload(pair, ids: list[list[int]], counts: list[int], added: int) -> list[list[int]]:
    """bench --workload echo: each prompt followed by the target's greedy answer (its own `count`
    tokens, autoregressive, untimed) and the prompt again without the `added` special tokens the
    tokenizer put in front (BOS)."""
    from .engine import SpecEngine
    from .prompts import echo_ids
    from .sampling import SamplingParams

    engine = SpecEngine(pair, EngineConfig(method="autoregressive", batch_size=8))
    outs = engine.generate(ids, [SamplingParams(max_new_tokens=n) for n in counts])
    return [echo_ids(p, o.token_ids, p[added:]) for p, o in zip(ids, outs)]


@app.command()
def serve(
    target: str = TARGET, draft: str = DRAFT,
    method: str = typer.Option(None, "--method",
                               help="autoregressive, eqspec or exspec (default: EngineConfig's, eqspec)"),
    batch_size: int = typer.Option(None, "--batch-size", "--max-batch-size",
                                   help="Rows verified together per round (default: EngineConfig's, 8)"),
    gamma: int = GAMMA, window: int = WINDOW, drafter: str = DRAFTER, forward: str = FORWARD, refill: str = REFILL,
    max_kv_tokens: int = MAX_KV, max_prefill_tokens: int = MAX_PREFILL, adaptive: bool = ADAPTIVE,
    budget: int = BUDGET, draft_window: int = DRAFT_WINDOW, dtype: str = DTYPE,
    device: str = DEVICE,
    max_waiting: int = typer.Option(256, "--max-waiting", help="Requests allowed to wait for a row; more get 429"),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (loopback unless told otherwise)"),
    port: int = typer.Option(8000, "--port"),
    api_key: str = typer.Option(None, "--api-key", envvar="BATCHSPEC_API_KEY",
                                help="Require 'Authorization: Bearer KEY' on every endpoint but /health"),
    served_model_name: str = typer.Option(None, "--served-model-name",
                                          help="Model id clients name (default: --target, or batchspec/default_pair)"),
    log_level: str = typer.Option("warning", "--log-level", help="uvicorn log level (info logs every request)"),
    few_rows: int = typer.Option(0, "--single-thread-rows",
                                 help="On a CPU, run rounds on one torch thread while at most this many requests "
                                      "are in the engine, leaving the other cores to the HTTP side (0 = never)"),
    max_prompt_chars: int = typer.Option(None, "--max-prompt-chars",
                                         help=field_docs()["max_prompt_chars"]),
    max_body_bytes: int = typer.Option(None, "--max-body-bytes", help=field_docs()["max_body_bytes"]),
):
    """Serve the engine over an OpenAI-compatible HTTP API (completions, chat, streaming, metrics)."""
    from .server import serve as run_server

    try:
        defaults = EngineConfig()
        config = EngineConfig(method=method or defaults.method, gamma=gamma,
                              batch_size=batch_size or defaults.batch_size, window=window, drafter=drafter,
                              forward=forward,
                              **engine_options(refill, max_kv_tokens, max_prefill_tokens, adaptive, budget,
                                               draft_window))
        if max_waiting < 0:
            raise ValueError(f"--max-waiting must be >= 0, got {max_waiting}")
        if few_rows < 0:
            raise ValueError(f"--single-thread-rows must be >= 0, got {few_rows}")
        server = ServerConfig(host=host, port=port, model_name=served_model_name or target or "batchspec/default_pair",
                              api_key=api_key, max_waiting=max_waiting, few_rows=few_rows, log_level=log_level,
                              max_prompt_chars=max_prompt_chars, max_body_bytes=max_body_bytes)
        engine = load_engine(target, draft, config, dtype, device)
    except ValueError as exc:
        fail(str(exc))
    name = server.model_name
    console.print(f"serving [bold]{name}[/] ({config.method}, batch {config.batch_size}"
                  f"{f', gamma {config.gamma}' if config.speculative else ''}) on http://{host}:{port}/v1"
                  f"{' with an API key' if api_key else ''}")
    try:
        run_server(engine, server)
    except RuntimeError as exc:
        fail(str(exc))


@app.command()
def loadtest(
    url: str = typer.Option("http://127.0.0.1:8000", "--url", help="Server base URL (with or without /v1)"),
    concurrency: int = typer.Option(8, "--concurrency", help="Requests in flight at once"),
    requests: int = typer.Option(64, "--requests", help="Timed requests in all"),
    max_tokens: int = typer.Option(64, "--max-tokens", help="max_tokens of every request"),
    stream: bool = typer.Option(False, "--stream", help="Stream (needed for TTFT and inter-token latency)"),
    prompts: Path = PROMPTS,
    chat: bool = typer.Option(False, "--chat", help="Send each prompt as one user message to /v1/chat/completions"),
    temperature: float = TEMPERATURE,
    model: str = typer.Option(None, "--model", help="Model id to request (default: the first of GET /v1/models)"),
    api_key: str = typer.Option(None, "--api-key", envvar="BATCHSPEC_API_KEY"),
    warmup: int = typer.Option(None, "--warmup", help="Untimed requests first (default: one per concurrent client)"),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds one request may take"),
    json_path: Path = typer.Option(None, "--json", help="Write the report (vllm bench serve's keys) as JSON"),
):
    """Load-test an OpenAI-compatible server with the official openai client."""
    import asyncio

    from .prompts import load_prompts
    from .server.loadtest import format_report, run_loadtest

    try:
        texts = load_prompts(prompts)
        if json_path is not None and not json_path.parent.exists():
            raise ValueError(f"output folder {json_path.parent} does not exist")
        report = asyncio.run(run_loadtest(url, texts, concurrency=concurrency, requests=requests,
                                          max_tokens=max_tokens, stream=stream, chat=chat, temperature=temperature,
                                          model=model, api_key=api_key, warmup=warmup, timeout=timeout))
    except ValueError as exc:
        fail(str(exc))
    table = Table(title=f"{report['model']} at {url}: concurrency {concurrency}, {requests} requests, "
                        f"max_tokens {max_tokens}{', streaming' if stream else ''}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for label, value in format_report(report):
        table.add_row(label, value)
    Console().print(table)
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=2))
    if report["failed"]:
        raise typer.Exit(1)
