"""Adaptive speculation: each round, the draft length that maximises expected tokens per second.

Pure Python over numbers the engine measures. With per-request acceptance estimates α_i, a round
in which row i verifies γ_i drafts commits on average

    E_i(γ_i) = (1 - α_i^(γ_i + 1)) / (1 - α_i)          (1 when γ_i = 0: the bonus token alone)

tokens, and costs g·D(b) + V(b, 1 + g) seconds for b rows and g = max γ_i: g draft steps and one
verify pass that feeds every row g + 1 columns (rows are padded to the longest, so a shorter
γ_i saves nothing in the pass). The policy tries every g in 0..γ and keeps the one with the most
Σ_i E_i(min(g, cap_i)) per second (E_i from per-position rates, see `expected_tokens_runs`,
with row i's own first-draft rate); g = 0 is a plain decoding round (no draft step at all), which
is what it picks when speculation does not pay, e.g. at large batch sizes on a CPU where the
verify pass is compute-bound.

D and V come from a short profile at start-up (`profile_costs`, one forward per grid point, cached
per model, device, dtype and thread count) interpolated linearly in rows and columns, and are
corrected online by the ratio of measured to predicted stage times (an exponential average).
α_i starts from the pair's running acceptance and follows the request's own record.

Example, b = 8, D = 2 ms, V(8, n) = 20, 24, 28, 32 ms for n = 1..4, every α = 0.6:
    g = 0: 8 tokens / 20 ms = 400 tok/s      g = 1: 8 x 1.6 / (2 + 24) ms = 492 tok/s
    g = 2: 8 x 1.96 / 32 ms = 490 tok/s      g = 3: 8 x 2.18 / 38 ms = 458 tok/s     -> g = 1
    with every α = 0.2 instead: g = 1 gives 8 x 1.2 / 26 ms = 369 tok/s, the best draft -> g = 0
"""

from __future__ import annotations

from dataclasses import dataclass, field


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens a round commits when every draft is accepted with probability alpha independently."""
    if gamma <= 0:
        return 1.0
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_tokens_runs(first: float, later: list[float], gamma: int) -> float:
    """Tokens a round commits when d_1 is accepted with probability `first` and d_j (j > 1), given
    d_1..d_{j-1} accepted, with probability later[j - 2]: 1 + Σ_j Π_{i<=j} rate_i. Acceptance
    comes in runs (a draft that agreed so far tends to go on agreeing), which the independent model
    undercounts: measured 2.86 tokens per round at γ = 3 where α = 0.64 gives 2.32."""
    total, run = 1.0, 1.0
    for j in range(gamma):
        run *= first if j == 0 else later[min(j - 1, len(later) - 1)]
        total += run
    return total


def _lerp(x: float, x0: float, x1: float, y0: float, y1: float) -> float:
    return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class CostModel:
    """Seconds of a verify pass V(b, n) and a draft step D(b), from a profile on a grid of rows
    {b0, b1} x columns {1, n1}, interpolated (and extrapolated) linearly, times online corrections."""

    rows: tuple[int, int]
    cols: tuple[int, int]
    verify_s: dict[tuple[int, int], float]  # (rows, cols) -> seconds
    draft_s: dict[int, float]  # rows -> seconds of one draft step
    verify_scale: float = 1.0
    draft_scale: float = 1.0

    def verify(self, b: int, n: int) -> float:
        (b0, b1), (n0, n1) = self.rows, self.cols
        at = {c: _lerp(b, b0, b1, self.verify_s[(b0, c)], self.verify_s[(b1, c)]) for c in (n0, n1)}
        return max(1e-6, self.verify_scale * _lerp(n, n0, n1, at[n0], at[n1]))

    def draft(self, b: int) -> float:
        b0, b1 = self.rows
        return max(0.0, self.draft_scale * _lerp(b, b0, b1, self.draft_s[b0], self.draft_s[b1]))

    def correct(self, predicted_verify: float, measured_verify: float, predicted_draft: float,
                measured_draft: float, weight: float = 0.1) -> None:
        """Move the scales toward measured / predicted (an exponential average)."""
        if predicted_verify > 0 and measured_verify > 0:
            self.verify_scale *= (measured_verify / predicted_verify) ** weight
        if predicted_draft > 0 and measured_draft > 0:
            self.draft_scale *= (measured_draft / predicted_draft) ** weight


@dataclass
class AdaptivePolicy:
    cost: CostModel
    gamma_max: int
    prior: float = 0.6  # acceptance of the pair before anything is measured
    strength: float = 4.0  # how many drafted tokens the prior weighs
    margin: float = 1.05  # speculate only when it is predicted this much faster than plain decoding
    _pair: list[float] = field(default_factory=lambda: [0.0, 0.0])  # accepted, drafted over all requests
    # per draft position j: [accepted, reached] over all rows (reached: d_j drafted, d_1..d_{j-1} accepted)
    _positions: list[list[float]] = field(default_factory=list)
    last: dict = field(default_factory=dict)  # the last decision, for stats

    def alpha(self, first_accepted: int, first_drafted: int) -> float:
        """A row's first-draft acceptance: its own record, shrunk toward the pair's."""
        acc, reached = self._positions[0] if self._positions else (0.0, 0.0)
        prior = (acc + self.strength * self.prior) / (reached + self.strength)  # the pair's running rate
        return min(0.99, (first_accepted + self.strength * prior) / (first_drafted + self.strength))

    def later_rates(self) -> list[float]:
        """P(d_j accepted | d_1..d_{j-1} accepted) for j = 2..γ, pair-wide. A position never reached
        yet borrows its predecessor's rate as its prior (not the pair's prior: rates grow along a
        run, and a position the policy never drafts to would otherwise never be tried)."""
        rates, prior = [], self.prior
        for j in range(1, self.gamma_max):
            acc, reached = self._positions[j] if j < len(self._positions) else (0.0, 0.0)
            prior = min(0.99, (acc + self.strength * prior) / (reached + self.strength))
            rates.append(prior)
        return rates or [self.prior]

    def choose(self, alphas: list[float], caps: list[int]) -> int:
        """The round's g: argmax over 0..gamma_max of expected tokens per second (a draft length
        only if it beats plain decoding by `margin`). alphas[i] is row i's first-draft rate."""
        b = len(alphas)
        later = self.later_rates()
        plain = b / self.cost.verify(b, 1)
        best_g, best_rate = 0, plain * self.margin
        for g in range(1, self.gamma_max + 1):
            if all(c < g for c in caps):
                break  # no row could use more drafts
            tokens = sum(expected_tokens_runs(a, later, min(g, c)) for a, c in zip(alphas, caps))
            seconds = g * self.cost.draft(b) + self.cost.verify(b, g + 1)
            if tokens / seconds > best_rate:
                best_g, best_rate = g, tokens / seconds
        self.last = {"rows": b, "gamma": best_g, "predicted_s": best_g * self.cost.draft(b)
                     + self.cost.verify(b, best_g + 1)}
        return best_g

    def observe(self, accepted: list[int], drafted: list[int], verify_s: float, draft_s: float) -> None:
        """After a round: each row's accepted / drafted counts, and the stage times of the decision."""
        self._pair[0] += sum(accepted)
        self._pair[1] += sum(drafted)
        while len(self._positions) < self.gamma_max:
            self._positions.append([0.0, 0.0])
        for a, n in zip(accepted, drafted):
            for j in range(min(a + 1, n)):  # d_1..d_min(a+1, n) were reached; the first a accepted
                self._positions[j][1] += 1
                self._positions[j][0] += j < a
        b, g = self.last.get("rows", 0), self.last.get("gamma", 0)
        if b:
            self.cost.correct(self.cost.verify(b, g + 1), verify_s, g * self.cost.draft(b), draft_s)
