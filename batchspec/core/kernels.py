"""How a linear over a few tokens runs on this CPU, chosen by measurement: which kernel, and over
how many rows.

`linear.matmul` computes x @ Wᵀ as `F.linear`, as W @ xᵀ (the weight read in its stored order)
or through oneDNN's inner product on a copy of the weight laid out for it once (`ONEDNN`, what
torch's own compiler runs for a frozen CPU linear), and may add zero rows to x first: the CPU's
BLAS kernels are blocked for some token counts and slow at the others, and which is which
depends on the CPU, not on anything this project controls. Over the bundled target's matrices, 2
threads, float32:

    tokens                    1      2      4      5      8     12     15     16     32
    AMD EPYC   F.linear     4.0    6.6    7.9    6.4    6.5    7.3    8.4    7.5   10.2 ms
               W @ xᵀ       4.0    2.7    3.0    3.6    4.5    7.4   11.7    5.5    8.4
    Intel Xeon F.linear     1.95   1.93                 3.92                6.83
               W @ xᵀ       8.54   6.76                 6.40               10.04

On the EPYC, 12 tokens (a verify pass of 4 rows by 3) cost 7.3 ms either way, 16 tokens 5.5: fed
as 16 (four zero rows added, their outputs dropped), the pass is 25 % cheaper; one token runs
fastest as two. On the Xeon F.linear wins everywhere (W @ xᵀ, hard-coded after the first machine,
made plain decoding at batch 1 4x slower there: 91 tokens/s against transformers' 156).

Over SmolLM2-135M's decoder matrices (425 MB, far past the caches), the same EPYC in a busy
spell, medians of 9 interleaved sweeps:

    tokens          1      2      3      4      5      6      8     12     16     32
    F.linear     45.9   70.4   83.8   62.4   53.9   60.7   61.8   69.7   73.8  115.3 ms
    W @ xᵀ       48.8   27.1   37.5   35.3   47.4   58.0   63.0   67.8   53.5   78.4
    oneDNN       32.7   35.2   28.1   30.2   27.7   30.1   34.4   36.9   43.9   61.5

Both BLAS kernels fall off at a few tokens (W @ xᵀ runs 2 tokens at the memory bus's rate, 8 at
less than half of it); oneDNN on its packed layout stays within 1.3x of its cheapest count up to
12 tokens. A verify pass of 4 rows by 2 tokens cost 1.74x a plain step under the plan without it
and 1.12x with it (through the runner, 4 rows over 128 keys; a plain step 49 -> 42 ms, at 8 rows
78 -> 50 ms). The layout does not depend on the count it is packed for (`PACK_HINT`: packed for
8, 16 or 32, every count ran within noise of the others), so one copy serves every count; it is
a second copy of every matrix (the linears' memory doubles), made only where the plan takes
oneDNN at some count, and planned for only where that copy fits in half the memory available
(`packed_kernel`; $BATCHSPEC_ONEDNN=off turns it off). Its one-token path is slower than its
few-token one: one plan measured on that EPYC fed 1 to 4 tokens to oneDNN as 5 (36.1 ms a plain
step at one row, against 43.7 fed as 1 and 36.9 as 2 rows of W @ xᵀ), 5 and up as they come.

Nothing is hard-coded now: the first lean forward of a model on a CPU in float32 times the
kernels over the model's own matrices at every token count from 1 to 32 and on a ladder above it
(40, 48, ..., 256), and `kernel_plan` returns, for each count n up to 256, the cheapest of the
kernels at n or at any larger count timed (there with what adding the zero rows costs and a 5 %
margin against noise: `Plan`, `plan_from_times`). The
plan is kept per CPU, thread count, torch version and shapes, in memory and on disk
(`batchspec/cache.py`). Zero rows change no other row's numbers in
exact arithmetic; in float32 a different kernel or count may round differently, as a different
batch already does (`batchspec verify --dtype float64` tells such rounding from a bug).

Every count is timed because decoding feeds them all: a verify pass feeds the batch's tokens
together (4 rows verifying 2 draft tokens each: 12), and no rule fills a gap. Timed at 1, 2, 4, 8,
16 and 32 only, the EPYC above chose `F.linear` at 8 (a tie) and with it at 5 to 7, where W @ xᵀ is
1.5x faster, and a verify pass at 4 rows by 2 tokens cost 1.8x a plain step. Counts are timed in
sweeps (every count once per sweep, the best of `repeats` sweeps), after an untimed pass: timed one
count at a time, the first count measured carried the warm-up and a slow spell of the machine fell
on one or two counts.

The ladder covers plain steps and verify passes of 32 to 64 rows (a plain step at 64 rows feeds 64
tokens, a verify pass at 32 rows 32 plus the drafts), where `F.linear` had run unplanned. On the
EPYC: F.linear 14.7, 16.5, 18.6, 20.8 ms at 32, 40, 48, 64 tokens, W @ xᵀ 10.1, 12.5, 11.6, 15.0
(and 17.7 at 46): 33 to 47 tokens run as 48 rows of W @ xᵀ (40 as itself), and a pass of 32
rows with 16 drafts costs 15 % more in its linears than a plain step, not 80 %. Between ladder
counts a count may also run unpadded under F.linear (its time interpolated); above 256, F.linear
as it is. The ladder times the count after each of its steps too (33, 41, ..., 225): a BLAS
kernel is blocked for the step and falls off a cliff one token above it, so F.linear's time
interpolated from the step itself was a fiction. Interpolated from 32 and 40 (13.1 and 13.0 ms),
33 to 35 tokens ran unpadded under F.linear at 13.7-14.6 ms against 11.4 as 40 rows of W @ xᵀ (the
EPYC above; those counts are what a verify pass of 32 rows feeds with 1 to 7 drafts, or of 8 rows
with 25 to 31): a pass of 32 rows with one draft took 1.25-1.3x a plain step. Whether the fiction
won depended on the sweep's noise: three measurements on one machine gave three plans for 33-79.

Every matrix is timed in the order a forward reads them, not one of each shape: a decoding step
streams the whole model through the caches, and a kernel that wins on a matrix already in cache
can lose on one read from memory. Timed one per shape (four matrices, 1.6 MB, cache-resident), the
EPYC above chose `F.linear` at 2 tokens (0.23 against 0.37 ms); over all of the bundled target's
(57 MB) W @ xᵀ wins there (5.4 against 6.2 ms), and plain decoding at batch 2 made 105-114
tokens/s with the first choice against 147-172 with the second. Measuring takes ~10 s for the
bundled target and ~3 s for its draft on the EPYC (17 s for SmolLM2, its packed copies made
after), once per machine (the ladder's counts in the
first LADDER_SWEEPS sweeps only: they take longest and vary least), and never more than about
BUDGET_S whatever the model: a larger one is timed over a stride of its matrices (`_measure`).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .. import cache

DENSE = 32  # every count up to this is timed (decoding and verifying small batches feed them all)
STEPS = (40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)  # and these above it (see the docstring)
LADDER = tuple(sorted({*STEPS, *(n + 1 for n in (DENSE, *STEPS[:-1]))}))  # the steps, and the count after each
COUNTS = (*range(1, DENSE + 1), *LADDER)  # token counts timed; above the last, F.linear as it is
LADDER_SWEEPS = 3  # sweeps that time the ladder too: its counts take longest and vary least
PAD_MARGIN = 0.05  # rows are added only where the larger count is this much faster: not on noise
BUDGET_S = 10.0  # seconds the measurement may take, whatever the model (see `_measure`)
_CHOSEN: dict[tuple, Plan] = {}


class Plan(NamedTuple):
    """How `linear.matmul` runs a linear over n tokens, 1 <= n < len(fed): over fed[n] rows (n, or
    more: zero rows added), as W @ xᵀ if n is in `mm`, through oneDNN's packed weight if n is in
    `dnn`, else as `F.linear`.

    Example (the EPYC above): fed[12] = 16 and 12 in mm: x [12, 384] -> [16, 384], W @ xᵀ [out, 16],
    the first 12 columns kept."""
    fed: tuple[int, ...]
    mm: frozenset[int]
    dnn: frozenset[int] = frozenset()

    @classmethod
    def everywhere(cls, mm: bool) -> Plan:
        """One kernel at every count, no rows added, except one token fed as two under W @ xᵀ (the
        matrix-vector path it would take instead is the slow one where W @ xᵀ pays at all)."""
        fed = tuple(2 if mm and n == 1 else n for n in range(COUNTS[-1] + 1))
        return cls(fed, frozenset(range(1, COUNTS[-1] + 1)) if mm else frozenset())

    def key(self) -> list:
        """A JSON form, for cache keys."""
        return [list(self.fed), sorted(self.mm), sorted(self.dnn)]


def w_xt(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """W @ xᵀ, the kernel `matmul` takes where the plan says so: [out, in] @ [in, n] -> [out, n]."""
    return torch.mm(weight, x.t())


class Packed(NamedTuple):
    """A kernel that runs on a copy of the weight laid out for it once (`pack`), not on the weight:
    `run(x, pack(w), bias)` is x @ wᵀ + bias."""
    pack: Callable[[torch.Tensor], torch.Tensor]
    run: Callable[..., torch.Tensor]


def _onednn() -> Packed | None:
    """oneDNN's inner product on a weight reordered into its blocked layout, as torch's own
    compiler runs a frozen CPU linear (`torch.ops.mkldnn`), or None where this torch lacks it."""
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        if not torch.backends.mkldnn.is_available() or ops is None:
            return None
        def pack(w: torch.Tensor) -> torch.Tensor:
            return ops._reorder_linear_weight(w.detach(), PACK_HINT)

        def run(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            return ops._linear_pointwise(x, packed, bias, "none", [], "")

        w = torch.randn(8, 4)
        torch.testing.assert_close(run(torch.ones(2, 4), pack(w)), F.linear(torch.ones(2, 4), w))
        return Packed(pack, run)
    except (AttributeError, RuntimeError, AssertionError):
        return None


PACK_HINT = 16  # the token count oneDNN lays a packed weight out for; it runs any count (see the docstring)
ONEDNN = _onednn()
ONEDNN_ENV = "BATCHSPEC_ONEDNN"  # "off": never the packed kernel (no second copy of the weights)
PACK_SHARE = 0.5  # the packed copies may take at most this share of the memory available when a model is planned


def packed_kernel(nbytes: int) -> Packed | None:
    """The packed kernel for a forward whose matrices hold `nbytes`, or None: where this torch
    lacks it, where $BATCHSPEC_ONEDNN is "off", or where a second copy of those bytes would take
    more than PACK_SHARE of the memory available now (a 7B model in float32, 28 GB, on a 32 GB
    machine is planned without it rather than run out of memory)."""
    if ONEDNN is None or os.environ.get(ONEDNN_ENV, "").lower() in ("off", "0", "false", "no"):
        return None
    available = available_bytes()
    return ONEDNN if available is None or nbytes <= PACK_SHARE * available else None


def available_bytes() -> int | None:
    """Memory available for new allocations (Linux's MemAvailable), or None where it is not known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def kernel_plan(weights: list[torch.Tensor], mm=w_xt, linear=F.linear, packed: Packed | None = ONEDNN,
                repeats: int = 7) -> Plan:
    """The fastest way on this machine (`Plan`) to run each token count over `weights` (all of a
    forward's matrices, in its order), timing `linear(x, w)` against `mm(x, w)` (W @ xᵀ) and, where
    this torch has it, `packed` (oneDNN on packed copies); plain `F.linear` off the CPU or outside
    float32."""
    if not weights or weights[0].device.type != "cpu" or weights[0].dtype != torch.float32:
        return Plan.everywhere(mm=False)
    shapes = sorted({tuple(w.shape) for w in weights})
    key = (tuple(shapes), len(weights), torch.get_num_threads(), torch.__version__, packed is not None)
    if key not in _CHOSEN:
        path = cache.keyed_path("kernels", {"shapes": shapes, "cpu": cache.cpu_name(), "dtype": "float32",
                                            "matrices": len(weights), "counts": COUNTS, "padded": True,
                                            "packed": "onednn" if packed is not None else None})
        # (choices timed one matrix per shape, at fewer counts, without padding or without the
        # packed kernel are not reused)
        stored = _stored_plan(cache.read(path))
        if stored is None:
            stored = _measure(weights, linear, mm, packed, repeats)
            cache.write(path, {"fed": list(stored.fed), "mm": sorted(stored.mm), "dnn": sorted(stored.dnn)})
        _CHOSEN[key] = stored
    return _CHOSEN[key]


def _stored_plan(data) -> Plan | None:
    """The plan a cache file holds, or None when it holds none this version can use."""
    fed, by_mm, by_dnn = (data.get("fed"), data.get("mm"), data.get("dnn")) if isinstance(data, dict) else (None,) * 3
    if not isinstance(fed, list) or not isinstance(by_mm, list) or not isinstance(by_dnn, list):
        return None
    if len(fed) != COUNTS[-1] + 1 or not all(isinstance(n, int) for n in [*fed, *by_mm, *by_dnn]):
        return None
    if any(m < n for n, m in enumerate(fed)) or set(by_mm) & set(by_dnn):
        return None
    return Plan(tuple(fed), frozenset(by_mm), frozenset(by_dnn))


def _measure(weights: list[torch.Tensor], linear, mm, packed: Packed | None, repeats: int) -> Plan:
    """Times the kernels at every count in sweeps, within BUDGET_S seconds: after the first full
    sweep, sweeps stop once the budget is spent. A model too large for that (one untimed pass over
    its matrices says how long a sweep takes) is timed over every k-th of its matrices, still in
    the order a forward reads them and still far more than the caches hold; only those are packed.

    Example: SmolLM2-135M in float32 (121 matrices, 540 MB) took 12 minutes on a busy 2-core
    EPYC timed whole. An untimed pass of, say, 0.1 s over them (two kernels, one token) estimates a
    sweep at 0.1 s x 3/2 kernels x the counts' sum of max(1, n / 16) (about 250) = 37 s, so every
    8th matrix is timed (about 70 MB): a first sweep of about 5 s, and a second while the budget
    lasts."""
    with torch.no_grad():
        start = time.perf_counter()
        for fn in (linear, mm):  # untimed: the first pass over the matrices pays for what the rest do not
            for w in weights:
                fn(torch.randn(1, w.shape[1]), w)
        # a pass over n tokens costs about one token's up to 16 (reading the weights), n / 16 of it above
        sweep_s = ((time.perf_counter() - start) * (3 if packed is not None else 2) / 2
                   * sum(max(1.0, n / 16) for n in COUNTS))
        weights = weights[:: max(1, math.ceil(2 * sweep_s / BUDGET_S))]  # the first sweep in half the budget
        kernels = [("linear", linear, weights), ("mm", mm, weights)]
        if packed is not None:
            kernels.append(("dnn", packed.run, [packed.pack(w) for w in weights]))
        return plan_from_times(*_sweeps(kernels, repeats, start))


def _sweeps(kernels: list[tuple], repeats: int, start: float) -> tuple[dict, dict]:
    """({(count, kernel): fastest seconds over its operands}, {count: fastest padding seconds}) for
    `kernels` [(name, fn, operands: the weights as fn takes them)]: every count once per sweep, the
    kernels in turn (reversed every other sweep), so that a slow spell of a shared machine falls on
    all of them and on many counts; the ladder in the first LADDER_SWEEPS sweeps only; no sweep
    begins after the first once BUDGET_S has passed since `start`."""
    weights = kernels[0][2]  # (plain weights: the inputs' widths)
    best = {(n, name): float("inf") for n in COUNTS for name, _, _ in kernels}
    pad_s = dict.fromkeys(COUNTS, float("inf"))  # adding a zero row to every matrix's input of n rows
    inputs = {n: [torch.randn(n, w.shape[1]) for w in weights] for n in COUNTS}
    for sweep in range(repeats):
        if sweep and time.perf_counter() - start > BUDGET_S:
            break
        for n in COUNTS if sweep < LADDER_SWEEPS else COUNTS[:DENSE]:
            for name, fn, operands in kernels if sweep % 2 else kernels[::-1]:
                begin = time.perf_counter()
                for w, x in zip(operands, inputs[n]):
                    fn(x, w)
                best[(n, name)] = min(best[(n, name)], time.perf_counter() - begin)
            begin = time.perf_counter()
            for x in inputs[n]:
                torch.cat((x, x.new_zeros(1, x.shape[1])))
            pad_s[n] = min(pad_s[n], time.perf_counter() - begin)
    return best, pad_s


def plan_from_times(seconds: dict[tuple[int, str], float], pad_s: dict[int, float]) -> Plan:
    """The plan from `seconds[(count, kernel)]` at every count in COUNTS, kernel "linear", "mm" and
    perhaps "dnn": each count n up to the last takes the cheapest (kernel, m >= n) among the counts
    timed; with m > n, adding the zero rows costs pad_s[m] (a copy of m rows) and the kernel's time
    counts PAD_MARGIN more.
    A count between two ladder counts (not timed) may also run as itself under `F.linear`, what it
    did before it had a plan, at the time interpolated between theirs (`F.linear`'s time grows
    smoothly with the count from one step of the ladder to the next, the count after a step timed
    too; W @ xᵀ's jumps, so it is never guessed, and neither is the packed kernel's).

    Example: linear/mm 7.3/7.4 ms at 12, 7.5/5.5 at 16, pad_s[16] 0.1 -> 12 runs as 16 rows of W @ xᵀ
    (5.5 x 1.05 + 0.1 = 5.9 ms against 7.3). Between the ladder's 33 and 40: linear 14.7 and 16.5
    ms, mm 12.7 and 12.5 -> 36 runs as 40 rows of W @ xᵀ (13.2 against F.linear's 15.7 at 36)."""
    names = sorted({name for _, name in seconds})
    fed, chosen = [0], {"mm": set(), "dnn": set()}
    for n in range(1, COUNTS[-1] + 1):
        options = [(seconds[(m, name)] * (1 + PAD_MARGIN) + pad_s[m] if m > n else seconds[(m, name)], m, name)
                   for m in COUNTS if m >= n for name in names]
        if n not in COUNTS:
            below, above = max(m for m in COUNTS if m < n), min(m for m in COUNTS if m > n)
            share = (n - below) / (above - below)
            options.append((seconds[(below, "linear")] * (1 - share) + seconds[(above, "linear")] * share,
                            n, "linear"))
        _, m, name = min(options)
        fed.append(m)
        chosen.get(name, set()).add(n)
    return Plan(tuple(fed), frozenset(chosen["mm"]), frozenset(chosen["dnn"]))
