"""Trace replay: a policy judged on recorded rounds, against every fixed γ and two oracles.

A trace is recorded from a real run at fixed γ (`--no-adaptive`: every row drafts its cap, a
lookup row what its lookup found): per round, per row, its request, its cap, the drafter's offer
(a lookup's count, or None: a model drafts it), whether it is held (seeded sampled) and how many
of its drafts were accepted; per round, the seconds of the offer, the draft stage, the verify
stage and the whole round (rounds a prompt joined are kept, but their seconds are not read); and
the run's cost table (`costs.py`). Verification accepts the
longest agreeing prefix, so a row that accepted a of its cap would have accepted min(a, n) of
any n <= cap drafts: the trace says what every shorter plan would have got. (A replay takes the
recorded rounds as they came: rows that accept less would reach later rounds later, which it
does not model.)

Replaying a policy, round by round: it sees the same rows, with records built from what it
verified so far, plans lengths n_i, and the round commits Σ (1 + min(a_i, n_i)) tokens in

    T(n) x (recorded measured / predicted, per stage)  +  host  (+ the offer's seconds if asked)

host being the recorded rounds' mean time beyond their stages. Competitors: `fixed γ=k` for every
k <= γ (k = 0: plain decoding of the recorded rounds); `autoregressive`, plain decoding of the same
requests on its own schedule, with no part-empty rounds while a speculative run's last rows
finish (what a plain engine runs, and what a speculative one must beat); `oracle`, the same plan
with each request's true per-position rates over the whole trace (what the best rate-based plan
could know); `clairvoyant`, the same plan knowing each round's a_i (rarely reached; not a bound: it plans
one round at a time, and on a walk rows it lets race ahead can leave a job's end to part-empty
rounds that a plan knowing less avoids). Greedy and
sampled rows replay alike.

A hybrid with a model part is recorded *alongside* (`record`, drafters/hybrid.py `Alongside`):
the model drafts every row, the lookup is asked what it would have proposed, and each proposal
is judged afterwards against the row's final tokens (a greedy row's output is the target's, so
that is what the target would have accepted). `Trace.view` then replays the same rounds as the
model alone, as the hybrid drafts them (the lookup where it matched), or as the lookup alone:
which source a row should take is settled on one recording, not on runs the machine's noise
tells apart.
"""

from __future__ import annotations

import copy
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..core.request import AcceptanceRecord, RequestStats
from .costs import CostTable
from .drain import tail
from .gate import drive
from .policy import SpecPolicy
from .tetris import best_budget

VERSION = 2  # 2: rows may carry a 6th field, the lookup asked alongside (a version 1 trace reads as one without)
SOURCES = ("recorded", "hybrid", "lookup")  # what a trace recorded alongside can be replayed as


@dataclass
class Trace:
    gamma: int
    table: CostTable
    # per round: {"rows": [[request, cap, offer, held, accepted(, lookup)], ...], "offer_s", "draft_s", "verify_s",
    # "round_s", "fused": whether prompts joined its pass (their rows have cap 0; its seconds are no decoding
    # round's)}; lookup: [proposed, accepted] by a hybrid's lookup asked alongside its model (`record`), or None
    rounds: list[dict] = field(default_factory=list)
    meta: dict = field(default_factory=dict)  # what was recorded (models, batch size, drafter, machine)
    run: list[dict] | None = None  # a view's rounds as they ran (their seconds price it); None: `rounds`

    @property
    def alongside(self) -> bool:
        """Whether rows carry a hybrid's lookup asked alongside (a trace `view` can replay)."""
        return any(len(row) > 5 for rnd in self.rounds for row in rnd["rows"])

    @property
    def sources(self) -> tuple[bool, ...]:
        """What its drafter offered (True: a lookup's rows, False: a model's), as `SpecPolicy.sources`."""
        return tuple(sorted({row[2] is not None for rnd in self.rounds for row in rnd["rows"]}))

    def view(self, source: str) -> Trace:
        """The trace as if drafted by `source`: `recorded` (the model on every row), `hybrid` (the
        lookup on the rows where it matched, as the engine's hybrid drafts; the model elsewhere) or
        `lookup` (the lookup alone). Its rounds' seconds stay those the recorded run measured.

        Example, a row [7, 4, None, False, 1, [3, 2]] (model drafts: 1 of 4 accepted; the lookup
        proposed 3, 2 of them would be accepted): hybrid and lookup [7, 4, 3, False, 2]; a row
        whose lookup found nothing, [7, 4, None, False, 1, [0, 0]]: hybrid keeps the model's
        [7, 4, None, False, 1], lookup [7, 4, 0, False, 0]."""
        if source not in SOURCES:
            raise ValueError(f"a trace is replayed as one of {', '.join(SOURCES)}, not {source!r}")
        if source != "recorded" and not self.alongside:
            raise ValueError("this trace holds one source per row: record a hybrid with a model part to compare "
                             "its sources")

        def row(r: list) -> list:
            lookup = r[5] if len(r) > 5 else None
            if source == "recorded" or lookup is None or (source == "hybrid" and not lookup[0]):
                return r[:5]
            return [r[0], r[1], lookup[0], r[3], lookup[1]]
        rounds = [{**rnd, "rows": [row(r) for r in rnd["rows"]]} for rnd in self.rounds]
        return Trace(self.gamma, self.table, rounds, self.meta, self.run or self.rounds)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"version": VERSION, "gamma": self.gamma, "table": self.table.to_json(),
                                          "meta": self.meta, "rounds": self.rounds}, separators=(",", ":")))

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        data = json.loads(Path(path).read_text())
        if data.get("version") not in (1, VERSION):
            raise ValueError(f"{path}: a trace of version {data.get('version')}, this batchspec reads {VERSION}")
        return cls(data["gamma"], CostTable.from_json(data["table"]), data["rounds"], data.get("meta", {}))


class TraceRecorder:
    """Set as `SpecEngine.trace` on an engine at fixed γ; every decoding round lands in `trace`.
    With `alongside` (a hybrid's `Alongside`: its model drafting every row), each row also gets
    what the lookup proposed, its accepted count filled in by `finish` once outputs are final."""

    def __init__(self, gamma: int, table: CostTable, meta: dict | None = None, alongside=None) -> None:
        self.trace = Trace(gamma, table, meta=meta or {})
        self.alongside = alongside
        self._asked: list[tuple[list, tuple]] = []  # (trace row, (request, its length then, proposal))

    def record(self, batch, caps, offer, accepted, offer_s, draft_s, verify_s, round_s, fused) -> None:
        asked = self.alongside.take() if self.alongside is not None else None
        if not any(caps):  # nothing to draft: no decision in it
            return
        offer = offer or [None] * len(batch)
        rows = [[r.index, c, o, r.params.seed is not None and not r.params.greedy, a]
                for r, c, o, a in zip(batch, caps, offer, accepted)]
        if asked is not None:
            for row, ask in zip(rows, asked):
                row.append(None)
                self._asked.append((row, ask))
        self.trace.rounds.append({"rows": rows, "offer_s": offer_s, "draft_s": draft_s, "verify_s": verify_s,
                                  "round_s": round_s, "fused": fused})

    def finish(self) -> Trace:
        """The trace, each lookup proposal's [proposed, accepted] against its row's final tokens."""
        from ..drafters.hybrid import lookup_outcome

        for row, (req, at, proposal) in self._asked:
            row[5] = list(lookup_outcome(req, at, proposal))
        self._asked = []
        return self.trace


@dataclass
class RoundCosts:
    """A run's cost table, scaled to what its rounds measured (a trace's: `of`; a walk's: `Walk.costs`)."""

    table: CostTable
    draft_ratio: float
    verify_ratio: float
    host_s: float

    @classmethod
    def of(cls, trace: Trace) -> RoundCosts:
        """Medians over the rounds (a first round can include one-off work, such as measuring kernels)."""
        table, ratios = trace.table, ([], [], [])
        for rnd in (r for r in trace.run or trace.rounds if not r["fused"]):  # (a joining prompt's pass: no round)
            lengths = [min(c, o) if o is not None else c for _, c, o, *_ in rnd["rows"]]
            model = [o is None and n > 0 for (_, _, o, *_), n in zip(rnd["rows"], lengths)]
            fed = [sum(1 for n, m in zip(lengths, model) if m and n > j) for j in range(max(lengths))]
            if any(fed):
                ratios[0].append(rnd["draft_s"] / sum(map(table.draft, fed)))
            ratios[1].append(rnd["verify_s"] / table.verify(len(lengths), max(lengths), sum(lengths)))
            ratios[2].append(rnd["round_s"] - rnd["draft_s"] - rnd["verify_s"] - rnd["offer_s"])
        return cls(table, *(statistics.median(r) if r else 1.0 for r in ratios[:2]),
                   max(0.0, statistics.median(ratios[2])) if ratios[2] else 0.0)

    def seconds(self, lengths: list[int], model: list[bool], fed: list[int] | None = None,
                widths: list[int] | None = None) -> tuple[float, float]:
        """(draft, verify) seconds of a round verifying `lengths`, fed[j] rows stepped at depth j
        (None: a model row stepped once per draft it verifies), row i fed widths[i] tokens past its
        newest (its drafts and siblings; None: its drafts)."""
        if fed is None:
            fed = [sum(1 for n, m in zip(lengths, model) if m and n > j) for j in range(max(lengths, default=0))]
        widths = lengths if widths is None else widths
        return (self.draft_ratio * sum(map(self.table.draft, fed)),
                self.verify_ratio * self.table.verify(len(lengths), max(widths, default=0), sum(widths)))


def replay(trace: Trace, choose, observe=None) -> float:
    """Tokens per second of `choose` over the trace: choose(ids, records, caps, offer, held,
    accepted, costs) -> (lengths, whether the offer was asked for); observe(lengths, accepted,
    looked, draft_s, verify_s), if given, learns what each round verified."""
    costs, stats, tokens, seconds = RoundCosts.of(trace), {}, 0, 0.0
    for rnd in trace.rounds:
        ids, caps, offer, held, accepted = (list(x) for x in zip(*(row[:5] for row in rnd["rows"])))
        records = [stats.setdefault(i, RequestStats()) for i in ids]
        lengths, asked = choose(ids, records, caps, offer, held, accepted, costs)
        got = [min(a, n) for a, n in zip(accepted, lengths)]
        model = [o is None and n > 0 for o, n in zip(offer, lengths)]
        draft_s, verify_s = costs.seconds(lengths, model)
        for rec, a, n, o in zip(records, got, lengths, offer):
            if n:
                rec.count_drafts(a, n, o is not None)
        if observe is not None:
            observe(lengths, got, [o is not None for o in offer], draft_s, verify_s)
        tokens += len(ids) + sum(got)
        seconds += draft_s + verify_s + costs.host_s + (rnd["offer_s"] if asked else 0.0)
    return tokens / seconds if seconds else 0.0


def autoregressive(trace: Trace) -> float:
    """Tokens per second of plain decoding of the trace's requests on its own schedule: each request
    emits what it emitted in the recorded run (its rows' accepted + 1 over the rounds as they ran,
    whatever `Trace.view` replays); slots are filled in request order, every active row gains one
    token a round, and a finished row's slot takes the next request the round after; each round
    is priced as replay prices a plain one. A speculative run's rows finish unevenly, so its
    rounds run part-empty while its last requests finish; plain decoding of requests of equal
    length does not. `replay(trace, fixed(0))` keeps the recorded rounds (their occupancy): the
    two agree at batch 1, and at batch 32 on the SmolLM2 mixed-set trace the recorded rounds make
    plain decoding 6 % slower than its own schedule.

    Example, 2 slots, requests emitting 3, 1, 2 tokens: round 1 rows (3, 1); the second finishes,
    the third joins: round 2 (2, 2), round 3 (1, 1): 6 tokens in 3 rounds of 2 rows."""
    costs, left = RoundCosts.of(trace), {}
    for rnd in trace.run or trace.rounds:  # (a view's rows say what its source would accept, not what ran)
        for row in rnd["rows"]:
            left[row[0]] = left.get(row[0], 0) + row[4] + 1
    slots = int(trace.meta.get("batch_size") or max((len(r["rows"]) for r in trace.rounds), default=1))
    queue, active, tokens, seconds = [left[i] for i in sorted(left)][::-1], [], 0, 0.0
    while queue or active:
        while queue and len(active) < slots:
            active.append(queue.pop())
        seconds += costs.verify_ratio * costs.table.verify(len(active), 0, 0) + costs.host_s
        tokens += len(active)
        active = [n - 1 for n in active if n > 1]
    return tokens / seconds if seconds else 0.0


class PolicyChooser:
    """`replay`'s view of a SpecPolicy: the engine's round, less the tensors."""

    def __init__(self, policy: SpecPolicy) -> None:
        self.policy, self._decision, self._siblings = policy, None, None

    def __call__(self, ids, records, caps, offer, held, accepted, costs, left=None, sure=None, ups=None):
        """sure[i]: row i's recorded confidences (a walk's), which drive a confident policy's gate;
        ups[i]: the q of its runner-ups at each depth (None: none), of which a policy with a
        sibling width verifies some. Returns (lengths, whether the offer was asked for[, the draft
        steps at each depth (None: one per draft), the siblings chosen per row])."""
        if isinstance(self.policy, Hindsight):  # (it reads the truth by request)
            self.policy.ids = ids
        self._siblings = None
        if not any(caps) or not self.policy.worth_offering(tuple(ids), records, caps, held, left):
            self._decision = None
            return [0] * len(caps), False
        decision = self._decision = self.policy.plan(records, caps, offer, held, left)
        steps, lengths = None, decision.lengths
        if decision.gate is not None:
            if sure is None:
                raise ValueError("a confident policy is gated by the drafter's confidences: walk it on a walk that "
                                 "recorded them (batchspec trace record --walk with a head)")
            lengths = drive(decision.gate, [c or [] for c in sure])
            steps = decision.gate.fed(decision.model_rows)
        if ups is None or not self.policy.sibling_width or not any(lengths):
            return (lengths, True) if steps is None else (lengths, True, steps)
        q = [u or [] for u in ups]
        ranks = self.policy.siblings(decision, records, [o is not None for o in offer], lengths,
                                     [c or [] for c in sure] if sure is not None else None, q)
        self._siblings = (ranks, q)
        return lengths, True, steps, ranks

    def observe(self, lengths, accepted, looked, draft_s, verify_s, fed=None, hits=0) -> None:
        """What the round verified (fed[i]: row i's drafts and siblings) and its siblings' hits."""
        if self._decision is not None:
            self.policy.observe(self._decision, lengths, accepted, looked, draft_s, verify_s, fed)
            if self._siblings is not None:
                self.policy.observe_siblings(*self._siblings, accepted, hits)


def fixed(k: int):
    """Every row drafts min(k, its cap, what its lookup found); k = 0 is plain decoding (chains only)."""
    def choose(ids, records, caps, offer, held, accepted, costs, left=None, sure=None, ups=None):
        return [min(k, c, o) if o is not None else min(k, c) for c, o in zip(caps, offer)], k > 0
    return choose


def clairvoyant(ids, records, caps, offer, held, accepted, costs, left=None, sure=None, ups=None):
    """Knows each row's accepted count: gains 1 up to it, 0 after (a draining batch priced as the policy's)."""
    caps = [min(c, o) if o is not None else c for c, o in zip(caps, offer)]
    gains = [[1.0 if j < a else 0.0 for j in range(c)] for a, c in zip(accepted, caps)]
    lengths, _ = best_budget(gains, costs.table.round_s(len(caps)), len(caps), [o is None for o in offer],
                             [c if h else 0 for c, h in zip(caps, held)], tail(costs.table, left, max(caps, default=0)))
    return lengths, True


class Hindsight(SpecPolicy):
    """The policy's plan with each request's true per-position rates over the whole run: `truth`,
    per (request, whether a lookup drafted), its record (`_truth` of a trace, `Walk.truth`)."""

    def __init__(self, gamma: int, table: CostTable, sources: tuple[bool, ...],
                 truth: dict[tuple[int, bool], AcceptanceRecord]) -> None:
        super().__init__(gamma, copy.deepcopy(table), sources=sources)
        self.truth, self.ids = truth, []

    def rates(self, stats, looked, caps):
        out = []
        for i, lk, c in zip(self.ids, looked, caps):
            rec = self.truth.get((i, lk))
            out.append([rec.accepted[j] / rec.reached[j] if rec and j < len(rec.reached) and rec.reached[j] else 0.0
                        for j in range(c)])
        return out


def compare(trace: Trace, policy: SpecPolicy | None = None) -> dict[str, float]:
    """Tokens per second over `trace` of the policy (default: the engine's, on the trace's table),
    plain decoding (on the recorded rounds, and `autoregressive`: on its own schedule), every fixed
    γ, the hindsight oracle and the clairvoyant plan."""
    chooser = PolicyChooser(policy or SpecPolicy(trace.gamma, copy.deepcopy(trace.table), sources=trace.sources))
    out = {"policy": replay(trace, chooser, chooser.observe), "autoregressive": autoregressive(trace)}
    for k in range(trace.gamma + 1):
        out[f"fixed γ={k}" if k else "plain"] = replay(trace, fixed(k))
    oracle = PolicyChooser(Hindsight(trace.gamma, trace.table, trace.sources, _truth(trace)))
    out["oracle"] = replay(trace, oracle, oracle.observe)
    out["clairvoyant"] = replay(trace, clairvoyant)
    return out


def _truth(trace: Trace) -> dict[tuple[int, bool], AcceptanceRecord]:
    """Per (request, source): its acceptance over every recorded round at the recorded lengths."""
    out: dict[tuple[int, bool], AcceptanceRecord] = {}
    for rnd in trace.rounds:
        for i, c, o, _, a, *_ in rnd["rows"]:
            n = min(c, o) if o is not None else c
            if n:
                out.setdefault((i, o is not None), AcceptanceRecord()).add(a, n)
    return out


def record(engine, prompts, params, meta: dict | None = None) -> Trace:
    """Run `prompts` on `engine` (fixed γ: built with adaptive=False) and return the trace of its
    rounds, with the cost table measured for its models (sched/profile.py). A hybrid with a model
    part, on greedy requests, is recorded alongside: its model drafts every row and its lookup's
    proposals are judged afterwards, so the trace can be replayed as either source (`Trace.view`)."""
    from ..drafters.hybrid import Alongside, HybridDrafter
    from ..sampling import SamplingParams
    from .profile import cost_table

    cfg = engine.config
    if cfg.adaptive or not cfg.speculative:
        raise ValueError("record a trace at fixed γ (adaptive=False, a speculative method): replay needs every row "
                         "to draft its cap")
    table = cost_table(engine.pair.target, engine.drafter, engine.pair.draft if engine.draft_runner else None,
                       cfg.batch_size, cfg.gamma, cfg.forward)
    drafter, alongside = engine.drafter, None
    greedy = all(p.greedy for p in (params if isinstance(params, (list, tuple)) else [params or SamplingParams()]))
    if isinstance(drafter, HybridDrafter) and drafter.model is not None and greedy:
        alongside = engine.drafter = Alongside(drafter)  # both sources on every row (`Trace.view`)
    recorder = TraceRecorder(cfg.gamma, copy.deepcopy(table), {"batch_size": cfg.batch_size, "drafter": cfg.drafter,
                                                                "method": cfg.method, "recorded": time.time(),
                                                                **(meta or {})}, alongside)
    engine.trace = recorder
    width, engine.policy.sibling_width = engine.policy.sibling_width, 0  # (chains: replay knows no siblings)
    try:
        engine.generate(prompts, params)
    finally:
        engine.trace, engine.drafter, engine.policy.sibling_width = None, drafter, width
    return recorder.finish()
