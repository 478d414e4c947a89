"""Step costs for the analytic speed-up limit, measured at a given batch size and context.

With a one-token target step at batch size B as the unit:
    c = cost of one draft step (one token per row)
    v = cost of one verify step (γ + 1 tokens per row)
and acceptance α, a round emits (1 - α^(γ+1)) / (1 - α) tokens per row for γ·c + v units, so

    ideal_speedup = (1 - α^(γ+1)) / ((1 - α) (γ·c + v)).

Everything a real method loses beyond these costs (alignment, bookkeeping, idle rows) shows as
efficiency = speedup / ideal_speedup < 1.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from .. import cache
from ..core.forward import LEAN_REVISION, make_forward
from ..core.rows import RowBatch, RowKV
from ..core.runner import kv_shape, row_inputs


def ideal_speedup(alpha: float, gamma: int, c: float, v: float) -> float:
    tokens = gamma + 1 if alpha >= 1.0 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return tokens / (gamma * c + v)


def kv_buffer(model, batch: int, capacity: int) -> RowKV:
    """A KV buffer of `batch` rows of `capacity` columns for `model`, filled with random values."""
    layers, heads, head_dim = kv_shape(model)
    kv = RowKV(layers, heads, head_dim, batch, capacity, model.dtype, model.device)
    kv.data.copy_(torch.randn(kv.data.shape, generator=torch.Generator(device="cpu").manual_seed(0)))
    return kv


def step_runner(model, batch: int, context: int, tokens: int, forward: str = "auto",
                first: int | None = None, kv: RowKV | None = None) -> Callable[[], float]:
    """A function that runs one forward of `tokens` tokens per row over a `context`-token KV cache,
    through the forward the engine runs (`batchspec.core.forward`), and returns its seconds; with
    `first`, row 0 is fed that many tokens and every other row `tokens` (a ragged pass). `kv`: a
    buffer of `batch` rows at least context + tokens wide to run in (runners may share one: a pass
    reads its rows' first context + tokens columns, as the engine reads a row of its buffer)."""
    counts = [tokens] * batch if first is None else [first] + [tokens] * (batch - 1)
    tokens = max(counts)
    run = make_forward(model, forward)
    capacity = context + tokens
    kv = kv if kv is not None else kv_buffer(model, batch, capacity)
    gen = torch.Generator(device="cpu").manual_seed(0)
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (batch, tokens), generator=gen).to(model.device)
    positions, visible = row_inputs([context] * batch, tokens, capacity, model.device)
    cuda = model.device.type == "cuda"

    def once() -> float:
        rows = RowBatch(kv, list(range(batch)), [context] * batch, counts)
        if cuda:
            torch.cuda.synchronize(model.device)
        start = time.perf_counter()
        run(ids, positions, rows, visible if tokens > 1 else None)
        if cuda:
            torch.cuda.synchronize(model.device)
        return time.perf_counter() - start

    return once


def fastest(runners: dict, repeats: int, budget_s: float | None = None) -> dict:
    """The fastest of `repeats` runs of each runner (`step_runner`), timed in sweeps: every runner
    once per sweep, after two untimed sweeps. Other work on the machine only ever adds time, so
    the fastest run is the estimate; in sweeps, a slow spell of the machine falls on a run of
    several points, not on every run of one. Timed one point at a time, a profile of the bundled
    pair once read the draft model's step at 2.98 ms where three others read 1.39-1.52, and the
    policy priced the draft model by it from then on (the profile is cached). With `budget_s`, no
    timed sweep begins after the first once that many seconds have passed, and a first sweep that
    took a quarter of it is the only warm-up (a large model's profile stays seconds long).

    Example, runners a, b and repeats 2: a b (warm-up) a b (warm-up) a b a b -> min per runner."""
    best = dict.fromkeys(runners, float("inf"))
    start, warm = time.perf_counter(), 2
    for sweep in range(repeats + 2):
        spent = time.perf_counter() - start
        if budget_s is not None and sweep == 1 and spent > budget_s / 4:
            warm = 1  # a model this slow is warm after one sweep: its weights stream from memory anyway
        if budget_s is not None and sweep > warm and spent > budget_s:
            break
        for key, once in runners.items():
            seconds = once()
            if sweep >= warm:
                best[key] = min(best[key], seconds)
    return best


def step_time(model, batch: int, context: int, tokens: int, repeats: int = 7, forward: str = "auto",
              first: int | None = None) -> float:
    """Seconds of one forward (`step_runner`): the fastest of `repeats` after two warm-ups. Other
    work on the machine only ever adds time, and a profile is cached (`profile_costs`), so one busy
    moment would otherwise stay in it (the median of 5 once read 20.8 ms for a 2-row step that
    runs in 10-11, and 13.5 ms at every depth at batch 1)."""
    return fastest({0: step_runner(model, batch, context, tokens, forward, first)}, repeats)[0]


def step_costs(target, draft, batch: int, context: int, gamma: int, forward: str = "auto") -> dict:
    """{"c": draft step / target step, "v": (γ+1)-token verify / target step, "target_step_s": ...}."""
    t1 = step_time(target, batch, context, 1, forward=forward)
    tv = step_time(target, batch, context, gamma + 1, forward=forward)
    td = step_time(draft, batch, context, 1, forward=forward) if draft is not None else 0.0
    return {"c": td / t1, "v": tv / t1, "target_step_s": t1, "draft_step_s": td, "verify_step_s": tv}


_PROFILES: dict[tuple, dict] = {}
STALE = 0.7  # a cached profile is measured again when a one-token pass now takes less than this share of it
CATCH_UP = 32  # tokens one row is fed at once to price a drafter's catch-up (`catch_up_s`)
PROFILE_BUDGET_S = 8.0  # seconds a profile's timed sweeps may take after the first (`fastest`)
MODEL_FREE_STEP_S = 30e-6  # a model-free drafter's Python work per row per drafted token (scripts/drafter_cost.py)


def profile_costs(target, draft, rows: tuple[int, int], cols: tuple[int, ...], context: int = 128,
                  forward: str = "auto", repeats: int = 5) -> dict:
    """Seconds of a verify pass at rows x cols and of a draft step at each of `rows`, through the
    engine's forward, for the adaptive policy (`sched.cost_model.CostModel`), and `token_s`: what a
    pass at the larger rows and the last column saves per token its other rows are not fed (one
    row fed them all, the rest 1 each). The fastest of `repeats` forwards per point, every point
    timed once per sweep (`fastest`); cached per model, device,
    dtype, thread count, grid and kernel choice (`core/kernels.py`), in memory and on disk
    (`batchspec/cache.py`); one read from disk is measured again if it was taken at a busy moment
    (`_stale`). Without a draft model (a model-free drafter) a draft step is priced at
    MODEL_FREE_STEP_S per row, corrected online.
    `catch_up_s`: what a draft step costs more per token it feeds one row beyond its newest (a
    drafter catching up on tokens it did not see: CATCH_UP tokens at once), far less than a row's
    share of a step (bundled draft, one row: 1.10 ms for 1 token, 1.98 for 32, 8.3 for 300, i.e.
    ~0.025 ms a token against ~0.09 ms a row)."""
    key = (id(target), id(draft), str(target.device), str(target.dtype), torch.get_num_threads(), rows, cols,
           context, forward)
    path = None
    if key not in _PROFILES:
        kernels = [plan.key() if (plan := getattr(make_forward(m, forward), "plan", None)) else None
                   for m in (target, draft) if m is not None]
        path = cache.profile_path(target, draft, {"rows": rows, "cols": cols, "context": context,
                                                       "forward": forward, "repeats": repeats,
                                                       "estimator": "min of sweeps",
                                                       "catch_up": CATCH_UP, "kernels": kernels,
                                                       "lean": LEAN_REVISION})
        cached = cache.load(path)
        if cached is not None and not _stale(cached, target, rows, context, forward):
            _PROFILES[key] = cached
    if key not in _PROFILES:
        b, n = rows[-1], cols[-1]
        passes = {("verify", r, c): (target, r, c, None) for r in rows for c in cols}  # (model, rows, tokens, first)
        if b > 1 and n > 1:  # one row fed n tokens, the others 1: what a packed pass saves per token
            passes[("ragged", b, n)] = (target, b, 1, n)
        if draft is not None:
            passes.update({("draft", r, 1): (draft, r, 1, None) for r in {*rows, 1}})
            passes[("draft", 1, 1 + CATCH_UP)] = (draft, 1, 1 + CATCH_UP, None)
        widest: dict = {}  # one buffer per model and row count, as wide as its widest pass, not one a pass
        for model, r, c, first in passes.values():
            widest[(model, r)] = max(widest.get((model, r), 0), context + max(c, first or 0))
        buffers = {(model, r): kv_buffer(model, r, width) for (model, r), width in widest.items()}
        timed = fastest({name: step_runner(model, r, context, c, forward, first, buffers[(model, r)])
                         for name, (model, r, c, first) in passes.items()}, repeats, PROFILE_BUDGET_S)
        verify = {(r, c): timed[("verify", r, c)] for r in rows for c in cols}
        for i, r in enumerate(rows):  # a noisy machine can time a bigger pass faster: more never costs less
            for j, c in enumerate(cols):
                verify[(r, c)] = max([verify[(r, c)]] + ([verify[(rows[i - 1], c)]] if i else [])
                                     + ([verify[(r, cols[j - 1])]] if j else []))
        token_s = None
        if ("ragged", b, n) in timed:
            token_s = max(0.0, (verify[(b, n)] - timed[("ragged", b, n)]) / ((b - 1) * (n - 1)))
        draft_s = {r: timed[("draft", r, 1)] if draft is not None else MODEL_FREE_STEP_S * r for r in rows}
        catch_up_s = 0.0
        if draft is not None:
            catch_up_s = max(0.0, timed[("draft", 1, 1 + CATCH_UP)] - timed[("draft", 1, 1)]) / CATCH_UP
        _PROFILES[key] = {"verify_s": verify, "token_s": token_s, "draft_s": draft_s, "catch_up_s": catch_up_s}
        cache.save(path, _PROFILES[key])
    return _PROFILES[key]


def _stale(profile: dict, target, rows: tuple[int, ...], context: int, forward: str) -> bool:
    """Whether a profile read from disk was taken at a busy moment: a one-token pass at each of
    its row counts, timed now (3 repeats after 2 warm-ups), runs in less than STALE of what it says. Only
    that way round: a pass timed slower now says the machine is busy now, not that the profile is
    wrong, and measuring again then would cache the busy moment."""
    said = profile["verify_s"]
    return any(step_time(target, b, context, 1, 3, forward) < STALE * said[(b, 1)] for b in rows if (b, 1) in said)

