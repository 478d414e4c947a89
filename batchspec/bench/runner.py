"""`batchspec bench`: one measuring path for every method, the baseline and the peers included.

For every cell (method x batch size x γ x drafter, plus the transformers peers) the same
seeded workload is generated after an untimed warm-up, `--repeat` times, and medians are
reported. Ratios are always between cells measured in the same run, and paired: the median
over repeats of a cell's tokens/s over its baseline's in the same repeat. Example, 3 repeats,
autoregressive 400 / 300 / 410 tok/s and a cell 420 / 330 / 400: ratios 1.05, 1.10, 0.98,
speed-up 1.05 (the medians' ratio, 400 / 400, would say 1.00).

How the cells of a repeat share the machine (`--pairing`):
* steps (the default): our engines of one batch size run the workload together, one round
  boundary (`SpecEngine.step`) each in turn, each timed by its own steps; the peers, which
  transformers runs as one call, run after them. A shared machine's speed drifts over seconds
  and the steps of all engines interleave within milliseconds, so the drift falls on every
  side of a ratio alike. Measured on the 2-core EPYC, batch 32, 6 repeats: a second
  autoregressive engine against the first at 0.998-1.002 (standard deviation 0.001), where
  whole runs one after another gave 0.94-1.02 (0.027).
* runs: every cell runs the whole workload on its own, in forward order, then reverse
  (A B B A ...), so drift favours no one on average, but each ratio carries it.

A drafter that learns across requests (suffix's shared trie) forgets before each run: otherwise
a repeat would draft from the answers of the same prompts in the run before it.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, replace
from itertools import groupby

from ..config import EngineConfig
from ..drafters import drafter_spec, drafter_uses_model
from ..engine import SpecEngine
from ..sampling import SamplingParams
from .costs import ideal_speedup, step_costs
from .machine import PeakMemory
from .peers import hf_assisted, hf_generate

OURS = ("autoregressive", "eqspec", "exspec")
PAIRINGS = ("steps", "runs")  # how the cells of a repeat share the machine (`Bench.measure`)


@dataclass(frozen=True)
class Cell:
    method: str
    batch_size: int
    gamma: int | None = None
    drafter: str | None = None
    window: int | None = None  # exspec only
    forward: str | None = None  # ours only: EngineConfig.forward
    refill: str | None = None  # ours only: EngineConfig.refill
    adaptive: bool = False  # eqspec / exspec only: EngineConfig.adaptive
    budget: int | None = None  # eqspec / exspec only: EngineConfig.budget (TETRIS)
    draft_window: int | None = EngineConfig.draft_window  # eqspec / exspec only: EngineConfig.draft_window
    siblings: int = EngineConfig.siblings  # eqspec / exspec only: EngineConfig.siblings
    twin: bool = False  # autoregressive only: a second, identical engine (the run's noise floor, see `plan`)

    @property
    def name(self) -> str:
        """The method as tables show it: "autoregressive", "autoregressive[hf]" when run through
        the transformers modules instead of the default forward, "eqspec[fixed]" with the paper's
        fixed batches (refill none), "autoregressive[twin]" for the noise floor, "eqspec[draft-window=all]"
        for a draft model that sees the whole context (any other window than the default: its size)."""
        default = self.draft_window == EngineConfig.draft_window
        window = None if default else f"draft-window={self.draft_window or 'all'}"
        tags = [t for t in (None if self.forward in (None, "auto") else self.forward,
                            "fixed" if self.refill == "none" else None, "adaptive" if self.adaptive else None,
                            f"budget={self.budget}" if self.budget else None, window,
                            None if self.siblings == EngineConfig.siblings else f"siblings={self.siblings}",
                            "twin" if self.twin else None) if t]
        return f"{self.method}[{','.join(tags)}]" if tags else self.method

    @property
    def label(self) -> str:
        parts = [self.name, f"bs={self.batch_size}"]
        if self.gamma is not None:
            parts.append(f"γ={self.gamma}")
        if self.window is not None:
            parts.append(f"W={self.window}")
        if self.drafter not in (None, "draft_model"):
            parts.append(self.drafter)
        return " ".join(parts)


def window_sizes(spec: list[str], batch_size: int) -> list[int]:
    """exspec windows for one batch size: "4x" is 4 x batch size, "64" is 64 (never below it)."""
    sizes = []
    for item in spec:
        w = batch_size * int(item[:-1]) if item.endswith("x") else int(item)
        w = max(w, batch_size)
        if w not in sizes:
            sizes.append(w)
    return sizes


def budget_size(spec: str, batch_size: int) -> int | None:
    """A TETRIS budget for one batch size: "none" -> None, "24" -> 24, "2x" -> 2 x batch size."""
    if spec == "none":
        return None
    return int(spec[:-1]) * batch_size if spec.endswith("x") else int(spec)


def plan(methods: list[str], batch_sizes: list[int], gammas: list[int], drafters: list[str],
         peers: bool, windows: list[str] = ("4x",), forwards: list[str] = ("auto",),
         refills: list[str] = ("continuous",), adaptives: list[bool] = (True,),
         budgets: list[str] = ("none",), twin: bool = False,
         draft_windows: list[int | None] = (EngineConfig.draft_window,),
         siblings: list[int] = (EngineConfig.siblings,)) -> tuple[list[Cell], list[str]]:
    """The grid, ordered so our methods and the peers alternate; plus notes on what was left out.
    budgets: "none" (no TETRIS budget), "24" (24 verified drafts per round) or "2x" (2 x batch size).
    draft_windows: the draft model's windows (None: the whole context) of the speculative cells;
    siblings: their runner-ups per depth (EngineConfig.siblings).
    twin: after each batch size's cells, a second autoregressive engine, identical to the first: its
    speed-up over it is what the machine alone makes of doing the same work twice (the noise floor
    the other cells' speed-ups are read against), measured as far from the baseline as they are."""
    if twin and "autoregressive" not in methods:
        raise ValueError("--twin measures a second autoregressive engine against the first: add autoregressive "
                         "to --methods")
    cells, notes = [], []
    for bs in batch_sizes:
        policies = [(a, budget_size(b, bs), w, s) for a in adaptives for b in budgets for w in draft_windows
                    for s in siblings]
        if "autoregressive" in methods:
            cells.extend(Cell("autoregressive", bs, forward=f, refill=r) for f in forwards for r in refills)
        if peers:
            cells.append(Cell("hf_generate", bs))
        if "eqspec" in methods:
            cells.extend(Cell("eqspec", bs, g, d, forward=f, refill=r, adaptive=a, budget=c, draft_window=dw,
                              siblings=s)
                         for g in gammas for d in drafters for f in forwards for r in refills
                         for a, c, dw, s in policies)
        if "exspec" in methods:
            cells.extend(Cell("exspec", bs, g, d, w, f, r, a, c, dw, s) for g in gammas for d in drafters
                         for w in window_sizes(list(windows), bs) for f in forwards for r in refills
                         for a, c, dw, s in policies)
        if peers and bs == 1:
            cells.extend(Cell("hf_assisted", 1, g) for g in gammas)
        if twin:
            cells.extend(Cell("autoregressive", bs, forward=f, refill=r, twin=True) for f in forwards for r in refills)
    if peers and 1 not in batch_sizes:
        notes.append("hf_assisted was not run: transformers supports assisted generation at batch size 1 only, "
                     "and batch size 1 was not requested")
    elif peers and any(bs != 1 for bs in batch_sizes):
        others = ", ".join(str(bs) for bs in batch_sizes if bs != 1)
        notes.append(f"hf_assisted runs at batch size 1 only (transformers raises for larger batches); "
                     f"no hf_assisted rows at batch sizes {others}")
    return cells, notes


@dataclass
class Run:
    tokens: int
    seconds: float
    stats: dict | None
    peak_memory_mb: float


class Bench:
    def __init__(self, pair, prompts: list[list[int]], params: list[SamplingParams], *,
                 sort_by_length=False, profile=False, progress: Callable[[str, int, int], None] | None = None,
                 engine_options: dict | None = None) -> None:
        self.pair, self.prompts, self.params = pair, prompts, params
        self.sort_by_length, self.profile = sort_by_length, profile
        self.engine_options = engine_options or {}  # max_kv_tokens, max_prefill_tokens
        self.progress = progress or (lambda label, done, total: None)
        self.engines: dict[Cell, SpecEngine] = {}
        self.references: dict[tuple[int, ...], list[int]] | None = None

    def engine(self, cell: Cell) -> SpecEngine:
        if cell not in self.engines:
            config = EngineConfig(method=cell.method, batch_size=cell.batch_size, gamma=cell.gamma or 1,
                                  drafter=cell.drafter or "draft_model", sort_by_length=self.sort_by_length,
                                  window=cell.window, profile=self.profile, forward=cell.forward or "auto",
                                  refill=cell.refill or "continuous", adaptive=cell.adaptive, budget=cell.budget,
                                  draft_window=cell.draft_window, siblings=cell.siblings, **self.engine_options)
            self.engines[cell] = SpecEngine(self.pair, config)
        return self.engines[cell]

    def run(self, cell: Cell, prompts=None, params=None) -> Run:
        prompts, params = prompts or self.prompts, params or self.params
        with PeakMemory(self.pair.target.device) as mem:
            if cell.method == "hf_generate":
                outs, seconds = hf_generate(self.pair, prompts, params[0], cell.batch_size)
                stats = None
            elif cell.method == "hf_assisted":
                outs, seconds = hf_assisted(self.pair, prompts, params[0], cell.gamma)
                stats = None
            else:
                engine = self.engine(cell)
                if engine.drafter is not None:  # each run starts from the same history (see module doc)
                    engine.drafter.forget()
                results = engine.generate(prompts, params, references=self.references)
                run = engine.last_run
                outs, seconds, stats = [o.token_ids for o in results], run.wall, run.summary()
        return Run(sum(len(o) for o in outs), seconds, stats, mem.peak_mb)

    def run_together(self, cells: list[Cell]) -> dict[Cell, Run]:
        """Our engines for `cells` (not the peers), stepped in turn until every one is done: one
        round boundary (`SpecEngine.step`) of each, in the order given, then again. Each cell's
        seconds are its own steps' (`SpecEngine.recording`), so a machine whose speed drifts
        slows them all alike; its peak memory is the process's over them all (as a single run's
        is over every engine resident)."""
        engines = [self.engine(c) for c in cells]
        tokens = [0] * len(cells)
        with ExitStack() as stack, PeakMemory(self.pair.target.device) as mem:
            records = []
            for engine in engines:
                if engine.drafter is not None:  # each run starts from the same history (see module doc)
                    engine.drafter.forget()
                engine.submit(self.prompts, self.params, references=self.references)
                records.append(stack.enter_context(engine.recording()))
            live = list(range(len(engines)))
            while live:
                for i in list(live):
                    tokens[i] += sum(len(o.output.token_ids) for o in engines[i].step() if o.output is not None)
                    if not engines[i].has_unfinished():
                        live.remove(i)
        return {c: Run(n, rec.wall, rec.summary(), mem.peak_mb) for c, n, rec in zip(cells, tokens, records)}

    def measure(self, cells: list[Cell], repeat: int, pairing: str = "steps") -> dict[Cell, list[Run]]:
        """Warm every cell up, then time `repeat` rounds of them (see the module doc). pairing
        "steps": the cells of one batch size that are ours run together, step by step
        (`run_together`), the peers each on its own after them (before them in odd repeats);
        "runs": every cell runs on its own, one after another."""
        if pairing not in PAIRINGS:
            raise ValueError(f"pairing must be one of {', '.join(PAIRINGS)}, got {pairing!r}")
        if any(c.drafter and c.drafter.startswith("oracle") for c in cells):
            ref_engine = SpecEngine(self.pair, EngineConfig(method="autoregressive", batch_size=8))
            outs = ref_engine.generate(self.prompts, self.params)
            self.references = {tuple(p): o.token_ids for p, o in zip(self.prompts, outs)}
        warm_prompts, warm_params = warmup(self.prompts, self.params, self.pair.target.device.type)
        total, done = len(cells) * (repeat + 1), 0
        for cell in cells:  # untimed warm-up
            self.progress(f"warm-up {cell.label}", done, total)
            self.run(cell, warm_prompts, warm_params)
            done += 1
        runs: dict[Cell, list[Run]] = {c: [] for c in cells}
        for r in range(repeat):
            order = cells if r % 2 == 0 else list(reversed(cells))
            if pairing == "runs":
                for cell in order:
                    self.progress(f"repeat {r + 1}/{repeat} {cell.label}", done, total)
                    runs[cell].append(self.run(cell))
                    done += 1
                continue
            for bs, group in groupby(order, key=lambda c: c.batch_size):
                group = list(group)
                together = [[c for c in group if c.method in OURS]]  # our engines, one job; each peer its own
                alone = [[c] for c in group if c.method not in OURS]
                for job in (together + alone if r % 2 == 0 else alone + together):
                    if not job:  # a batch size with peers only
                        continue
                    if job[0].method in OURS:
                        self.progress(f"repeat {r + 1}/{repeat} bs={bs}: {len(job)} engines in turn", done, total)
                        results = self.run_together(job)
                    else:
                        self.progress(f"repeat {r + 1}/{repeat} {job[0].label}", done, total)
                        results = {job[0]: self.run(job[0])}
                    for cell in job:
                        runs[cell].append(results[cell])
                    done += len(job)
        self.progress("done", done, total)
        return runs


def warmup(prompts: list, params: list[SamplingParams], device_type: str) -> tuple[list, list[SamplingParams]]:
    """The untimed run before a cell's repeats. On a CPU two prompts of 8 tokens warm up all there is
    (kernel plans are made at the first forward). On CUDA the whole workload: kernels and memory are
    set up per shape, and after a two-prompt warm-up an H200's first repeat ran at a tenth of the
    second's speed (304 against 3846 tokens/s at batch 32).

    >>> p = SamplingParams(max_new_tokens=32)
    >>> [len(warmup([[1], [2], [3]], [p] * 3, d)[0]) for d in ("cpu", "cuda")]
    [2, 3]
    >>> warmup([[1], [2], [3]], [p] * 3, "cpu")[1][0].max_new_tokens
    8
    """
    if device_type == "cuda":
        return prompts, params
    return prompts[:2], [replace(p, max_new_tokens=min(p.max_new_tokens, 8)) for p in params[:2]]


def summarize(runs: dict[Cell, list[Run]], costs: dict[tuple[int, int], dict], pair) -> list[dict]:
    """One result row per cell with medians, spreads and every ratio to same-run baselines."""
    tps = {c: [r.tokens / r.seconds for r in rs] for c, rs in runs.items()}
    med = {c: statistics.median(v) for c, v in tps.items()}

    def base(method: str, bs: int, gamma=None, forward="auto", refill="continuous") -> Cell | None:
        for c in med:
            if (c.method == method and c.batch_size == bs and (gamma is None or c.gamma == gamma) and not c.twin
                    and (c.forward or "auto") == forward and (c.refill or "continuous") == refill):
                return c
        return None

    def ratios(cell: Cell, baseline: Cell | None) -> list[float] | None:
        """The per-repeat ratios (see the module doc); None if the two cells do not have a run in
        every repeat alike."""
        if baseline is None or len(tps[cell]) != len(tps[baseline]):
            return None
        return [a / b for a, b in zip(tps[cell], tps[baseline])]

    def ratio(cell: Cell, baseline: Cell | None) -> float | None:
        """Median of the per-repeat ratios; the medians' ratio if there are none."""
        if baseline is None:
            return None
        paired = ratios(cell, baseline)
        return statistics.median(paired) if paired else med[cell] / med[baseline]

    rows = []
    for cell, rs in runs.items():
        middle = sorted(rs, key=lambda r: r.tokens / r.seconds)[len(rs) // 2]
        fwd = cell.forward or "auto"  # a peer's speed-up is over our default autoregressive
        refill = cell.refill or "continuous"
        ar_same = base("autoregressive", cell.batch_size, forward=fwd, refill=refill)
        ar_bs1 = base("autoregressive", 1, forward=fwd, refill=refill)
        hf_same = base("hf_generate", cell.batch_size)
        hf_assist = base("hf_assisted", 1, cell.gamma) if cell.batch_size == 1 else None
        ours = cell.method in OURS
        row = {
            "method": cell.name, "batch_size": cell.batch_size, "gamma": cell.gamma, "window": cell.window,
            "forward": cell.forward, "refill": cell.refill, "twin": cell.twin,
            "draft_window": cell.draft_window if cell.method in ("eqspec", "exspec") else None,
            "siblings": cell.siblings if cell.method in ("eqspec", "exspec") else None,
            "drafter": cell.drafter if cell.method in ("eqspec", "exspec") else None,
            "synthetic": bool(cell.drafter and drafter_spec(cell.drafter).synthetic),
            "tokens": middle.tokens, "seconds": middle.seconds,
            "tokens_per_s": med[cell], "tokens_per_s_min": min(tps[cell]), "tokens_per_s_max": max(tps[cell]),
            "tokens_per_s_runs": tps[cell],  # per repeat, in order: what the paired ratios divide
            "repeats": len(rs),
            "speedup": ratio(cell, ar_same),
            "speedup_runs": ratios(cell, ar_same),  # per repeat: the spread the median is taken over
            "speedup_vs_bs1": ratio(cell, ar_bs1),
            "vs_hf_generate": ratio(cell, hf_same) if ours else None,
            "vs_hf_assisted": ratio(cell, hf_assist) if ours else None,
            "peak_memory_mb": max(r.peak_memory_mb for r in rs),
        }
        stats = middle.stats
        if stats is not None:
            hist = Counter()
            for r in rs:
                hist.update({int(k): v for k, v in r.stats["accept_hist"].items()})
            row.update({k: stats[k] for k in ("acceptance_rate", "tokens_per_round", "time_share",
                                              "idle_rows_per_round", "padding_tokens_per_round",
                                              "mean_batch_occupancy", "moved_rows_per_round", "peak_kv_tokens",
                                              "adaptive",
                                              "prefill_forwards", "fused_prefills")})
            row["accept_hist"] = {str(k): hist[k] for k in sorted(hist)}
            # runner-ups verified beside chains, and those taken (`siblings`: the cell's setting)
            row["siblings_verified"], row["sibling_hits"] = stats.get("siblings"), stats.get("sibling_hits")
        if cell.method in ("eqspec", "exspec") and (cell.batch_size, cell.gamma, fwd) in costs:
            cost = costs[(cell.batch_size, cell.gamma, fwd)]
            alpha = stats["acceptance_rate"] or 0.0
            # a model-free drafter (ngram, suffix) runs no draft step: c = 0
            row["c"], row["v"] = cost["c"] if drafter_uses_model(cell.drafter or "draft_model") else 0.0, cost["v"]
            row["ideal_speedup"] = ideal_speedup(alpha, cell.gamma, row["c"], row["v"])
            row["efficiency"] = row["speedup"] / row["ideal_speedup"] if row["speedup"] else None
        elif cell.method == "autoregressive":
            row["ideal_speedup"], row["efficiency"] = 1.0, row["speedup"]
        rows.append(row)
    return rows


def measure_costs(pair, cells: list[Cell], context: int) -> dict[tuple[int, int, str], dict]:
    """Step costs per (batch size, γ, forward) of the speculative cells."""
    out = {}
    for cell in cells:
        key = (cell.batch_size, cell.gamma, cell.forward or "auto")
        if cell.method in ("eqspec", "exspec") and key not in out:
            # the oracle drafter runs the draft model when there is one, so c is the same
            out[key] = step_costs(pair.target, pair.draft, cell.batch_size, context, cell.gamma, forward=key[2])
    return out
