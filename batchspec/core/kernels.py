"""How a linear over a few tokens runs on this CPU, chosen by measurement: which kernel, and over
how many rows.

`forward.matmul` computes x @ Wᵀ either as `F.linear` or as W @ xᵀ (the weight read in its stored
order), and may add zero rows to x first: the CPU's BLAS kernels are blocked for some token counts
and slow at the others, and which is which depends on the CPU, not on anything this project
controls. Over the bundled target's matrices, 2 threads, float32:

    tokens                    1      2      4      5      8     12     15     16     32
    AMD EPYC   F.linear     4.0    6.6    7.9    6.4    6.5    7.3    8.4    7.5   10.2 ms
               W @ xᵀ       4.0    2.7    3.0    3.6    4.5    7.4   11.7    5.5    8.4
    Intel Xeon F.linear     1.95   1.93                 3.92                6.83
               W @ xᵀ       8.54   6.76                 6.40               10.04

On the EPYC, 12 tokens (a verify pass of 4 rows by 3) cost 7.3 ms either way, 16 tokens 5.5: fed
as 16 (four zero rows added, their outputs dropped), the pass is 25 % cheaper; one token runs
fastest as two. On the Xeon F.linear wins everywhere (W @ xᵀ, hard-coded after the first machine,
made plain decoding at batch 1 4x slower there: 91 tokens/s against transformers' 156).

Nothing is hard-coded now: the first lean forward of a model on a CPU in float32 times both
kernels over the model's own matrices at every token count from 1 to 32, and `kernel_plan`
returns, for each count n, the cheapest of the two kernels at n or at any larger count (there with
what adding the zero rows costs and a 5 % margin against noise: `Plan`, `plan_from_times`). The
plan is kept per CPU, thread count, torch version and shapes, in memory and on disk
(`batchspec/cache.py`). Zero rows change no other row's numbers in
exact arithmetic; in float32 a different kernel or count may round differently, as a different
batch already does (`batchspec verify` reruns any divergence in float64).

Every count is timed because decoding feeds them all: a verify pass feeds the batch's tokens
together (4 rows verifying 2 draft tokens each: 12), and no rule fills a gap. Timed at 1, 2, 4, 8,
16 and 32 only, the EPYC above chose `F.linear` at 8 (a tie) and with it at 5 to 7, where W @ xᵀ is
1.5x faster, and a verify pass at 4 rows by 2 tokens cost 1.8x a plain step. Counts are timed in
sweeps (every count once per sweep, the best of `repeats` sweeps), after an untimed pass: timed one
count at a time, the first count measured carried the warm-up and a slow spell of the machine fell
on one or two counts.

Every matrix is timed in the order a forward reads them, not one of each shape: a decoding step
streams the whole model through the caches, and a kernel that wins on a matrix already in cache
can lose on one read from memory. Timed one per shape (four matrices, 1.6 MB, cache-resident), the
EPYC above chose `F.linear` at 2 tokens (0.23 against 0.37 ms); over all of the bundled target's
(57 MB) W @ xᵀ wins there (5.4 against 6.2 ms), and plain decoding at batch 2 made 105-114
tokens/s with the first choice against 147-172 with the second. Measuring took 3-5 s for the
bundled target and under 1 s for its draft on the EPYC, once per machine.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .. import cache

COUNTS = tuple(range(1, 33))  # token counts timed; above the last, F.linear as it is
PAD_MARGIN = 0.05  # rows are added only where the larger count is this much faster: not on noise
_CHOSEN: dict[tuple, Plan] = {}


class Plan(NamedTuple):
    """How `forward.matmul` runs a linear over n tokens, 1 <= n < len(fed): over fed[n] rows (n, or
    more: zero rows added), as W @ xᵀ if n is in `mm`, else as `F.linear`.

    Example (the EPYC above): fed[12] = 16 and 12 in mm: x [12, 384] -> [16, 384], W @ xᵀ [out, 16],
    the first 12 columns kept."""
    fed: tuple[int, ...]
    mm: frozenset[int]

    @classmethod
    def everywhere(cls, mm: bool) -> Plan:
        """One kernel at every count, no rows added, except one token fed as two under W @ xᵀ (the
        matrix-vector path it would take instead is the slow one where W @ xᵀ pays at all)."""
        fed = tuple(2 if mm and n == 1 else n for n in range(COUNTS[-1] + 1))
        return cls(fed, frozenset(COUNTS) if mm else frozenset())

    def key(self) -> list:
        """A JSON form, for cache keys."""
        return [list(self.fed), sorted(self.mm)]


def w_xt(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """W @ xᵀ, the kernel `matmul` takes where the plan says so: [out, in] @ [in, n] -> [out, n]."""
    return torch.mm(weight, x.t())


def kernel_plan(weights: list[torch.Tensor], mm=w_xt, linear=F.linear, repeats: int = 7) -> Plan:
    """The fastest way on this machine (`Plan`) to run each token count over `weights` (all of a
    forward's matrices, in its order), timing `linear(x, w)` against `mm(x, w)` (W @ xᵀ); plain
    `F.linear` off the CPU or outside float32."""
    if not weights or weights[0].device.type != "cpu" or weights[0].dtype != torch.float32:
        return Plan.everywhere(mm=False)
    shapes = sorted({tuple(w.shape) for w in weights})
    key = (tuple(shapes), len(weights), torch.get_num_threads(), torch.__version__)
    if key not in _CHOSEN:
        path = cache.keyed_path("kernels", {"shapes": shapes, "cpu": cache.cpu_name(), "dtype": "float32",
                                            "matrices": len(weights), "counts": COUNTS, "padded": True})
        # (choices timed one matrix per shape, at fewer counts or without padding are not reused)
        stored = _stored_plan(cache.read(path))
        if stored is None:
            stored = _measure(weights, linear, mm, repeats)
            cache.write(path, {"fed": list(stored.fed), "mm": sorted(stored.mm)})
        _CHOSEN[key] = stored
    return _CHOSEN[key]


def _stored_plan(data) -> Plan | None:
    """The plan a cache file holds, or None when it holds none this version can use."""
    fed, by_mm = (data.get("fed"), data.get("mm")) if isinstance(data, dict) else (None, None)
    if not isinstance(fed, list) or not isinstance(by_mm, list) or len(fed) != COUNTS[-1] + 1:
        return None
    if not all(isinstance(n, int) for n in [*fed, *by_mm]) or any(m < n for n, m in enumerate(fed)):
        return None
    return Plan(tuple(fed), frozenset(by_mm))


def _measure(weights: list[torch.Tensor], linear, mm, repeats: int) -> Plan:
    kernels = (("linear", linear), ("mm", mm))
    best = {(n, name): float("inf") for n in COUNTS for name, _ in kernels}
    pad_s = float("inf")  # adding zero rows to every matrix's input
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
            start = time.perf_counter()
            for x in inputs[COUNTS[-1] // 2]:
                torch.cat((x, x.new_zeros(1, x.shape[1])))
            pad_s = min(pad_s, time.perf_counter() - start)
    return plan_from_times(best, pad_s)


def plan_from_times(seconds: dict[tuple[int, str], float], pad_s: float) -> Plan:
    """The plan from `seconds[(count, "linear" | "mm")]` at every count in COUNTS: each count n takes
    the cheapest (kernel, m >= n); with m > n, adding the zero rows costs `pad_s` and the kernel's
    time counts PAD_MARGIN more.

    Example: linear/mm 7.3/7.4 ms at 12, 7.5/5.5 at 16, pad 0.1 -> 12 runs as 16 rows of W @ xᵀ
    (5.5 x 1.05 + 0.1 = 5.9 ms against 7.3)."""
    fed, by_mm = [0], set()
    for n in COUNTS:
        _, m, name = min((seconds[(m, name)] * (1 + PAD_MARGIN) + pad_s if m > n else seconds[(m, name)], m, name)
                         for m in COUNTS if m >= n for name in ("linear", "mm"))
        fed.append(m)
        if name == "mm":
            by_mm.add(n)
    return Plan(tuple(fed), frozenset(by_mm))
