"""What a round of a draining batch is worth: what it takes off the rest of the job, decoded plainly.

While requests wait, a row that finishes sooner frees its slot for the next one, and every token is
worth the same (`Additive`: b, one per row, plus the expected accepted drafts). When none waits the
batch drains, and the rounds left are paid for by the rows left: a plain pass over k rows costs
V(k) ≈ a + c k (c = (V(b) - V(1)) / (b - 1), a = V(1) - c: what a pass costs whatever its rows),
and with L_i tokens left in row i, decoding plainly from here runs max L_i passes over ever fewer
rows, so the rest of the job costs

    C(L) = c Σ_i L_i + a max_i L_i

A round in which row i verifies drafts accepted with P(X_i >= j) = G_ij (its cumulative gains)
leaves L_i - 1 - X_i, so it is worth C(L) - E[C(L - 1 - X)] seconds of that plain rest (`Tail`),
counted in tokens of a plain round (b / V(b) a second): a plain round over rows with a token or
more left is worth V(b), b tokens, as while requests wait. Every accepted token saves c; a pass, a,
is saved only if the row with the most left gains, or, among rows tied for the most, every one of
them: E[max] is taken over the rows' acceptances (independent), so drafting for one of eight tied
rows at 0.6 buys c a token, for all eight 0.6^8 of a pass more.

Example, V(k) = 20 + 5k ms (a = 20, c = 5), rows left [30, 30, 2]: C = 5·62 + 20·30 = 910 ms. A
plain round leaves [29, 29, 1], 875: 35 ms = V(3), 3 tokens. Row 0 verifying one draft accepted at
0.5: 0.5 x 5 ms more (its twin still runs to the end): 3.21 tokens. Rows 0 and 1 so: 2 x 2.5 ms,
and the last pass (20 ms) when both accept, 0.25: 45 ms, 3.86 tokens.
"""

from __future__ import annotations

from collections.abc import Sequence


class Additive:
    """While requests wait: a round is worth `base` tokens plus the expected accepted drafts."""

    def __init__(self, base: float) -> None:
        self.base, self._total = base, base

    def start(self, taken: Sequence[Sequence[float]]) -> float:
        self._total = self.base + sum(map(sum, taken))
        return self._total

    def add(self, i: int, gain: float) -> float:
        self._total += gain
        return self._total


class Tail:
    """A draining batch (module docstring): rows' tokens left `left`, plain passes plain[k - 1] = V(k)."""

    def __init__(self, left: Sequence[int], plain: Sequence[float]) -> None:
        b = len(left)
        self._c = max(0.0, (plain[b - 1] - plain[0]) / (b - 1)) if b > 1 else 0.0
        self._a = max(0.0, plain[0] - self._c)
        self._unit = b / plain[b - 1] if plain[b - 1] > 0 else 1.0
        self._left = [max(1, int(n)) for n in left]
        self._now = self._c * sum(self._left) + self._a * max(self._left)
        self._gains: list[list[float]] = []

    def start(self, taken: Sequence[Sequence[float]]) -> float:
        """What a round verifying drafts of cumulative gains taken[i] in row i is worth (tokens of a plain round)."""
        self._gains = [list(g) for g in taken]
        return self._worth()

    def add(self, i: int, gain: float) -> float:
        """The same, once row i verifies one more draft, of cumulative gain `gain` (after `start`)."""
        self._gains[i].append(gain)
        return self._worth()

    def _worth(self) -> float:
        rows = list(zip(self._left, self._gains))
        # E[L_i - 1 - X_i], X_i capped at L_i - 1 (a row ends at 0)
        rest = sum(n - 1 - sum(g[:n - 1]) for n, g in rows)
        # E[max]: at least lo; above it, 1 - P(every row is below t), row i below t when X_i >= n_i - t
        lo = max(max(0, n - 1 - len(g)) for n, g in rows)
        top = max(n - 1 for n, _ in rows)
        most = float(lo)
        for t in range(lo + 1, top + 1):
            below = 1.0
            for n, g in rows:
                j = n - t  # row i below t: X_i >= j (sure for j <= 0, impossible past its drafts)
                if j > 0:
                    below *= g[j - 1] if j <= len(g) else 0.0
            most += 1.0 - below
        return (self._now - self._c * rest - self._a * most) * self._unit
