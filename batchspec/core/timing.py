"""Timing one forward of a model through the engine's forward, for cost tables and benchmarks.

The fastest of several runs is the estimate: other work on a shared machine only ever adds time.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from .forward import make_forward
from .rows import RowBatch, RowKV
from .runner import kv_shape, row_inputs


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
    timed sweep begins after the second once that many seconds have passed (one alone can be a busy
    moment: a 64-row plain pass of SmolLM2 once read 284 ms, 197 measured again), and a first sweep that
    took a quarter of it is the only warm-up (a large model's profile stays seconds long).

    Example, runners a, b and repeats 2: a b (warm-up) a b (warm-up) a b a b -> min per runner."""
    best = dict.fromkeys(runners, float("inf"))
    start, warm = time.perf_counter(), 2
    for sweep in range(repeats + 2):
        spent = time.perf_counter() - start
        if budget_s is not None and sweep == 1 and spent > budget_s / 4:
            warm = 1  # a model this slow is warm after one sweep: its weights stream from memory anyway
        if budget_s is not None and sweep > warm + 1 and spent > budget_s:  # (two timed sweeps at least)
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


