"""What a round costs: a table measured once per (model, device, dtype, threads), corrected online.

    V(b, n)   seconds of a target pass over b rows fed n tokens each (n = 1: a plain step)
    D(b)      seconds of one draft step over b rows (no entry: a model-free drafter, D = 0)
    s         seconds a packed pass saves per token a row is fed below the widest row (the lean
              forward computes only real tokens; its attention still runs at the widest width)
    J(b)      seconds a pass over b rows adds as soon as one row is fed a draft: on a CPU, rows
              of unequal width attend row by row, and the first tokens past one a row start a new
              block of the matrix kernels (SmolLM2 at 32 rows: one row fed 2 tokens, 1.34x a
              plain pass; 16 rows so, 1.41x; every row, 1.65x, under W @ xᵀ before the kernel plan
              took oneDNN: core/kernels.py)

A round in which row i verifies n_i drafts, the rows with a model-drafted row counted by depth
(b_j rows drafting more than j tokens with a model step), is predicted to take

    T = Σ_j D(b_j)  +  max(V(b, 1 + max n_i) - s (b max n_i - Σ n_i),  V(b, 1) + J(b))

(the second term only when some row verifies a draft)

V and D are interpolated linearly between the profiled rows (and extrapolated from the last two),
and piecewise linearly between columns: on a CPU two tokens a row already cost most of what four
do (matrix-vector against matrix-matrix kernels). Online corrections, each from measured seconds
over predicted ones:

    level   per stage (draft, verify), an exponential average (weight CORRECTION per round): the
            table's level follows the machine. A machine slowed alike in both stages changes no
            decision (every candidate's time scales together); one that slows a stage more moves
            only that stage's price.
    shape   F, a factor on every pass that verifies a draft: what such passes measured over the
            table's price (an average, weight SHAPE_WEIGHT), over what plain passes measured over
            theirs, while both were seen within SHAPE_FRESH verify passes of each other; otherwise
            F moves toward 1 by SHAPE_RELAX a pass (the table's shape again), so that a factor a
            busy spell left high is not kept by the plain rounds it causes. A run that drafts
            every round would never meet a plain pass: the policy makes one round plain when none
            was seen for SHAPE_FRESH passes (SHAPE_FIRST at first: `plain_due`).
            Why: on a shared machine the shape moves. SmolLM2 at 8 rows on the 2-core EPYC, two
            profiles a minute apart: V(8, 2) / V(8, 1) read 79.5 / 59.7 ms (1.33) in a quiet
            spell and 96.6 / 96.6 (1.00) in a busy one (another tenant's memory traffic slows the
            weight-bound plain pass most). The profile keeps the fastest runs (`core/timing.py`),
            so a cached table holds the quiet shape, and a busy hour's engines priced drafts
            dearer than they were. On walks (tests/test_walk.py) whose drafted passes cost 1.5x /
            1.25x / 0.75x the table's price, the SmolLM2 8-row walk as the hybrid made 0.754x /
            0.897x / 1.398x plain decoding without F, 0.978x / 0.976x / 1.416x with it and its
            plain rounds; at 1x F stays 1.

Example, b = 8: V(8, 1) = 20 ms, V(8, 5) = 36 ms, s = 0.5 ms, D(8) = 2 ms, J(8) = 5 ms. Rows
verifying [4, 4, 0, 0, 0, 0, 0, 0] drafts by a model: draft 4 x D(2) (D interpolated to 2 rows),
verify max(V(8, 5) - 0.5 x (8 x 4 - 8), 20 + 5) = max(24, 25) = 25 ms.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass, field

CORRECTION = 0.05  # weight of one round's measured / predicted in a stage's correction (~20 rounds' memory)
SHAPE_FRESH = 50  # verify passes: plain and drafted passes measured this close together give the shape F
SHAPE_FIRST = 8  # verify passes, all drafted: then a plain one, for F's first measure (`plain_due`)
SHAPE_RELAX = 0.02  # F's move toward 1 per verify pass while it cannot be measured (~50 passes' memory)
SHAPE_LIMITS = (0.5, 2.0)  # F stays within these
SHAPE_WEIGHT = 0.1  # weight of one pass in the averages behind F (~10 passes: a machine's spells are short)


def _lerp(x: float, xs: list[float], ys: list[float]) -> float:
    """Piecewise linear through (xs, ys), xs ascending, extrapolated from the end segments."""
    if len(xs) == 1:
        return ys[0]
    k = min(max(bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[k - 1], xs[k], ys[k - 1], ys[k]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class CostTable:
    rows: tuple[int, ...]  # profiled row counts, ascending
    cols: tuple[int, ...]  # profiled tokens per row: 1, 2, ..., γ + 1
    verify_s: dict[tuple[int, int], float]  # (rows, tokens per row) -> seconds of a target pass
    draft_s: dict[int, float]  # rows -> seconds of one draft step; empty: drafting costs no step
    token_s: float = 0.0  # s above
    first_s: dict[int, float] = field(default_factory=dict)  # rows -> J above; empty: no such floor
    # level per stage (draft, verify) and the shape F of a pass that verifies drafts ("drafted")
    scale: dict[str, float] = field(default_factory=lambda: {"draft": 1.0, "verify": 1.0, "drafted": 1.0})
    # per kind of verify pass (True: drafted), [log of measured / the table's own price, averaged;
    # the verify pass it was last seen at]; and the verify passes seen so far
    _seen: dict = field(default_factory=dict, repr=False, compare=False)
    _passes: int = field(default=0, repr=False, compare=False)
    _by_rows: dict = field(default_factory=dict, repr=False, compare=False)  # b -> V(b, c) per column

    def _columns(self, b: int) -> list[float]:
        at = self._by_rows.get(b)
        if at is None:
            at = self._by_rows[b] = [max(1e-7, _lerp(b, list(self.rows), [self.verify_s[(r, c)] for r in self.rows]))
                                     for c in self.cols]
        return at

    def verify(self, b: int, deepest: int, total: int) -> float:
        """A pass over b rows verifying `total` drafts, the widest row `deepest` of them."""
        at = self._columns(b)
        full = _lerp(1 + deepest, list(self.cols), at)
        floor = at[0] + self.first(b) if deepest > 0 else at[0]
        shape = self.scale["drafted"] if deepest > 0 else 1.0
        return self.scale["verify"] * shape * max(floor, full - self.token_s * (b * deepest - total))

    def first(self, b: int) -> float:
        """J(b): what a pass over b rows adds once a row is fed a draft (0 for one row: V(1, n) has it)."""
        if not self.first_s or b <= 1:
            return 0.0
        keys = [1] + sorted(self.first_s)
        return max(0.0, _lerp(b, keys, [0.0] + [self.first_s[k] for k in keys[1:]]))

    def draft(self, rows: float) -> float:
        """One draft step over `rows` rows (0 rows: no step)."""
        if rows <= 0 or not self.draft_s:
            return 0.0
        keys = sorted(self.draft_s)
        return self.scale["draft"] * max(0.0, _lerp(rows, keys, [self.draft_s[k] for k in keys]))

    def round_s(self, b: int) -> Callable[[int, list[float]], float]:
        """seconds(total, fed) of a round over b rows, for `tetris.best_budget`: fed[j] rows are
        drafted by a model step at depth j (0: none), and `total` drafts are verified, the widest
        row len(fed) deep. The same numbers as `draft` and `verify`, with what depends on b read
        once: a plan calls it for every draft it ranks (hundreds at 32 rows)."""
        steps = [self.draft(n) for n in range(b + 1)]
        at = self._columns(b)
        full = [_lerp(1 + d, list(self.cols), at) for d in range(len(self.cols) + 1)]
        scale, plain, first, save = self.scale["verify"], at[0], at[0] + self.first(b), self.token_s
        drafted = scale * self.scale["drafted"]

        def seconds(total: int, fed: list[float]) -> float:
            d = len(fed)
            verify = full[d] if d < len(full) else _lerp(1 + d, list(self.cols), at)
            level, floor = (drafted, first) if d else (scale, plain)
            return sum(steps[int(n)] for n in fed) + level * max(floor, verify - save * (b * d - total))

        return seconds

    def correct(self, stage: str, predicted: float, measured: float, drafted: bool = False) -> None:
        """Move a stage's level toward measured / predicted (one round's worth: CORRECTION); a verify
        pass also teaches the shape F (`drafted`: it verified drafts; see the module docstring).

        Example (tests/test_policy.py): plain passes measure 1.6x the table's price and drafted
        ones 1.2x, in turn -> F = 0.75 (the averages at their values), and a drafted pass is
        priced at 1.6 x 0.75 = 1.2x the table's once the level has followed; then 100 drafted
        passes and no plain one -> F = 0.75 ** (0.98 ** 51) = 0.90 (the first 49 still within
        SHAPE_FRESH of the last plain pass), on its way back to 1."""
        if not (predicted > 0 and measured > 0):
            return
        if stage == "verify":
            self._shape(predicted, measured, drafted)
        self.scale[stage] *= (measured / predicted) ** CORRECTION

    def plain_due(self) -> bool:
        """Whether the next round should be plain to keep F measured: passes that verify drafts are
        being seen, and no plain pass for SHAPE_FRESH passes (F rests on both kinds; a run that
        drafts every round would otherwise never meet a plain pass and lose F)."""
        spec, plain = self._seen.get(True), self._seen.get(False)
        since = self._passes - (plain[1] if plain else 0)
        return spec is not None and since >= (SHAPE_FRESH if plain else SHAPE_FIRST)

    def _shape(self, predicted: float, measured: float, drafted: bool) -> None:
        self._passes += 1
        own = predicted / (self.scale["verify"] * (self.scale["drafted"] if drafted else 1.0))  # the table's price
        ratio = math.log(measured / own)
        seen = self._seen.get(drafted)
        self._seen[drafted] = [ratio if seen is None else seen[0] + SHAPE_WEIGHT * (ratio - seen[0]), self._passes]
        plain, spec = self._seen.get(False), self._seen.get(True)
        if plain is not None and spec is not None and abs(plain[1] - spec[1]) <= SHAPE_FRESH:
            lo, hi = SHAPE_LIMITS
            self.scale["drafted"] = min(hi, max(lo, math.exp(spec[0] - plain[0])))
        else:
            self.scale["drafted"] **= 1.0 - SHAPE_RELAX

    def to_json(self) -> dict:
        return {"rows": list(self.rows), "cols": list(self.cols), "token_s": self.token_s,
                "verify_s": [[r, c, s] for (r, c), s in self.verify_s.items()],
                "draft_s": [[r, s] for r, s in self.draft_s.items()],
                "first_s": [[r, s] for r, s in self.first_s.items()]}

    @classmethod
    def from_json(cls, data: dict) -> CostTable:
        return cls(tuple(data["rows"]), tuple(data["cols"]), {(r, c): s for r, c, s in data["verify_s"]},
                   {r: s for r, s in data["draft_s"]}, data.get("token_s", 0.0),
                   {r: s for r, s in data.get("first_s", [])})
