"""The speculation guard: per batch size, how much slower speculative rounds run for their
prediction than plain ones (`SpecGuard`), so the adaptive policy (`adaptive.py`) asks that much
more of speculating; with explorations both ways so neither side goes unmeasured.
"""

from __future__ import annotations

from .cost_model import rows_bucket


class SpecGuard:
    """What the cost model misses, per batch size (in powers of two), from what rounds really took:
    exponential averages of measured / predicted seconds, apart for speculative rounds and for
    plain ones. Their ratio, the `penalty`, multiplies a speculative round's predicted time when
    the plan weighs it against a plain round, so speculating where it measures slower than the
    profile says (at large batch sizes on a CPU: ragged bookkeeping, a verify pass that is
    compute-bound) needs a predicted gain that much larger. Only time is judged here: how many
    tokens a round commits depends on the requests in it, and each request's acceptance is
    estimated on its own (`AdaptivePolicy.alpha`). A guard that compared tokens per second of
    speculative and plain rounds let one request that accepts little turn speculation off for
    the requests after it (seen at batch 2: 0.92x autoregressive, 1.04x without that guard).

    Example, 32 rows: plain rounds take 1.1x their prediction, speculative ones 1.32x: penalty
    1.2, and a round predicted 1.15x faster than plain decoding is run plain.

    Both averages start at 1 (the profile trusted) and weigh a round's measurement 1 / (n + 4) for
    its n-th round until that falls to `weight`: a single round (a warm-up's first, a hiccup of the
    machine) moves the penalty a fifth of the way, not all of it. Taken whole, one warm-up round
    measured 1.6x slow at batch 1 kept every round of the next 931 plain (1.0x where fixed γ made
    1.3x): what a penalty keeps plain it no longer measures.

    A penalty that keeps rounds plain is no longer measured, so after `explore_every` rounds it
    kept plain one speculative round is run without it. If that round confirms the penalty (it
    took longer for its prediction than plain rounds do) the next exploration waits twice as long
    (at most `max_wait`), else it comes after `explore_every` again: a change (a batch that
    empties) is noticed, and a penalty that rests on noise is measured away. The other way round
    too: a batch in which some row always has something worth verifying never runs a plain round
    by itself, so after `explore_every` speculative rounds in a row one plain round is run to
    measure that side, then after twice as many each time.
    """

    def __init__(self, weight: float = 0.1, explore_every: int = 16, max_wait: int = 512,
                 prior_rounds: int = 4) -> None:
        self.weight, self.explore_every, self.max_wait = weight, explore_every, max_wait
        self.prior_rounds = prior_rounds  # how many rounds' worth the starting value 1 weighs
        self.spec: dict[int, float] = {}  # bucket -> speculative rounds' measured / predicted seconds
        self.plain: dict[int, float] = {}  # bucket -> plain rounds' measured / predicted seconds
        self.counts: dict[tuple[int, bool], int] = {}  # (bucket, speculative) -> rounds recorded
        self.blocked: dict[int, int] = {}  # bucket -> rounds the penalty kept plain since a speculative one
        self.wait: dict[int, int] = {}
        self.spec_since: dict[int, int] = {}  # bucket -> speculative rounds since its last plain one
        self.plain_wait: dict[int, int] = {}

    @staticmethod
    def bucket(rows: int) -> int:
        return rows_bucket(rows)

    def penalty(self, rows: int) -> float:
        """Speculative rounds' time as a multiple of what the profile predicts, relative to plain
        rounds' (1 until both are measured at this batch size)."""
        k = self.bucket(rows)
        return self.spec[k] / self.plain[k] if k in self.spec and k in self.plain else 1.0

    def exploring(self, rows: int) -> bool:
        """The penalty has kept rounds plain long enough: this round is judged without it."""
        k = self.bucket(rows)
        return self.blocked.get(k, 0) >= self.wait.get(k, self.explore_every)

    def kept_plain(self, rows: int) -> None:
        k = self.bucket(rows)
        self.blocked[k] = self.blocked.get(k, 0) + 1

    def plain_due(self, rows: int) -> bool:
        """Speculative rounds have run `plain_wait` in a row: one plain round, to measure that side."""
        k = self.bucket(rows)
        return self.spec_since.get(k, 0) >= self.plain_wait.get(k, self.explore_every)

    def record(self, rows: int, slow: float, speculative: bool) -> None:
        """A round of `rows` rows took `slow` x the seconds predicted for it."""
        k = self.bucket(rows)
        avg = self.spec if speculative else self.plain
        n = self.counts[(k, speculative)] = self.counts.get((k, speculative), 0) + 1
        before = avg.get(k, 1.0)
        avg[k] = before * (slow / before) ** max(self.weight, 1 / (n + self.prior_rounds))
        if not speculative:
            if self.plain_due(rows):
                self.plain_wait[k] = min(self.max_wait, 2 * self.plain_wait.get(k, self.explore_every))
            self.spec_since[k] = 0
            return
        self.spec_since[k] = self.spec_since.get(k, 0) + 1
        if self.exploring(rows):  # confirmed: speculating runs slower for its prediction than plain rounds do
            confirmed = slow > self.plain.get(k, 1.0)
            self.wait[k] = min(self.max_wait, 2 * self.wait.get(k, self.explore_every)) if confirmed \
                else self.explore_every
        else:  # speculation chosen on its merits, penalty and all
            self.wait[k] = self.explore_every
        self.blocked[k] = 0
