"""Which kernel a linear over a few tokens takes on this CPU, chosen by measurement.

`forward.matmul` computes x @ Wᵀ either as `F.linear` or as W @ xᵀ (the weight read in its stored
order, one token fed as two). Which is faster depends on the CPU's BLAS kernels, not on anything
this project controls. Over the bundled target's matrices, 2 threads, float32:

    tokens                    1      2      4      5      8     12     16     32
    AMD EPYC   F.linear     4.4    6.8    8.2    7.2    7.4    8.1    8.5   11.9 ms
               W @ xᵀ       3.8    3.7    4.0    4.8    6.5   10.2    7.4   10.5
    Intel Xeon F.linear     1.95   1.93                 3.92                6.83
               W @ xᵀ       8.54   6.76                 6.40               10.04

so W @ xᵀ, hard-coded after the first machine, made plain decoding at batch 1 4x slower on the
second (91 tokens/s against transformers' 156). Neither is hard-coded now: the first lean forward
of a model on a CPU in float32 times both over the model's own matrices at every token count from
1 to 12 and at 16, 24 and 32, and `skinny_counts` returns the counts at which W @ xᵀ won (a count
between two measured ones follows the larger). The choice is kept per CPU, thread count, torch
version and shapes, in memory and on disk (`batchspec/cache.py`).

Every count up to 12 is timed because decoding feeds them all: a verify pass feeds the batch's
tokens together (4 rows verifying a draft each: 8), and no rule fills a gap. Timed at 1, 2, 4, 8,
16 and 32 only, the EPYC above chose `F.linear` at 8 (7.5 against 7.3 ms: a tie) and with it at 5
to 7, where W @ xᵀ is 1.5x faster: a verify pass at 4 rows by 2 tokens then cost 1.8x a plain
step (13 against 7.5 ms), and the adaptive policy, rightly by those costs, rarely speculated.
Counts are timed in sweeps (every count once per sweep, the best of `repeats` sweeps), after an
untimed pass: timed one count at a time, the first count measured carried the warm-up and a slow
spell of the machine fell on one or two counts (the choice at 1 token flipped between runs).

Every matrix is timed in the order a forward reads them, not one of each shape: a decoding step
streams the whole model through the caches, and a kernel that wins on a matrix already in cache
can lose on one read from memory. Timed one per shape (four matrices, 1.6 MB, cache-resident), the
EPYC above chose `F.linear` at 2 tokens (0.23 against 0.37 ms); over all 33 of the bundled target's
(57 MB) W @ xᵀ wins there (5.4 against 6.2 ms), and plain decoding at batch 2 made 105-114
tokens/s with the first choice against 147-172 with the second. Measuring all of them takes
about 1.5 s for the bundled target, 0.4 s for its draft, once per machine.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from .. import cache

COUNTS = (*range(1, 13), 16, 24, 32)  # token counts timed; W @ xᵀ is never tried above the last
_CHOSEN: dict[tuple, frozenset[int]] = {}


def skinny_counts(weights: list[torch.Tensor], mm, repeats: int = 7) -> frozenset[int]:
    """Token counts (1..COUNTS[-1]) at which `mm(x, weight)` (W @ xᵀ) beats `F.linear` over
    `weights` (all of a forward's matrices, in its order) on this machine; empty off the CPU or
    outside float32, where `F.linear` is used."""
    if not weights or weights[0].device.type != "cpu" or weights[0].dtype != torch.float32:
        return frozenset()
    shapes = sorted({tuple(w.shape) for w in weights})
    key = (tuple(shapes), len(weights), torch.get_num_threads(), torch.__version__)
    if key not in _CHOSEN:
        path = cache.keyed_path("kernels", {"shapes": shapes, "cpu": cache.cpu_name(), "dtype": "float32",
                                            "matrices": len(weights), "counts": COUNTS})
        # (choices timed one matrix per shape, or at fewer counts, are not reused)
        stored = cache.read(path)
        if isinstance(stored, list) and all(isinstance(n, int) for n in stored):
            _CHOSEN[key] = frozenset(stored)
        else:
            _CHOSEN[key] = _measure(weights, mm, repeats)
            cache.write(path, sorted(_CHOSEN[key]))
    return _CHOSEN[key]


def _measure(weights: list[torch.Tensor], mm, repeats: int) -> frozenset[int]:
    kernels = (("linear", F.linear), ("mm", mm))
    best = {(n, name): float("inf") for n in COUNTS for name, _ in kernels}
    with torch.no_grad():
        inputs = {n: [torch.randn(n, w.shape[1]) for w in weights] for n in COUNTS}
        for _, fn in kernels:  # untimed: the first pass over the matrices pays for what the rest do not
            for w, x in zip(weights, inputs[1]):
                fn(x, w)
        for sweep in range(repeats):  # every count once per sweep, the kernels alternating: a slow
            for n in COUNTS:  # spell of a shared machine falls on both kernels and on many counts
                for name, fn in kernels if sweep % 2 else kernels[::-1]:
                    start = time.perf_counter()
                    for w, x in zip(weights, inputs[n]):
                        fn(x, w)
                    best[(n, name)] = min(best[(n, name)], time.perf_counter() - start)
    wins = {n: best[(n, "mm")] < best[(n, "linear")] for n in COUNTS}
    return frozenset(r for r in range(1, COUNTS[-1] + 1) if wins[next(n for n in COUNTS if n >= r)])
