"""What a round costs: the seconds of a draft step and of a verify pass by rows and tokens, from a
short profile at start-up (`bench/costs.py`) corrected online by what rounds measure. The adaptive
policy (`adaptive.py`) prices its plans with it; `guard.py` corrects what it still misses.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass, field


def _lerp(x: float, x0: float, x1: float, y0: float, y1: float) -> float:
    return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def rows_bucket(rows: int) -> int:
    """Batch sizes in powers of two (1, 2-3, 4-7, ...), for what is learned per batch size."""
    return max(1, rows).bit_length()


@dataclass
class CostModel:
    """Seconds of a verify pass V(b, n) and a draft step D(b), from a profile on a grid of rows
    {b0, b1} x columns (1, 2, ..., γ + 1), interpolated (and extrapolated) linearly in rows and
    piecewise linearly in columns, times online corrections. Every column is profiled because the
    cost is far from linear in them on a CPU: one token per row runs matrix-vector products, two
    already pay most of what four do (measured at batch 1: 8.5, 12.8, 14 ms for 1, 2, 4 tokens).

    A packed pass (`ragged`: rows fed different numbers of tokens, only real ones computed) costs
    the pass at its longest row's columns less `token_s` per token the other rows are not fed: its
    attention and bookkeeping run at the longest row's width whatever the others verify. Measured
    at 32 rows, 160 keys: plain 25.5 ms, one row fed 2 tokens 31.5, one row fed 5 34.6, all fed 5
    66.6 (token_s 0.26 ms); by tokens alone the pass with one row at 5 would cost 26.8. Profiled at
    b1 rows and taken as constant in rows (0.31, 0.26, 0.21 ms at 8, 32, 64 rows); without it
    (None), the profile's own slope per token, as if the cost grew with tokens alone.

    A drafter behind on a row feeds it what it missed in its first step: `catch_up_s` per token
    beyond the newest (profiled on one row; None: as much as a row of a step), which `catch_up`
    turns into rows' worth of a step, the unit the plan prices depth 0 in (`first_fed`)."""

    rows: tuple[int, int]
    cols: tuple[int, ...]
    verify_s: dict[tuple[int, int], float]  # (rows, cols) -> seconds
    draft_s: dict[int, float]  # rows -> seconds of one draft step
    token_s: float | None = None  # seconds a packed pass saves per token a row is fed below the longest
    catch_up_s: float | None = None  # seconds a draft step costs more per token it feeds a row beyond its newest
    verify_scale: float = 1.0  # measured / profiled, rounds that verify drafts
    depth_scale: dict = field(default_factory=dict)  # (rows bucket, deepest row's drafts) -> the same over verify_scale
    plain_scale: float = 1.0  # ... plain rounds (one token per row)
    draft_scale: float = 1.0
    _cached_b: int | None = field(default=None, repr=False, compare=False)
    _cached: list[float] = field(default_factory=list, repr=False, compare=False)
    _columns: dict = field(default_factory=dict, repr=False, compare=False)  # b -> see round_seconds
    _version: int = field(default=0, repr=False, compare=False)  # corrections so far (`correct`)
    _scaled: dict = field(default_factory=dict, repr=False, compare=False)  # b -> (version, scales, plain)

    def verify(self, b: int, n: float) -> float:
        """A pass feeding every row n tokens."""
        scale = self.plain_scale if n <= 1 else self.spec_scale(b, math.ceil(n) - 1)
        return max(1e-6, scale * self.profiled(b, n))

    def ragged(self, b: int, total: int, deepest: int) -> float:
        """A packed pass over b rows verifying `total` drafts, the longest row `deepest` of them."""
        if deepest == 0:
            return self.verify(b, 1)
        unscaled = self.profiled(b, 1 + deepest) - self.saving(b) * (b * deepest - total)
        return max(1e-6, self.spec_scale(b, deepest) * max(self.profiled(b, 1), unscaled))

    def spec_scale(self, b: int, deepest: int) -> float:
        """Measured / profiled for a pass whose longest row verifies `deepest` drafts: the scale of
        all speculative rounds times what such passes (per batch size, in powers of two, and
        depth) measured relative to it, 1 until they ran. One scale for every depth would take
        the profile's shape as exact, and a short profile on a shared machine gets it wrong: on
        the EPYC at batch 1 it read 13.5 ms at every depth (a slow first column, and a bigger
        pass never costs less), where the rounds measured 11-12 ms up to 3 drafts and 13.5 ms at
        4, so the 4th draft looked free. Relative, not absolute: a depth's own record moves only
        when such passes run, and kept absolute it went stale while the shared scale moved (batch
        2: depths 1, 3 and 4 learnt at 0.9-1.0 of a profile that read twice the real cost, then
        rarely run again, while the shared scale fell to 0.63; the plan saw V(2, 2) at 20 ms
        against 14 for V(2, 3), and drafted almost only 2). The price: the shared scale follows
        the mix of depths run, so once a depth learnt dear stops running, the cheaper ones pull
        the shared scale, and its price, down until it runs again and is measured again."""
        return self.verify_scale * self.depth_scale.get((rows_bucket(b), deepest), 1.0)

    def saving(self, b: int) -> float:
        """Seconds saved per token a row of a packed pass is not fed (see the class docstring)."""
        if self.token_s is not None:
            return self.token_s
        at, cols = self._at_rows(b), self.cols
        return max(0.0, (at[-1] - at[0]) / ((cols[-1] - cols[0]) * b)) if cols[-1] > cols[0] else 0.0

    def profiled(self, b: int, n: float) -> float:
        """V(b, n) as profiled, without the online corrections."""
        cols, at = self.cols, self._at_rows(b)
        k = min(max(bisect_left(cols, n), 1), len(cols) - 1)  # segment [k-1, k]: cols[k-1] < n <= cols[k]
        return _lerp(n, cols[k - 1], cols[k], at[k - 1], at[k])

    def _at_rows(self, b: int) -> list[float]:
        """V(b, c) for every profiled column c (unscaled); a plan asks for one b hundreds of times."""
        if self._cached_b != b:
            b0, b1 = self.rows
            self._cached_b = b
            self._cached = [_lerp(b, b0, b1, self.verify_s[(b0, c)], self.verify_s[(b1, c)]) for c in self.cols]
        return self._cached

    def draft(self, b: float) -> float:
        b0, b1 = self.rows
        return max(0.0, self.draft_scale * _lerp(b, b0, b1, self.draft_s[b0], self.draft_s[b1]))

    def catch_up(self, b: int, tokens: float) -> float:
        """`tokens` a drafter feeds one row to catch up, in rows' worth of a draft step over b rows
        (its cost per added row, which is what the plan charges per unit of `first_fed`). Example:
        D(1) = 1.10 ms, D(2) = 1.19 ms (0.09 ms a row), catch_up_s 0.027 ms: 20 tokens -> 6 rows."""
        b0, b1 = self.rows
        per_row = (self.draft_s[b1] - self.draft_s[b0]) / (b1 - b0) if b1 != b0 else 0.0
        if self.catch_up_s is None or per_row <= 0:
            return tokens
        return tokens * min(1.0, self.catch_up_s / per_row)

    def round_seconds(self, b: int, packed: bool = True, drafted_s: float | None = None,
                      spec_s: float = 0.0) -> Callable:
        """seconds(total, fed) of a round over b rows: a draft step per depth j feeding fed[j]
        tokens (`draft`, of max(fed[j], b) rows when not packed), or `drafted_s` when the drafting
        is done, plus a verify pass of `total` drafts, the longest row len(fed) deep (`ragged`, or
        `verify` at 1 + len(fed) columns when not packed), plus `spec_s` when it verifies any. The
        same numbers as those methods, with what depends on b read once: a plan calls it for every
        draft it ranks (hundreds at 32 rows)."""
        b0, b1 = self.rows
        slope = (self.draft_s[b1] - self.draft_s[b0]) / (b1 - b0) if b1 != b0 else 0.0
        base, dscale = self.draft_s[b0] - slope * b0, self.draft_scale
        table = self._columns.get(b)
        if table is None:  # unscaled V at every depth
            table = self._columns[b] = [self.profiled(b, 1 + d) for d in range(self.cols[-1])]
        last, save, floor = len(table) - 1, self.saving(b), table[0]
        scaled = self._scaled.get(b)  # (the scales move only in `correct`: read once per correction)
        if scaled is None or scaled[0] != self._version:
            scaled = self._scaled[b] = (self._version, [self.spec_scale(b, d) for d in range(len(table))],
                                        max(1e-6, self.plain_scale * self.profiled(b, 1)))
        _, scales, plain = scaled

        linear = packed and base + slope >= 0 and slope >= 0  # no step clamped at 0 (a step feeds >= 1)

        def seconds(total: int, fed: list[float]) -> float:
            if drafted_s is not None:
                draft = drafted_s
            elif linear:  # (a depth that feeds nothing runs no step)
                draft = dscale * ((len(fed) - fed.count(0)) * base + slope * sum(fed))
            else:
                draft = dscale * sum(max(0.0, base + slope * (n if packed else max(n, b))) for n in fed if n)
            deepest = len(fed)
            if total == 0:
                return draft + plain
            if deepest <= last:
                unscaled, spec = table[deepest], scales[deepest]
            else:
                unscaled, spec = self.profiled(b, 1 + deepest), self.spec_scale(b, deepest)
            if packed:
                unscaled = max(floor, unscaled - save * (b * deepest - total))
            return draft + max(1e-6, spec * unscaled) + spec_s

        return seconds

    def correct(self, predicted_verify: float, measured_verify: float, predicted_draft: float,
                measured_draft: float, plain: bool = False, weight: float = 0.1, rows: int = 0,
                deepest: int = 0) -> None:
        """Move the scales toward measured / predicted (an exponential average). Plain rounds and
        rounds that verify drafts keep separate verify scales: what a speculative round costs
        beyond its passes (ragged bookkeeping, proposals, the policy itself) is not a plain
        round's, and plain rounds, often the majority, would otherwise set the scale the
        speculative ones are predicted by. Given the round's `rows` and its longest row's
        `deepest` drafts, a speculative round moves the shared scale by its measured / profiled
        and that depth's relative one by what is left (`spec_scale`)."""
        if predicted_verify > 0 and measured_verify > 0:
            if plain:
                self.plain_scale *= (measured_verify / predicted_verify) ** weight
            elif rows and deepest:
                key = (rows_bucket(rows), deepest)
                relative = self.depth_scale.get(key, 1.0)
                profiled = predicted_verify / (self.verify_scale * relative)  # what it was priced from
                self.verify_scale *= (measured_verify / (self.verify_scale * profiled)) ** weight
                now = self.spec_scale(rows, deepest) * profiled  # the shared scale moved, the depth's not yet
                self.depth_scale[key] = relative * (measured_verify / now) ** weight
            else:
                self.verify_scale *= (measured_verify / predicted_verify) ** weight
        if predicted_draft > 0 and measured_draft > 0:
            self.draft_scale *= (measured_draft / predicted_draft) ** weight
        self._version += 1
