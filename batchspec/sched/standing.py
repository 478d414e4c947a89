"""Planned or standing rounds: whether the adaptive policy plans a round (`sched/adaptive.py`:
estimates, the free-draft bound, plan, TETRIS prune) or the round runs at a *standing length* L
(every row drafts min(its cap, L), nothing priced or pruned: what fixed γ = L does).

Why: a plan costs host time that fixed γ does not spend. At batch 1 on the Xeon the policy's work
outside the passes is ~0.15-0.2 ms a round of ~5.5 ms, and a one-row plan has little to choose
from: the adaptive default made 1.25x plain decoding where fixed γ = 2 made 1.31x (wave 33), and
rounds at the plans' usual length, the policy still learning from them, ran within 0.5 % of fixed
γ = 2 (in-process). With 16 rows and more the plan is what keeps speculation from losing (fixed
γ: 0.87-0.96x there), for ~2 % of a round.

The choice rests on two numbers that do not need many rounds to measure (a comparison of tokens
per second between the two kinds of rounds would: a round makes 1 token or 4, and a 4 % difference
drowns in that for hundreds of rounds):

    edge      what the plan's lengths are worth over the standing ones, by the policy's own rates
              and costs, relative (each plan rates both: `AdaptivePolicy.plan`), averaged over plans;
    overhead  host seconds a planned round spends beyond a standing one (everything but the draft
              and verify stages: the lookups and the passes are the same work either way), over a
              planned round's seconds.

A round stands while edge < overhead: the plan would not earn what it costs. L is the length the
plans chose most often for a row that drafted. A planned round still runs every `replan` rounds
(edge and L stay current); the first standing rounds, `probe` of them, run once `block` plans have
rated L within `probe_edge` (their host time is not known before).

Example, batch 1: plans chose 2 for 60 % of drafting rows (L = 2), and rated their own lengths
1.5 % above L's; planned rounds spend 0.52 ms of host time, standing ones 0.36, a planned round
5.5 ms: overhead 2.9 % > 1.5 %, so 7 rounds in 8 stand. At 32 rows the plans run plain and rate
L's speculation 10 % below that: every round is planned.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


def _mix(avg: float | None, x: float, n: int, weight: float) -> float:
    """The n-th value into an average: the mean of the first 1 / weight, then exponential."""
    return x if avg is None else avg + max(weight, 1.0 / n) * (x - avg)


@dataclass
class _Bucket:
    lengths: Counter = field(default_factory=Counter)  # planned rounds: a drafting row's length -> rows
    plans: int = 0  # plans that rated L
    seen: int = 0  # plans
    edge: float | None = None
    counts: list[int] = field(default_factory=lambda: [0, 0])  # rounds timed: planned, standing
    host: list[float | None] = field(default_factory=lambda: [None, None])  # their host seconds
    round_s: float | None = None  # a planned round's seconds
    since: int = 0  # standing rounds since the last planned one


class StandingGate:
    def __init__(self, block: int = 16, probe: int = 8, replan: int = 8, probe_edge: float = 0.1,
                 rate_every: int = 4, weight: float = 0.05, memory: int = 512) -> None:
        self.block, self.probe, self.replan, self.probe_edge = block, probe, replan, probe_edge
        self.rate_every = rate_every
        self.weight = weight
        self.memory = memory  # drafting rows' lengths kept (then halved: the older count less)
        self._buckets: dict[int, _Bucket] = {}

    def _bucket(self, rows: int) -> _Bucket:
        key = max(1, rows).bit_length()  # batch sizes in powers of two, as the policy learns them
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = _Bucket()
        return b

    def mode(self, rows: int) -> int | None:
        """L: the length plans chose most often for a drafting row (ties: the shorter), or None."""
        lengths = self._bucket(rows).lengths
        return min(lengths, key=lambda n: (-lengths[n], n)) if lengths else None

    def overhead(self, rows: int) -> float | None:
        """A planned round's host seconds beyond a standing one's, over its seconds (None: unmeasured)."""
        b = self._bucket(rows)
        planned, standing = b.host
        if planned is None or standing is None or not b.round_s:
            return None
        return (planned - standing) / b.round_s

    def length(self, rows: int) -> int | None:
        """This round's standing length at `rows` rows, or None: plan it."""
        b = self._bucket(rows)
        if b.plans < self.block or not b.lengths or b.since >= self.replan - 1:
            return None
        if b.counts[1] < self.probe:  # standing rounds' host time is not known yet
            return self.mode(rows) if b.edge < self.probe_edge else None
        overhead = self.overhead(rows)
        return self.mode(rows) if overhead is not None and b.edge < overhead else None

    def to_rate(self, rows: int) -> int | None:
        """L, if this plan is to rate it (`rated`), else None: the first `block` plans, then every
        `rate_every`-th (rating costs about a tenth of a plan, and the edge moves slowly)."""
        b = self._bucket(rows)
        b.seen += 1
        if b.plans >= self.block and b.seen % self.rate_every:
            return None
        return self.mode(rows)

    def rated(self, rows: int, edge: float) -> None:
        """A plan rated its own lengths `edge` above L's (relative)."""
        b = self._bucket(rows)
        b.plans += 1
        b.edge = _mix(b.edge, edge, b.plans, self.weight)

    def record(self, rows: int, seconds: float, host_s: float, stood: bool, lengths: list[int]) -> None:
        """A round of `rows` rows took `seconds`, `host_s` of them outside the draft and verify
        stages, at a standing length (`stood`) or planned; row i verified lengths[i] drafts."""
        b = self._bucket(rows)
        side = int(stood)
        b.counts[side] += 1
        b.host[side] = _mix(b.host[side], host_s, b.counts[side], self.weight)
        if stood:
            b.since += 1
            return
        b.since = 0
        b.round_s = _mix(b.round_s, seconds, b.counts[0], self.weight)
        if any(lengths):
            b.lengths.update(n for n in lengths if n)
            if b.lengths.total() > self.memory:
                b.lengths = Counter({n: c // 2 for n, c in b.lengths.items() if c > 1})

    def summary(self) -> dict:
        """Per batch-size bucket (rows below 2^k): planned and standing rounds, L, edge, overhead."""
        out = {}
        for k, b in sorted(self._buckets.items()):
            rows = 1 << (k - 1)
            overhead = self.overhead(rows)
            out[f"<{1 << k}"] = {"rounds": list(b.counts), "length": self.mode(rows),
                                 "edge": None if b.edge is None else round(b.edge, 4),
                                 "overhead": None if overhead is None else round(overhead, 4)}
        return out
