"""Draft lengths gated by the drafter's own confidence: the plan, made again at every depth.

A drafter that knows how sure it is of each draft (`Drafter.confident`: an EAGLE head's top
probability max q_ij, read before d_ij is drawn) lets a round stop a row's chain where its next
draft is unlikely to be accepted, and go deeper where it is sure, before paying for the steps. The
policy's first plan (`policy.py`) prices drafts by the rows' acceptance records alone; the gate
takes its lengths as the rows to start, their caps as the most each may draft, and at depth j,
once the drafter has each live row's q_ij, plans the round again (the same `plan` function: the
same pricing, drain and budget) with what it now knows:

    chance  c_ij = cal(max q_ij)   the pair's acceptance of drafts at that confidence (`Calibration`):
                                   per bin of max q, drafts verified with every earlier one accepted
                                   and those accepted, shrunk toward the confidence itself by K
                                   drafts (a calibrated head's chance is its confidence)
    gains   G_ik = c_i1 ... c_ik                  for k <= j (known)
            G_ik = G_i,k-1 next(c_i,k-1)          for k > j: what steps gave so far after a chance
                                                  in that bin (`Calibration.next`), shrunk toward
                                                  the first plan's rate there (`rates[i]`)
    plan    lengths n_i >= j - 1 (the drafts kept so far are held), the steps run so far priced
            into every candidate (paid, kept or not); n_i >= j keeps d_ij; n_i > j (and j < the
            row's cap) runs the step that gives q_i,j+1: the row goes on

Rows the gate does not steer (a lookup's, and `held` rows: seeded sampled, whose lengths must not
depend on the batch) keep the first plan's lengths and are stepped to them. The decision on d_ij
reads q_ij, the distribution it is drawn from, never d_ij itself: a stopping rule, so rejection
sampling stays lossless (tests/test_gate.py checks the counterexample, a rule that reads d_ij).

Example, one row, cap 3, rates [0.4, 0.5, 0.5] (gains 0.4, 0.2, 0.1), a plan that keeps a draft
when its gain is at least 0.2 (a stand-in for the cost table's): the first plan is [2], so the
row starts, up to its cap 3. Step 0 gives c_1 = 0.9: gains [0.9, 0.45, 0.225] -> n = 3: d_1 kept,
go on. Step 1 gives c_2 = 0.3: gains [0.9, 0.27, 0.135] -> n = 2: d_2 kept, no step for q_3. The
row verifies 2 drafts after 2 steps; had c_1 been 0.1, it would verify none after 1
(tests/test_gate.py walks both).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

BINS = 10  # bins of max q over [0, 1]
PRIOR = 16.0  # drafts' worth of the confidence itself that a bin's record starts from


@dataclass
class Calibration:
    """Per bin of max q: drafts verified with every earlier one accepted, and those accepted; and
    per bin of a depth's chance, the chances the drafter's next step then gave (every step the gate
    let run, its draft kept or not): what a row that goes on may expect."""

    reached: list[int] = field(default_factory=lambda: [0] * BINS)
    accepted: list[int] = field(default_factory=lambda: [0] * BINS)
    followed: list[int] = field(default_factory=lambda: [0] * BINS)
    next_sum: list[float] = field(default_factory=lambda: [0.0] * BINS)

    @staticmethod
    def bin(confidence: float) -> int:
        return min(BINS - 1, max(0, int(confidence * BINS)))

    def chance(self, confidence: float) -> float:
        """Example: no record, 0.83 -> 0.83; bin 8 at 10 of 40 accepted -> (10 + 16 x 0.83) / 56 = 0.42."""
        k = self.bin(confidence)
        return (self.accepted[k] + PRIOR * confidence) / (self.reached[k] + PRIOR)

    def next(self, chance: float, rate: float) -> float:
        """The chance the next step is expected to give after one of `chance`, shrunk toward `rate`
        (the first plan's there). On the SmolLM2 walks a step gives 0.30 on average after a chance
        under 0.1 and 0.44 after one of 0.9 or more: confidence barely carries to the next draft."""
        k = self.bin(chance)
        return (self.next_sum[k] + PRIOR * rate) / (self.followed[k] + PRIOR)

    def follow(self, chance: float, then: float) -> None:
        k = self.bin(chance)
        self.followed[k] += 1
        self.next_sum[k] += then

    def add(self, confidences: Sequence[float], accepted: int) -> None:
        """A row's verified drafts of these confidences, `accepted` of them accepted: drafts 1 ..
        accepted + 1 were reached (the one after a rejection tells nothing)."""
        for j, c in enumerate(confidences[:accepted + 1]):
            k = self.bin(c)
            self.reached[k] += 1
            self.accepted[k] += j < accepted


Plan = Callable[[list[list[float]], list[int], list[int]], list[int]]  # (gains, held lengths, sunk) -> lengths


class Gate:
    """One round's gate. `lengths` the first plan's; `caps` the most each row may draft; `rates`
    per row the first plan's conditional rates (r_i1 ..); `steered[i]`: the gate decides row i
    (a model row, not held); `plan` the policy's planner."""

    def __init__(self, lengths: list[int], caps: list[int], rates: list[list[float]], steered: list[bool],
                 plan: Plan, calibration: Calibration) -> None:
        self.limits = [c if s and n > 0 else n for n, c, s in zip(lengths, caps, steered)]
        self.lengths = [0 if s else n for n, s in zip(lengths, steered)]  # drafts kept so far
        self.rates, self.steered, self.plan, self.calibration = rates, steered, plan, calibration
        self.chances: list[list[float]] = [[] for _ in lengths]  # c_i1 .. per steered row
        self.confidences: list[list[float]] = [[] for _ in lengths]  # max q_i1 .. as the drafter gave them
        self.go = [s and n > 0 for n, s in zip(lengths, steered)]  # steered rows still drafting
        self.steps = [1 if go else 0 for go in self.go]  # draft steps run per steered row (step 0: its first)

    def drop(self, i: int) -> None:
        """Row i drafts nothing this round (the drafter cannot draft it)."""
        self.go[i], self.lengths[i], self.limits[i], self.steps[i] = False, 0, 0, 0

    def sub(self, rows: Sequence[int]) -> _Sub:
        """The gate as a drafter of rows[k] (k = 0, 1, ..) sees it."""
        return _Sub(self, rows)

    def live(self) -> list[int]:
        """The steered rows still drafting: the drafter's rows at the next depth."""
        return [i for i, go in enumerate(self.go) if go]

    def _gains(self, i: int, upto: int) -> list[float]:
        """Row i's cumulative gains to `upto` drafts: its chances where known, then what the next
        step is expected to give (`Calibration.next`), each after the one before."""
        known, g, run, last = self.chances[i], [], 1.0, None
        for k in range(upto):
            if k < len(known):
                last = known[k]
            else:
                last = self.rates[i][k] if last is None else self.calibration.next(last, self.rates[i][k])
            run *= last
            g.append(run)
        return g

    def step(self, j: int, rows: Sequence[int], confidences: Sequence[float]) -> list[int]:
        """Depth j (1-based): `rows` are the steered rows still drafting (`live`), each with max q_ij.
        Returns the rows that go on to depth j + 1 (their step j runs); a row left out stops, at j
        drafts if it kept d_ij (`lengths`), else j - 1."""
        for i, c in zip(rows, confidences):
            self.confidences[i].append(c)
            self.chances[i].append(self.calibration.chance(c))
            if j > 1:
                self.calibration.follow(self.chances[i][-2], self.chances[i][-1])
        sunk = [sum(1 for s in self.steps if s > d) for d in range(j)]  # steps run so far, paid whatever is kept
        gains = [self._gains(i, lim if go else n) for i, (go, n, lim) in
                 enumerate(zip(self.go, self.lengths, self.limits))]
        held = [j - 1 if go else n for go, n in zip(self.go, self.lengths)]
        planned = self.plan(gains, held, sunk)
        on = []
        for i in rows:
            self.lengths[i] = j if planned[i] >= j else j - 1
            if planned[i] > j and j < self.limits[i]:
                on.append(i)
                self.steps[i] += 1
            else:
                self.go[i] = False
        return on

    def fed(self, model_rows: Sequence[bool]) -> list[int]:
        """Rows a draft step fed at each depth: a steered row's steps, and a model row the gate
        does not steer stepped to its length (n steps for n drafts)."""
        steps = [s if st else (n if m else 0) for s, st, n, m in zip(self.steps, self.steered, self.limits, model_rows)]
        return [sum(1 for s in steps if s > d) for d in range(max(steps, default=0))]

    def settle(self) -> list[int]:
        """Each row's drafts once the drafter is done."""
        return list(self.lengths)

    def learn(self, lengths: Sequence[int], accepted: Sequence[int], records: Sequence) -> None:
        """The calibration learns the verified drafts of the rows the gate steered; a row that
        accepted every draft it kept and had its next one's chance (a draft it dropped) counts that
        draft at its chance in `records`, per row the `AcceptanceRecord`s to keep so (the request's,
        the pair's). Without it the records hold only the drafts the gate kept, confident ones,
        and the first plan would start rows on rates no started row meets."""
        for i, (n, a) in enumerate(zip(lengths, accepted)):
            if not self.steered[i]:
                continue
            if n:
                self.calibration.add(self.confidences[i][:n], a)
            if a == n and len(self.chances[i]) > n:
                for rec in records[i]:
                    rec.expect(n, self.chances[i][n])


class _Sub:
    """A gate seen through a subset of its rows (a hybrid's model rows): sub-row k is rows[k]."""

    def __init__(self, gate: Gate, rows: Sequence[int]) -> None:
        self.gate, self.rows = gate, list(rows)
        self.steered = [gate.steered[i] for i in self.rows]

    def drop(self, k: int) -> None:
        self.gate.drop(self.rows[k])

    def live(self) -> list[int]:
        return [k for k, i in enumerate(self.rows) if self.gate.go[i]]

    def step(self, j: int, rows: Sequence[int], confidences: Sequence[float]) -> list[int]:
        back = {i: k for k, i in enumerate(self.rows)}
        return [back[i] for i in self.gate.step(j, [self.rows[k] for k in rows], confidences)]

    def settle(self) -> list[int]:
        return [self.gate.lengths[i] for i in self.rows]


def drive(gate: Gate, confidences: Sequence[Sequence[float]]) -> list[int]:
    """What a confident drafter does with the gate, less the tensors: confidences[i][j - 1] is
    row i's max q at depth j (a walk's record). Returns the rows' lengths."""
    live, j = gate.live(), 1
    while live:
        live = gate.step(j, live, [confidences[i][j - 1] for i in live])
        j += 1
    return gate.settle()
