"""What a round costs: a table measured once per (model, device, dtype, threads), corrected online.

    V(b, n)   seconds of a target pass over b rows fed n tokens each (n = 1: a plain step)
    D(b)      seconds of one draft step over b rows (no entry: a model-free drafter, D = 0)
    s         seconds a packed pass saves per token a row is fed below the widest row (the lean
              forward computes only real tokens; its attention still runs at the widest width)
    J(b)      seconds a pass over b rows adds as soon as one row is fed a draft: on a CPU, rows
              of unequal width attend row by row, and the first tokens past one a row start a new
              block of the matrix kernels (SmolLM2 at 32 rows: one row fed 2 tokens, 1.34x a
              plain pass; 16 rows so, 1.41x; every row, 1.65x)

A round in which row i verifies n_i drafts, the rows with a model-drafted row counted by depth
(b_j rows drafting more than j tokens with a model step), is predicted to take

    T = Σ_j D(b_j)  +  max(V(b, 1 + max n_i) - s (b max n_i - Σ n_i),  V(b, 1) + J(b))

(the second term only when some row verifies a draft)

V and D are interpolated linearly between the profiled rows (and extrapolated from the last two),
and piecewise linearly between columns: on a CPU two tokens a row already cost most of what four
do (matrix-vector against matrix-matrix kernels). The one online correction: each stage's
measured seconds over its predicted ones, an exponential average (weight CORRECTION per round)
kept per stage (draft, verify), so the table's shape stays as measured while its level follows
the machine. A machine slowed alike in both stages changes no decision (every candidate's time
scales together); one that slows a stage more moves only that stage's price.

Example, b = 8: V(8, 1) = 20 ms, V(8, 5) = 36 ms, s = 0.5 ms, D(8) = 2 ms, J(8) = 5 ms. Rows
verifying [4, 4, 0, 0, 0, 0, 0, 0] drafts by a model: draft 4 x D(2) (D interpolated to 2 rows),
verify max(V(8, 5) - 0.5 x (8 x 4 - 8), 20 + 5) = max(24, 25) = 25 ms.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass, field

CORRECTION = 0.05  # weight of one round's measured / predicted in a stage's correction (~20 rounds' memory)


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
    scale: dict[str, float] = field(default_factory=lambda: {"draft": 1.0, "verify": 1.0})
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
        return self.scale["verify"] * max(floor, full - self.token_s * (b * deepest - total))

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

        def seconds(total: int, fed: list[float]) -> float:
            d = len(fed)
            verify = full[d] if d < len(full) else _lerp(1 + d, list(self.cols), at)
            return sum(steps[int(n)] for n in fed) + scale * max(first if d else plain, verify - save * (b * d - total))

        return seconds

    def correct(self, stage: str, predicted: float, measured: float) -> None:
        """Move a stage's scale toward measured / predicted (one round's worth: CORRECTION)."""
        if predicted > 0 and measured > 0:
            self.scale[stage] *= (measured / predicted) ** CORRECTION

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
