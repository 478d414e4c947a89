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

from .costs import CostTable


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
    """A draining batch (module docstring): rows' tokens left `left`, plain passes plain[k - 1] = V(k),
    at most `depth` drafts a row. `add` is O(1): best_budget walks hundreds of drafts a round.

    E[max_i L'_i] = Σ_{t >= 1} (1 - P(every L'_i < t)), L'_i = L_i - 1 - X_i. Row i is below t when
    X_i >= L_i - t: sure where L_i - t <= 0, impossible past its drafts, so only the depth + 1
    thresholds below top = max L_i - 1 can have every row below them, and a row's next draft moves
    one threshold's product: t = L_i - 1 - n_i, n_i its drafts so far (P(X_i >= n_i + 1) was 0)."""

    def __init__(self, left: Sequence[int], plain: Sequence[float], depth: int) -> None:
        b = len(left)
        self._c = max(0.0, (plain[b - 1] - plain[0]) / (b - 1)) if b > 1 else 0.0
        self._a = max(0.0, plain[0] - self._c)
        self._unit = b / plain[b - 1] if plain[b - 1] > 0 else 1.0
        self._left = [max(1, int(n)) for n in left]
        self._top = max(self._left) - 1
        self._low = max(1, self._top - depth)  # thresholds low..top can have every row below them
        self._now = self._c * sum(self._left) + self._a * self._top + self._a
        self._n: list[int] = []

    def start(self, taken: Sequence[Sequence[float]]) -> float:
        """What a round verifying drafts of cumulative gains taken[i] in row i is worth (tokens of a plain round)."""
        self._n = [len(g) for g in taken]
        self._rest = sum(n - 1 - sum(g[:n - 1]) for n, g in zip(self._left, taken))  # E[Σ L'_i]
        # per threshold t: rows not surely below it (zeros) and the product of the others' chances
        self._zeros = {t: 0 for t in range(self._low, self._top + 1)}
        self._prod = dict.fromkeys(self._zeros, 1.0)
        for n, g in zip(self._left, taken):
            for t in range(self._low, min(n - 1, self._top) + 1):
                j = n - t  # below t: X_i >= j >= 1
                if j <= len(g) and g[j - 1] > 0:
                    self._prod[t] *= g[j - 1]
                else:
                    self._zeros[t] += 1
        self._below = sum(p for t, p in self._prod.items() if not self._zeros[t])
        return self._worth()

    def add(self, i: int, gain: float) -> float:
        """The same, once row i verifies one more draft, of cumulative gain `gain` (after `start`)."""
        n, k = self._left[i], self._n[i]
        self._n[i] = k + 1
        if k < n - 1:  # (a row with n left accepts n - 1 drafts at most)
            self._rest -= gain
        t = n - 1 - k  # the threshold whose chance this draft opens
        if t in self._zeros and gain > 0:
            self._zeros[t] -= 1
            self._prod[t] *= gain
            if not self._zeros[t]:
                self._below += self._prod[t]
        return self._worth()

    def _worth(self) -> float:
        return (self._now - self._c * self._rest - self._a * (self._top - self._below)) * self._unit


def tail(table: CostTable, left: Sequence[int] | None, depth: int) -> Tail | None:
    """The pricing of a round over rows with `left` tokens left by `table`'s plain passes (None:
    requests wait, `left` None)."""
    if left is None:
        return None
    return Tail(left, [table.verify(k, 0, 0) for k in range(1, len(left) + 1)], depth)
