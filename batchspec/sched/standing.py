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
plans chose most often for a row that drafted: the plan's length, before the draft model's cut
(`AdaptivePolicy.cut`) and the TETRIS prune. Standing rounds cut too (the cut is the draft model's),
so an L learnt from the lengths verified after them was cut twice: at batch 1 on the bundled prompts
the draft model's L came out 1 (its planned rounds verified 1 draft 46 times, 2 17 times, 3 16 times
in one run), and 3 from the plans' lengths. Measured in-process (AMD EPYC, 5 repeats side by side)
that was worth little there: 1.539x plain decoding against 1.540 with L learnt after the cut, fixed
γ = 3 1.550 (the lookup drafts most rounds, at its own L of 4). A hybrid drafter's rows have one L
per source (`Standing`): the rows its lookup drafts, and the rows its draft model could draft, whose
0 counts too; a standing round runs its lookups first to know which rows are whose. One L for both
made its draft model draft every row without a match at 24-32 rows, where plans almost never do: the
edge kept its rounds planned (4-7 % stood where `suffix` stood 30-50 %; echo workload, 1.10-1.14x
plain decoding where `suffix` made 1.15-1.16x). A planned round still runs every `replan` rounds
(edge and L stay current); the first standing rounds, `probe` of them, run once `block` plans have
rated L within `probe_edge` (their host time is not known before).

Rounds stand only where the policy lets at least `min_speculative` (a quarter) of the planned rounds
speculate (rounds in which nothing could draft count for neither): a standing round speculates at
L whatever the policy would say, and the edge is rated only by plans that looked into drafting,
not by the plain rounds the policy kept or found due without a plan. At 32 rows on the bundled
prompts those plans rated L ~5 % below their own lengths (below `probe_edge`: probes) while ~90 %
of rounds ran plain, and standing rounds there (11 % of one bench repeat's) speculate where fixed
γ loses (0.87-0.90x). Planned rounds speculated in 96-99 % at batch 1, 31-53 % at batch 4 (where
standing has paid), 0-29 % at 16 and 0-14 % at 32 (in-process, the default, 64 x 32).

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


@dataclass(frozen=True)
class Standing:
    """A standing round's lengths: `drafted` for a row the drafter drafts (a hybrid's: its draft
    model), `looked` for a row a hybrid's lookup drafts; each row at most its cap."""

    drafted: int
    looked: int = 0

    def lengths(self, caps: list[int], looked: list[bool] | None = None) -> list[int]:
        looked = looked or [False] * len(caps)
        return [min(c, self.looked if lk else self.drafted) for c, lk in zip(caps, looked)]


@dataclass
class _Bucket:
    # planned rounds: a row's length -> rows, for rows the drafter drafted and rows a hybrid's lookup did
    lengths: tuple[Counter, Counter] = field(default_factory=lambda: (Counter(), Counter()))
    plans: int = 0  # plans that rated L
    seen: int = 0  # plans
    edge: float | None = None
    counts: list[int] = field(default_factory=lambda: [0, 0])  # rounds timed: planned, standing
    host: list[float | None] = field(default_factory=lambda: [None, None])  # their host seconds
    round_s: float | None = None  # a planned round's seconds
    speculative: float | None = None  # the share of planned rounds the policy let speculate
    decided: int = 0  # planned rounds in that share
    since: int = 0  # standing rounds since the last planned one


class StandingGate:
    def __init__(self, block: int = 16, probe: int = 8, replan: int = 8, probe_edge: float = 0.1,
                 rate_every: int = 4, weight: float = 0.05, memory: int = 512, min_speculative: float = 0.25) -> None:
        self.block, self.probe, self.replan, self.probe_edge = block, probe, replan, probe_edge
        self.min_speculative = min_speculative  # rounds stand only where at least this share of plans speculate
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

    def mode(self, rows: int, looked: bool = False) -> int | None:
        """L: the length plans chose most often for a drafting row (ties: the shorter), or None;
        `looked`: for a row a hybrid's lookup drafted."""
        lengths = self._bucket(rows).lengths[looked]
        return min(lengths, key=lambda n: (-lengths[n], n)) if lengths else None

    def standing(self, rows: int) -> Standing | None:
        """The standing lengths at `rows` rows (whether or not rounds stand now), None before any
        row drafted in a planned round."""
        drafted, looked = self.mode(rows), self.mode(rows, looked=True)
        return Standing(drafted or 0, looked or 0) if drafted or looked else None

    def overhead(self, rows: int) -> float | None:
        """A planned round's host seconds beyond a standing one's, over its seconds (None: unmeasured)."""
        b = self._bucket(rows)
        planned, standing = b.host
        if planned is None or standing is None or not b.round_s:
            return None
        return (planned - standing) / b.round_s

    def length(self, rows: int) -> Standing | None:
        """This round's standing lengths at `rows` rows, or None: plan it."""
        b = self._bucket(rows)
        if b.plans < self.block or b.since >= self.replan - 1 or (b.speculative or 0.0) < self.min_speculative:
            return None
        if b.counts[1] < self.probe:  # standing rounds' host time is not known yet
            return self.standing(rows) if b.edge < self.probe_edge else None
        overhead = self.overhead(rows)
        return self.standing(rows) if overhead is not None and b.edge < overhead else None

    def to_rate(self, rows: int) -> Standing | None:
        """L, if this plan is to rate it (`rated`), else None: the first `block` plans, then every
        `rate_every`-th (rating costs about a tenth of a plan, and the edge moves slowly)."""
        b = self._bucket(rows)
        b.seen += 1
        if b.plans >= self.block and b.seen % self.rate_every:
            return None
        return self.standing(rows)

    def rated(self, rows: int, edge: float) -> None:
        """A plan rated its own lengths `edge` above L's (relative)."""
        b = self._bucket(rows)
        b.plans += 1
        b.edge = _mix(b.edge, edge, b.plans, self.weight)

    def record(self, rows: int, seconds: float, host_s: float, stood: bool, lengths: list[int],
               sources: list[bool | None] | None = None, declined: bool | None = False) -> None:
        """A round of `rows` rows took `seconds`, `host_s` of them outside the draft and verify
        stages, at a standing length (`stood`) or planned; the plan gave row i lengths[i] drafts
        (before the draft model's cut and the TETRIS prune: what L is learnt from).
        sources[i], a hybrid's round: True, its lookup drafted row i; False, its draft model could
        have (a length of 0 counts too: at 32 rows plans draft those rows rarely, while their
        lookup rows draft most rounds); None, neither could. declined, a planned round: the
        policy ran it plain where rows could have drafted (True), let it speculate (False), or
        nothing could draft (None: a lookup found nothing, the model off)."""
        b = self._bucket(rows)
        side = int(stood)
        b.counts[side] += 1
        b.host[side] = _mix(b.host[side], host_s, b.counts[side], self.weight)
        if stood:
            b.since += 1
            return
        b.since = 0
        b.round_s = _mix(b.round_s, seconds, b.counts[0], self.weight)
        if declined is not None:
            b.decided += 1
            b.speculative = _mix(b.speculative, float(not declined), b.decided, self.weight)
        if not any(lengths):
            return
        drafted, looked = b.lengths
        if sources is None:
            drafted.update(n for n in lengths if n)
        else:
            looked.update(n for n, s in zip(lengths, sources) if s and n)
            drafted.update(n for n, s in zip(lengths, sources) if s is False)
        b.lengths = tuple(c if c.total() <= self.memory else Counter({n: k // 2 for n, k in c.items() if k > 1})
                          for c in b.lengths)

    def summary(self) -> dict:
        """Per batch-size bucket (rows below 2^k): planned and standing rounds, L, edge, overhead."""
        out = {}
        for k, b in sorted(self._buckets.items()):
            rows = 1 << (k - 1)
            overhead = self.overhead(rows)
            standing = self.standing(rows)
            out[f"<{1 << k}"] = {"rounds": list(b.counts), "length": standing and standing.drafted,
                                 "looked_length": standing and standing.looked,
                                 "edge": None if b.edge is None else round(b.edge, 4),
                                 "speculative": None if b.speculative is None else round(b.speculative, 3),
                                 "overhead": None if overhead is None else round(overhead, 4)}
        return out
