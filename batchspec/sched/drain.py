"""What a round of a draining batch is worth: the rest of the job decoded plainly, and what it takes off that.

While requests wait, a row that finishes sooner frees its slot for the next one, and every token is
worth the same (`Additive`: b, one per row, plus the expected accepted drafts). When none waits the
batch drains, and the rounds left are paid for by the rows left. With the rows' tokens left sorted,
L_(1) >= L_(2) >= ... >= L_(b), decoding plainly from here runs L_(b) passes over b rows, then
L_(b-1) - L_(b) over b - 1 rows, and so on, so the rest of the job costs

    C(L) = Σ_k m(k) L_(k),     m(k) = V(k) - V(k - 1),  V(0) = 0

V(k) a plain pass over k rows (the cost table's): the row that finishes last pays a whole pass,
m(1) = V(1), and each other row its share of one. A round that commits 1 + e_i tokens of row i
(e_i its expected accepted drafts) leaves L - 1 - e, so it is worth C(L) - C(L - 1 - e) seconds of
that plain rest (`Tail`), counted in tokens of a plain round (b / V(b) per second): a plain round
over rows with a token or more left is worth V(b), b tokens, as while requests wait. What drafts
are worth depends on the other rows: rows tied at the end that all gain move every L_(k), a whole
pass saved per round gained, while one row of many that gains only finishes before its twins, its
share m(b) of the last pass. (Pricing each row on its own by the rank it is expected to finish at
gives the tied rows the middle rank's share whatever the others do: a round drafting for one row
of a tied batch was priced as if all gained.)

Example, V(k) = 20 + 5k ms (m = 25, 5, 5), rows left [30, 30, 2]: C = 25·30 + 5·30 + 5·2 = 910 ms.
A plain round leaves [29, 29, 1], 875: 35 ms = V(3), 3 tokens. One more token of row 0 leaves
[28, 29, 1], 870: 40 ms, the extra 5 (its twin still runs to the end): 3.43 tokens. One more of
rows 0 and 1 each leaves [28, 28, 1], 845: 65 ms, 5.57 tokens: the last pass, 25 ms, is saved too.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence


class Additive:
    """While requests wait: a round is worth `base` tokens plus the expected accepted drafts."""

    def __init__(self, base: float) -> None:
        self.base, self._total = base, base

    def start(self, extra: Sequence[float]) -> float:
        self._total = self.base + sum(extra)
        return self._total

    def add(self, i: int, gain: float) -> float:
        self._total += gain
        return self._total


class Tail:
    """A draining batch (module docstring): rows' tokens left `left`, plain passes plain[k - 1] = V(k)."""

    def __init__(self, left: Sequence[int], plain: Sequence[float]) -> None:
        b = len(left)
        m = [max(0.0, plain[k] - (plain[k - 1] if k else 0.0)) for k in range(b)]
        self._w = m[::-1]  # weights of the ascending order: the least left pays m(b), the most m(1)
        self._unit = b / plain[b - 1] if plain[b - 1] > 0 else 1.0
        self._left = [float(n) for n in left]
        self._now = self._cost(sorted(self._left))
        self._at: list[float] = []  # each row's tokens left after the round
        self._sorted: list[float] = []  # the same, clamped at 0, ascending

    def _cost(self, ascending: list[float]) -> float:
        return sum(w * max(0.0, x) for w, x in zip(self._w, ascending))

    def start(self, extra: Sequence[float]) -> float:
        """What a round committing 1 + extra[i] tokens of row i is worth (tokens of a plain round)."""
        self._at = [n - 1.0 - e for n, e in zip(self._left, extra)]
        self._sorted = sorted(max(0.0, x) for x in self._at)
        return self._worth()

    def add(self, i: int, gain: float) -> float:
        """The same, once row i commits `gain` more (after `start`)."""
        old = max(0.0, self._at[i])
        self._at[i] -= gain
        del self._sorted[bisect_left(self._sorted, old)]
        insort(self._sorted, max(0.0, self._at[i]))
        return self._worth()

    def _worth(self) -> float:
        return (self._now - self._cost(self._sorted)) * self._unit
