"""How many drafts each row of a round verifies: expected tokens over predicted seconds.

Pure Python over the rows' acceptance records and the cost table (`costs.py`). Per round:

    rate    r_ij = (a_ij + K p_j) / (n_ij + K),   p_j = (A_j + K p_{j-1}) / (N_j + K)  (j > 1),
            p_1 = (A_1 + 1) / (N_1 + 2) + E_t σ_1,   σ_1 = sqrt(p (1 - p) / (N_1 + 2)):
            row i's own record at draft position j (n_ij drafts verified there with every
            earlier one accepted, a_ij accepted: `core/request.py`,
            `AcceptanceRecord`), shrunk toward the pair's (N_j, A_j over every request so far) by
            K = SHRINK drafts' worth, and the pair's toward the position before it; p_1 plus E_t =
            EXPLORE sqrt(max(1, ln t)) standard errors, t the rounds so far: a position never
            verified is priced as the one before (acceptance comes in runs, so later conditional
            rates are rarely lower) and a first draft resting on few drafts a little above its
            mean, more so as rounds pass (UCB's growth), so that a source that started unlucky is
            tried again, ever more rarely, rather than never: plain rounds teach nothing about it.
            Only p_1 carries the bonus; the later positions inherit it through the shrinkage. A
            bonus at every position compounded: with the pair at 8 of 20 first drafts accepted, 3
            of 8 second and 1 of 3 third, at t = 200, p = 0.53, 0.66, 0.86, 1.0 priced 4 drafts at
            1.49 tokens (the means: 0.66); now 0.53, 0.48, 0.46, 0.46: 0.95.
            Lookup drafts and model drafts keep records apart (a hybrid's two sources differ)
    gain    G_ij = r_i1 ... r_ij: expected tokens that verifying d_i1..d_ij adds to the 1 token
            every row commits (acceptance stops at the first rejection)
    plan    rank every (i, j) by G_ij (TETRIS, `tetris.py`: prefixes of rows only) and take the
            prefix with the most (b + Σ G) / T(lengths), T from the cost table: one draft step per
            depth for the rows a model drafts, none for lookup rows, and one verify pass; the
            shapes of fixed γ = k (every row, or the lookup rows alone) are priced too, since T
            is not additive and no prefix may hold them. All lengths 0 is a plain round, chosen
            whenever nothing beats it, and whenever no plain pass was seen for a while (the
            table's shape F rests on both kinds of pass: `CostTable.plain_due`).
    drain   when a job's last requests run (none waits: `left`, each row's tokens left), a round is
            worth what it takes off the rest of the job decoded plainly, c Σ L_i + a max L_i
            (V(k) ≈ a + c k; `drain.py`), the max's expectation over the rows' acceptances: every
            accepted token saves a row's share c, and the pass a goes only when the row with the
            most left, or every row tied for the most, gains.
            While requests wait, a row that finishes sooner frees its slot for the next, and every
            token is worth the same (b + Σ G).

Before the plan a drafter says what it can offer (`Drafter.offer`): a lookup's row is capped at
the drafts it found and costs no step. A lookup costs host time every round, so first the same
plan is asked of an optimistic offer (every row's cap, free); when even that is a plain round the
lookups are skipped. Seeded sampled rows are `held` at their cap: which uniform serves which token
depends on how many drafts a round verifies, so their lengths must not depend on the batch, and
no length depends on a row's own draft tokens (lossless sampling; a gate reads the distribution each
draft is drawn from, never the draft). With `budget` C (TETRIS's fixed
budget), at most C drafts a round are verified, the likeliest first; without a cost table (fixed
γ: `--no-adaptive`) every row verifies its cap.

Siblings (`siblings.py`): once a greedy round's drafts are known, the runner-ups a scoring drafter
gives beside them (`sibling_width` per depth) are ranked by expected tokens and the prefix that
most raises the round's tokens per second is verified, priced by the same table.

A drafter that knows its confidence in each draft before drawing it (`confident`: an EAGLE head)
has its rows gated (`gate.py`): the plan's lengths say which rows start, up to their caps, and
at each depth the plan is made again with the rows' chances read off the head's max q, so a
sure row goes deeper and an unsure one stops before its next step is paid.

Example, b = 8, D = 2 ms, V(8, n) = 20 + 4 (n - 1) ms, s = 0.5 ms, every rate 0.6: plain decoding
8 tokens / 20 ms = 400 tok/s; every row drafting 1: 8 x 1.6 / (2 + 24 - 0) ms = 492 tok/s; 2 each:
8 x 1.96 / (4 + 28) = 490; so 1 each. Every rate 0.2: 8 x 1.2 / 26 = 369 at best: plain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..core.request import AcceptanceRecord
from .costs import CostTable
from .drain import Tail
from .drain import tail as drain_tail
from .gate import Calibration, Gate
from .siblings import SiblingRecord, choose, promised
from .tetris import best_budget, cumulative, rate_of, select

SHRINK = 16.0  # drafts' worth of the pair's rate that a row's own record starts from
EXPLORE = 0.5  # standard errors added to the pair's rates: a rate resting on few drafts is tried


@dataclass
class Decision:
    """A round's plan, kept for `observe`: what was predicted, to correct the table."""

    rows: int
    lengths: list[int]
    model_rows: list[bool]  # drafted by a model step (False: by a lookup, or not at all)
    planned: bool  # the cost table chose it (False: fixed γ, or a held/budgeted shape)
    gate: Gate | None = None  # a confident drafter's rows are steered by it (`gate.py`): lengths is its start
    stats: list | None = None  # the rows' `RequestStats` (a gate's dropped drafts count in their records)


@dataclass
class SpecPolicy:
    gamma: int
    table: CostTable | None = None  # None: fixed γ (every row its cap), or a budget alone
    budget: int | None = None  # TETRIS: at most this many drafts verified a round
    pair: dict[bool, AcceptanceRecord] = field(default_factory=dict)  # every request's record, by source
    # the sources the drafter offers (True: a lookup, False: a model step), each priced optimistically
    # (`worth_offering`) even before a draft of it was verified
    sources: tuple[bool, ...] = (False,)
    confident: bool = False  # the drafter gives each draft's confidence: its rows are gated (`gate.py`)
    calibration: Calibration = field(default_factory=Calibration)  # chance of acceptance by confidence
    sibling_width: int = 0  # runner-ups a greedy row may verify beside each draft (`siblings.py`); 0: chains
    sibling_record: SiblingRecord = field(default_factory=SiblingRecord)
    _plain: tuple | None = None  # the rows for which an optimistic plan was plain, the records' age and t's doubling
    _age: int = 0  # rounds that verified drafts so far (records change only then)
    _rounds: int = 0  # rounds asked about so far (`worth_offering`): t of the spread

    def prior(self, looked: bool) -> list[float]:
        """p_1 .. p_γ: the pair's rates for drafts from one source (see the module docstring)."""
        pair = self.pair.get(looked)
        out, p, spread = [], None, self.spread()
        for j in range(self.gamma):
            big_n, big_a = (pair.reached[j], pair.accepted[j]) if pair and j < len(pair.reached) else (0, 0)
            if p is None:  # (the bonus on p_1 alone: later positions shrink toward it, adding none)
                p = (big_a + 1.0) / (big_n + 2.0)
                p = min(1.0, p + spread * (p * (1.0 - p) / (big_n + 2.0)) ** 0.5)
            else:
                p = (big_a + SHRINK * p) / (big_n + SHRINK)
            out.append(p)
        return out

    def spread(self) -> float:
        """E sqrt(max(1, ln t)) standard errors, t the rounds asked about so far: as in UCB, a rate
        rests on its evidence for a while, but a source that looked bad early is tried again
        later, ever more rarely, since plain rounds teach nothing about it."""
        return EXPLORE * max(1.0, math.log(max(self._rounds, 1))) ** 0.5

    def gains(self, stats: list, looked: list[bool], caps: list[int]) -> list[list[float]]:
        """G_ij for each row (its request's `RequestStats`), up to its cap."""
        return [cumulative(r) for r in self.rates(stats, looked, caps)]

    def rates(self, stats: list, looked: list[bool], caps: list[int]) -> list[list[float]]:
        """r_ij for each row, up to its cap."""
        priors = {lk: self.prior(lk) for lk in set(looked)}
        out = []
        for s, lk, c in zip(stats, looked, caps):
            rec, prior = s.records.get(lk), priors[lk]
            seen = len(rec.reached) if rec is not None else 0
            out.append([(rec.accepted[j] + SHRINK * p) / (rec.reached[j] + SHRINK) if j < seen else p
                        for j, p in enumerate(prior[:c])])
        return out

    def tail(self, left: list[int] | None) -> Tail | None:
        """A draining batch's pricing (`drain.py`): None while requests wait (`left` None)."""
        return None if self.table is None else drain_tail(self.table, left, self.gamma)

    def worth_offering(self, key: tuple, stats: list, caps: list[int], held: list[bool],
                       left: list[int] | None = None) -> bool:
        """Whether drafting could pay: the plan of an optimistic offer (every row its cap, drafted
        free, at the best of its sources' rates: `sources`, and any drafted so far; a source never
        verified at its prior) verifies something. A no is remembered for the same rows until
        records change or t, the rounds asked about, doubles (the spread has grown since). `left`:
        as in `plan`."""
        self._rounds += 1
        if self.table is None or any(held) or not any(caps):
            return True
        key = (key, self._age, self._rounds.bit_length(), left and tuple(left))  # (the spread grows: t doubles)
        if self._plain == key:
            return False
        if not self.pair:  # (nothing verified yet: try)
            return True
        by_source = [self.gains(stats, [lk] * len(caps), caps) for lk in sorted(set(self.pair) | set(self.sources))]
        gains = [list(map(max, *rows)) if len(rows) > 1 else rows[0] for rows in zip(*by_source)]
        lengths, _ = best_budget(gains, self.table.round_s(len(caps)), len(caps), [False] * len(caps),
                                 tail=self.tail(left))
        if any(lengths):
            return True
        self._plain = key
        return False

    def plan(self, stats: list, caps: list[int], offer: list[int | None], held: list[bool],
             left: list[int] | None = None) -> Decision:
        """Per-row lengths for this round (see the module docstring). caps[i]: the most row i may
        verify; offer[i]: drafts a lookup has for it (a cap, at no step), None: a model step;
        left[i]: the tokens row i may still emit, given when no request waits (`tail`)."""
        if self.table is not None and not any(held) and self.table.plain_due():  # (F measured: `costs.py`)
            return Decision(len(caps), [0] * len(caps), [False] * len(caps), True)
        looked = [o is not None for o in offer]
        caps = [c if o is None else min(c, o) for c, o in zip(caps, offer)]
        model_rows = [not lk and c > 0 for lk, c in zip(looked, caps)]
        fixed = [c if h else 0 for c, h in zip(caps, held)]
        gains = rates = None
        if self.table is None:
            lengths = list(caps)
        else:
            rates = self.rates(stats, looked, caps)
            gains = [cumulative(r) for r in rates]
            lengths = self._best(gains, caps, model_rows, fixed, self.tail(left))
        if self.budget is not None and sum(lengths) > self.budget:
            gains = gains or self.gains(stats, looked, lengths)
            lengths = select([g[:n] for g, n in zip(gains, lengths)], self.budget, fixed)
        gate = None
        steered = [m and not h for m, h in zip(model_rows, held)]
        if self.confident and self.table is not None and any(n and s for n, s in zip(lengths, steered)):
            gate = self._gate(rates, lengths, caps, model_rows, steered, fixed, left)
        return Decision(len(caps), lengths, [m and n > 0 for m, n in zip(model_rows, lengths)],
                        self.table is not None, gate, stats if gate is not None else None)

    def _gate(self, rates, lengths, caps, model_rows, steered, fixed, left) -> Gate:
        """The round's gate: the plan made again at each depth with the drafter's confidences."""
        tail, base = self.tail(left), self.table.round_s(len(lengths))
        step = [self.table.draft(n) for n in range(len(lengths) + 1)]  # (read once: a plan prices every draft it ranks)

        def plan(gains: list[list[float]], held: list[int], sunk: list[int]) -> list[int]:
            def seconds(total: int, fed: list[float]) -> float:
                """The candidate's round, its draft steps at least those already run (paid, kept or
                not); the verify pass priced by the candidate's own depth."""
                out = base(total, fed)
                for d, ran in enumerate(sunk):
                    planned = fed[d] if d < len(fed) else 0
                    if ran > planned:
                        out += step[int(ran)] - step[int(planned)]
                return out
            out = self._best(gains, [len(g) for g in gains], model_rows, held, tail, seconds)
            if self.budget is not None and sum(out) > self.budget:
                out = select(gains, self.budget, [max(h, f) for h, f in zip(held, fixed)])
            return out
        return Gate(lengths, caps, rates, steered, plan, self.calibration)

    def _best(self, gains: list[list[float]], caps: list[int], model_rows: list[bool], fixed: list[int],
              tail: Tail | None, seconds=None) -> list[int]:
        """The best of the ranking's prefixes (`best_budget`) and 2γ shapes no prefix may hold, priced
        alike: every row min(k, cap), and the lookup rows alone at min(k, cap) (costs are not
        additive: a depth's draft step or a wider pass is paid once, so a dear model row's draft
        can rank before a free row's next one, or one row's 2nd before another's 1st)."""
        seconds = seconds or self.table.round_s(len(caps))
        lengths, rate = best_budget(gains, seconds, len(caps), model_rows, fixed, tail)
        for k in range(1, self.gamma + 1):
            for rows in (None, [not m for m in model_rows]):
                shape = [max(f, min(k, c) if rows is None or rows[i] else 0) for i, (c, f) in
                         enumerate(zip(caps, fixed))]
                r = rate_of(gains, seconds, len(caps), shape, model_rows, tail)
                if r > rate * (1 + 1e-9):
                    lengths, rate = shape, r
        return lengths

    def siblings(self, decision: Decision, stats: list, looked: list[bool], lengths: list[int],
                 confidence: list[list[float]] | None, q: list[list[list[float]]]) -> list[list[tuple[int, int]]]:
        """Per row, the runner-ups to verify beside its chain of lengths[i] drafts: (depth index j,
        rank), from their q (q[i][j][k]: row i's k-th runner-up at depth j; `siblings.py`); each
        draft's chance is read off its confidence (confidence[i][j]) where the drafter is
        `confident`, else the row's rates."""
        if self.sibling_width == 0 or not any(lengths):
            return [[] for _ in lengths]
        qs = [[row[j][:self.sibling_width] for j in range(min(n, len(row)))] for row, n in zip(q, lengths)]
        if self.table is None:  # (fixed γ: every runner-up offered)
            return [[(j, k) for j, ups in enumerate(row) for k, p in enumerate(ups) if p > 0] for row in qs]
        chances = self.rates(stats, looked, lengths)
        if self.confident and confidence is not None:
            chances = [[self.calibration.chance(confidence[i][j]) for j in range(n)] if not lk else r
                       for i, (n, lk, r) in enumerate(zip(lengths, looked, chances))]
        draft_s, _ = self.predicted(decision, lengths)
        b = len(lengths)

        def seconds(extra: list[int]) -> float:
            fed = [n + e for n, e in zip(lengths, extra)]
            return draft_s + self.table.verify(b, max(fed), sum(fed))
        return choose(chances, qs, lengths, seconds, self.sibling_record.factor)

    def observe_siblings(self, ranks: list[list[tuple[int, int]]], q: list[list[list[float]]], accepted: list[int],
                         hits: int) -> None:
        """A round verified siblings `ranks` (as `siblings` chose them, q as given there) beside
        chains that accepted `accepted`, and took `hits` of them: the factor f learns it."""
        self.sibling_record.add(promised(ranks, q, accepted), hits)

    def predicted(self, decision: Decision, lengths: list[int], fed: list[int] | None = None) -> tuple[float, float]:
        """(draft, verify) seconds the table predicts for `decision` verifying `lengths` (row i fed
        fed[i] tokens past its newest: its drafts and siblings; default lengths)."""
        if decision.gate is not None:
            steps = decision.gate.fed(decision.model_rows)
        else:
            steps = [sum(1 for n, m in zip(decision.lengths, decision.model_rows) if m and n > j) for j in range(
                max(decision.lengths, default=0))]
        widths = lengths if fed is None else fed
        return sum(map(self.table.draft, steps)), self.table.verify(decision.rows, max(widths, default=0), sum(widths))

    def observe(self, decision: Decision, lengths: list[int], accepted: list[int], looked: list[bool],
                draft_s: float, verify_s: float | None, fed: list[int] | None = None) -> None:
        """A round verified lengths[i] drafts of row i and accepted accepted[i] (its chain: a sibling
        taken is not counted): the pair's records learn it (each request's own record is kept by
        the round), and the table's stages are corrected by what they took (verify_s None: a pass
        that also prefilled, no measure; fed: as in `predicted`)."""
        for n, a, lk in zip(lengths, accepted, looked):
            if n:
                rec = self.pair.get(lk)
                if rec is None:
                    rec = self.pair[lk] = AcceptanceRecord()
                rec.add(a, n)
        if decision.gate is not None:
            pair = self.pair.setdefault(False, AcceptanceRecord())
            decision.gate.learn(lengths, accepted, [(s.record(False), pair) for s in decision.stats])
        if any(lengths) or decision.gate is not None:
            self._age += 1
        if self.table is not None and verify_s is not None:
            draft, verify = self.predicted(decision, lengths, fed)
            self.table.correct("draft", draft, draft_s)
            self.table.correct("verify", verify, verify_s, drafted=any(lengths))

