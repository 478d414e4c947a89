"""Hybrid drafting (`--drafter hybrid[:suffix[:...]|ngram[:...]]`): a model-free lookup where it
has a confident match, the draft model elsewhere, decided per row and per round.

The lookup is `suffix` by default (suffix.py: the request's own tokens and, for greedy rows,
earlier requests' outputs) or `ngram` (ngram.py), with its own options: `hybrid:ngram:2,4,10`,
`hybrid:suffix:20,8,0.25` (the older `hybrid:2,4,10` means ngram). A row the lookup proposes
something for gets that proposal, so the hybrid proposes at least what its lookup does. The draft
model runs only on the other rows, in slot order, as a sub-batch. Its bookkeeping stays exact
across rounds in which a row was drafted by the lookup: such a row's draft KV simply lags, and the
next time the draft model drafts for it, it first feeds the tokens it has not seen
(`DraftModelDrafter` computes them from the row's committed draft length), then commits
u + min(a, n - 1) as always (n: the tokens it drafted for the row). The draft model's prefill is
lazy for the same reason: a prompt enters the draft KV the first time the model drafts for its
row, so a request the lookup serves alone never costs a draft forward.

Example, γ = 3, rows r0 r1 r2, r1 with a 2-token lookup proposal:
    draft model on [r0, r2]      tokens [2, 3] and, when sampling, q [2, 3, V]
    proposal tokens [3, 3]       rows r0, r2 from the model; r1 = its 2 tokens + 1 padding
             lengths [3, 2, 3]   q [3, 3, V]: r1's rows one-hot at its tokens (point masses)
    observe(accepted [1, 2, 0])  the model commits for r0 and r2 only

The draft model runs only while it earns its time (`ModelGate`): rounds in which it drafts the
rows without a match must make more tokens per second than rounds in which those rows go
undrafted (one token each); otherwise they are not drafted, with a model round now and then to
keep the measurement fresh (less often while it keeps failing), and while it pays, a round
without it now and then for the same reason. So on prompts the lookup copies well, or at batch
sizes where a draft step costs more than it brings, the hybrid falls back to its better part
instead of paying for the worse one. The gate reads the clock, so it decides for greedy rows only
(whose output it cannot change); a sampled row without a match always gets the draft model, so a
seeded request draws the same text whatever the timing.

With an adaptive policy (`sched/adaptive.py`) the lookups run before the plan (`lookahead`, only
when free drafting could make the round speculative): a row the lookup has a proposal for is
planned no longer than that and costs no draft-model step; only the other rows are priced at the
draft model's step. (Priced all alike, most rounds drafting by lookup alone made the measured
draft time ~2 % of the profiled steps, and the plan then took real draft-model steps as free.)
"""

from __future__ import annotations

import time

import torch

from ..core.request import Request
from ..sampling import BatchSampling
from ..sched.adaptive import AdaptivePolicy
from .base import DraftProposal
from .model import DraftModelDrafter
from .ngram import LookupDrafter, padded

LOOKUP = "suffix"  # what `--drafter hybrid` is built on


class ModelGate:
    """Whether the draft model should draft the rows the lookup has nothing for, from exponential
    averages of tokens and seconds per round, kept apart for the two ways such a round can go:
    the model drafts those rows (`model`), or they go undrafted and make one token each
    (`without`). The model runs while its rounds make at least the tokens per second of the
    others. Rounds in which every row had a match say nothing either way and are not recorded.

    Comparing with the rounds the model would replace, not with all rounds: at batch 1 a round
    without a match makes 1 token in 6.5 ms (154 tok/s) and one the model drafts 2.2 in 13 ms
    (170 tok/s), so the model pays there, while against the rounds as a whole (lookup rounds
    included, 300 tok/s) it would never run; the lookup's rounds happen whichever way the others go.

    At first the two sides are measured in turn, `min_rounds` rounds each, and an average is the
    mean of its rounds until 1 / n falls below `weight`: one round is not a measurement (a single
    slow round without the model, 721 tok/s against ~950 for the model's, kept the model drafting
    every round the lookup missed, at batch 8 under the adaptive policy: 1.19x plain decoding
    where fixed γ made 1.28x; measured alike, 1.27x).

    Exploration: after `wait` rounds without the model it is tried again, then after twice as
    many each time it still does not pay (at most `max_wait` rounds); while it pays, rounds without
    it are run after `probe` rounds with it, doubling the same way, so that side stays measured too.
    Either side is measured again afresh, for `min_rounds` rounds (a `streak`) whose mean replaces
    what it had, and judged after them: one round at the average's weight could not overturn a
    stale average, so one unlucky stretch shut the model out for good (batch 1 on the bundled
    prompts, adaptive: the model skipped in 200-270 of ~1000 rounds a run, where it pays by ~25 %).
    Example, explore_every 16, min_rounds 4: the model measured at 120 tok/s and the rounds without
    it at 150: skip it for 16 rounds, try it 4; still 120: skip 32, then 64, ... 512.

    The averages weigh a round `weight` = 0.03 once they have 33 (about the last 33 rounds). A
    model round makes 1, 2 or 3 tokens at γ = 2, so ten rounds' average (weight 0.1) is ±15 % off
    and crosses the other side's where the model pays by 10-25 %: simulated at 1.25x (1000 rounds,
    20 seeds) the model was left out of 15 % of them at 0.1 and 3 % at 0.03 (at 1.1x: 54 % and 20 %;
    where it loses by 10 % it drafted 12 % and 15 %). Measured at batch 1 (the adaptive default,
    bundled prompts): 120-172 rounds a run without the model at 0.1 against 32-45 for fixed γ = 2
    beside it (whose model rounds are shorter than the policy's, 7.0-7.1 ms against 7.3-7.8, so its
    margin is wider and crossed less); 1-27 at 0.03.
    """

    def __init__(self, weight: float = 0.03, explore_every: int = 16, max_wait: int = 512, min_rounds: int = 4) -> None:
        self.weight, self.explore_every, self.max_wait = weight, explore_every, max_wait
        self.min_rounds = min_rounds  # rounds each side is measured, in turn, before the gate compares them
        self.counts = [0, 0]  # rounds recorded with the model, without it
        self.wait = explore_every  # rounds without the model before it is tried again
        self.probe = explore_every  # rounds with the model before one without it
        self.model: list[float] | None = None  # [tokens, seconds] per round the model drafted
        self.without: list[float] | None = None  # [tokens, seconds] per round such rows went undrafted
        self.skipped = 0  # rounds without the model since it last drafted
        self.used = 0  # rounds with the model since the last one recorded without it
        self.streak = 0  # rounds left of a side being measured again (`streak_side`: True, the model's)
        self.streak_side = True

    def use(self) -> bool:
        if self.model is None:
            return True  # measure it
        if self.streak:
            return self.streak_side
        if self.skipped >= self.wait:
            return self._again(True)  # explore it again
        if self.counts[1] < min(self.counts[0], self.min_rounds):
            return False  # measure the other side as often, at first
        if not self.pays():
            return False
        return True if self.used < self.probe else self._again(False)

    def _again(self, side: bool) -> bool:
        """Measure a side again (True: the model's), afresh: its next `min_rounds` rounds' mean."""
        self.streak, self.streak_side = self.min_rounds, side
        self.counts[0 if side else 1] = 0
        return side

    def pays(self) -> bool:
        return self.model is not None and self.without is not None and \
            self.model[0] * self.without[1] >= self.without[0] * self.model[1]

    def record(self, tokens: float, seconds: float, drafted: bool) -> None:
        """A round with rows the lookup had nothing for: `drafted`, the model drafted them."""
        if drafted:
            self.counts[0] += 1
            self.model = self._mix(self.model, (tokens, seconds), self.counts[0])
            self.skipped, self.used = 0, self.used + 1
        else:
            self.counts[1] += 1
            self.without, self.used = self._mix(self.without, (tokens, seconds), self.counts[1]), 0
        judged = False  # a side measured again is judged once its streak is over
        if self.streak and drafted == self.streak_side:
            self.streak -= 1
            judged = not self.streak
        if drafted and self.pays():
            self.wait = self.explore_every
        elif drafted and judged:
            self.wait = min(self.max_wait, 2 * self.wait)
        elif not drafted and not self.pays():
            self.probe = self.explore_every
        elif not drafted and judged:
            self.probe = min(self.max_wait, 2 * self.probe)

    def skip(self) -> None:
        self.skipped += 1

    def _mix(self, avg: list[float] | None, new: tuple[float, float], n: int) -> list[float]:
        """The n-th round into an average: the mean of the rounds so far, then an exponential
        average once 1 / n falls below `weight` (a first round alone does not set it)."""
        if avg is None:
            return list(new)
        w = max(self.weight, 1.0 / n)
        return [a + w * (x - a) for a, x in zip(avg, new)]


class HybridDrafter:
    synthetic = False

    def __init__(self, model: DraftModelDrafter, lookup: LookupDrafter) -> None:
        self.model, self.lookup = model, lookup
        self.label = "hybrid:" + lookup.label
        self._model_rows: list[int] = []  # rows the draft model drafted for this round
        self.gate = ModelGate()
        # this round, for the gate: (start by `_clock`, seconds of the model's catch-up left out, whether the
        # model drafted the rows without a match: None when there were none, or the gate had no say)
        self._round: tuple[float, float, bool | None] | None = None
        # `lookahead`'s (rows, lookups (tokens, confidence), start, what the gate decided for the rows
        # without a match)
        self._found: tuple[tuple, list[tuple[list[int], list[float]]], float, bool | None] | None = None
        self._row_s: float | None = None  # a lookahead's seconds per row looked up (`lookahead_s`)
        self._rows = [0, 0]  # rows looked up, and those the lookup found nothing for (`model_share`)

    def prefill(self, reqs: list[Request], ends: list[int]) -> None:
        self.lookup.prefill(reqs, ends)  # the draft model catches up when it first drafts a row

    def lookahead(self, reqs: list[Request], caps: list[int]) -> list[list[float] | None]:
        """Before a policy plans the round (decode/round.py): per row, the `match_confidence` of
        each token the lookup proposes (as many as it proposes; its drafting costs no draft-model
        step), None for a row the draft model would draft, [] for a row nothing drafts (no match,
        and the gate keeps the model off greedy rows). The next `propose` for the same rows reuses
        these lookups, each cut to its row's planned length."""
        start = self._clock()
        looked = [self.lookup.find(r, c) if c > 0 else ([], []) for r, c in zip(reqs, caps)]
        elapsed = self._clock() - start
        found = [f[0] for f in looked]
        if (rows := self._count(found, caps)):
            per_row = elapsed / rows
            self._row_s = per_row if self._row_s is None else self._row_s + 0.1 * (per_row - self._row_s)
        model = self.gate.use()
        self._round = None
        if not model and any(c > 0 and not f and r.params.greedy for f, c, r in zip(found, caps, reqs)):
            # (counted and timed from here: `propose` never sees these rows, and is not even called
            # when the round ends up plain; `observe` is)
            self.gate.skip()
            self._round = (start, 0.0, False)
        self._found = (self._key(reqs), looked, start, False if self._round else None)
        return [conf if f else None if c > 0 and (model or not r.params.greedy) else []
                for (f, conf), c, r in zip(looked, caps, reqs)]

    def lookahead_s(self, caps: list[int]) -> float:
        """Seconds a `lookahead` with these caps takes beyond the lookup's indexing (which
        `index_s` prices): per row it looks up (cap > 0) an exponential average of what lookaheads
        took, 0 until one ran. Paid whether or not the plan then drafts anything, so a policy charges it to the
        speculative round it would look up for (`AdaptivePolicy.may_speculate`). On the Xeon
        40-65 us a row: at batch 1 1.5 % of a plain round (4.3 ms), at 32 rows 1.3 ms, 7 % of one."""
        return 0.0 if self._row_s is None else self._row_s * sum(1 for c in caps if c > 0)

    def _count(self, found: list[list[int]], caps: list[int]) -> int:
        """Counts the rows looked up (cap > 0) and those without a match (`model_share`); returns
        how many were looked up."""
        looked = [f for f, c in zip(found, caps) if c > 0]
        self._rows[0] += len(looked)
        self._rows[1] += sum(1 for f in looked if not f)
        if self._rows[0] > 4096:  # (the older rows count half)
            self._rows = [n // 2 for n in self._rows]
        return len(looked)

    def model_share(self) -> float:
        """The share of rows looked up that the lookup found nothing for, so the draft model's to
        draft (whether or not the gate then lets it): how many of a request's rounds its catch-up
        is likely to serve, before the request has a record of its own
        (`AdaptivePolicy.catch_up_share`); 1 before any lookup."""
        return (self._rows[1] + 1) / (self._rows[0] + 1)

    @staticmethod
    def _key(reqs: list[Request]) -> tuple:
        """The rows and how long each is: lookups from a round that then drafted nothing (a plain
        round) are never taken for the next round's."""
        return tuple((id(r), r.num_tokens) for r in reqs)

    def propose(self, reqs: list[Request], gamma: int, uniforms: torch.Tensor | None,
                sampling: BatchSampling, lengths: list[int] | None = None) -> DraftProposal:
        start = self._clock()
        caps = lengths if lengths is not None else [gamma] * len(reqs)
        looked, self._found, skipped = self._found, None, None
        if looked is not None and looked[0] == self._key(reqs):
            lookups = [(f[:c], conf[:c]) for (f, conf), c in zip(looked[1], caps)]
            start, skipped = looked[2], looked[3]  # the round began with the lookups
        else:
            lookups = [self.lookup.find(r, c) if c > 0 else ([], []) for r, c in zip(reqs, caps)]
            self._count([f for f, _ in lookups], caps)
        found = [f for f, _ in lookups]
        device = self.model.runner.device
        tokens = padded(found, gamma, 0, device, torch.long)
        rows = self._model_rows = [i for i, (f, c) in enumerate(zip(found, caps)) if c > 0 and not f]
        # for the gate (see `_round`); after a lookahead the gate has decided already: rows it kept
        # off have no length left, and the model rows left (sampled ones) make a mixed round
        decided = (None if skipped is False else True) if rows else skipped
        if rows and skipped is None and not self.gate.use():
            self.gate.skip()
            # a sampled row keeps the model: its draws then depend on its own tokens and seed only,
            # never on the clock, so a seeded request samples the same text every time
            rows = self._model_rows = [i for i in rows if not reqs[i].params.greedy]
            decided = None if rows else False
        # q(d_j) of the model's rows (greedy ones: TETRIS), the lookup's `match_confidence` on its own
        confidence = padded([conf for _, conf in lookups], gamma, float("nan"), device) if gamma else None
        if not rows:
            self._round = (start, 0.0, decided)
            return DraftProposal(tokens, None, [len(f) for f in found], confidence=confidence,
                                 looked=[bool(f) for f in found])
        # what a row's catch-up (its prompt, or a stretch the lookup drafted) costs serves the rounds
        # the model drafts for it from now on: the gate charges this round the share a plan does
        # (`AdaptivePolicy.catch_up_share`) and leaves the rest of it out, pro rata of the tokens
        # fed (a row fed once normally has 1 or 2 tokens unseen). Left out whole, a request the
        # lookup serves almost alone paid a ~700-token catch-up for a model round or two (echo
        # workload, batch 1: 0.3-0.45 s of catch-ups in 8 s, the hybrid 6 % behind `suffix`)
        drafting = sum(caps[i] for i in rows)
        behind = [max(0, self.model.feeds(reqs[i]) - 2) for i in rows]
        share = self.model_share()
        spared = sum(n * (1.0 - AdaptivePolicy.catch_up_share(reqs[i], share)) for n, i in zip(behind, rows))
        model_start = time.perf_counter()
        sub = [reqs[i] for i in rows]  # a subsequence of a batch in slot order: still in slot order
        sub_caps = [caps[i] for i in rows]
        width = max(sub_caps)
        drafted = self.model.propose(sub, width, uniforms[rows, :width] if uniforms is not None else None,
                                     BatchSampling.of([r.params for r in sub], device), sub_caps)
        index = torch.tensor(rows, device=device)
        tokens[index, :width] = drafted.tokens
        if drafted.confidence is not None:
            confidence[index, :width] = drafted.confidence.to(confidence.dtype)
        probs = None
        if drafted.probs is not None:  # some model row samples: the n-gram rows need their one-hot q
            probs = torch.zeros(len(reqs), gamma, drafted.probs.shape[-1], dtype=drafted.probs.dtype, device=device)
            probs.scatter_(-1, tokens.unsqueeze(-1), 1.0)
            probs[index, :width] = drafted.probs
        lengths = [len(f) for f in found]
        for i, c in zip(rows, drafted.lengths or sub_caps):  # (the model may cut a row short)
            lengths[i] = c
        self._round = (start, (time.perf_counter() - model_start) * spared / (drafting + sum(behind)), decided)
        return DraftProposal(tokens, probs, lengths, confidence=confidence, caught_up=drafted.caught_up,
                             looked=[bool(f) for f in found])

    def observe(self, reqs: list[Request], accepted: list[int]) -> None:
        rows, self._model_rows = self._model_rows, []
        if rows:
            self.model.observe([reqs[i] for i in rows], [accepted[i] for i in rows])
        if self._round is None:
            return
        start, model_catch_up_s, drafted = self._round
        self._round = None
        if drafted is not None:  # draft + verify of this round; a catch-up serves later rounds
            self.gate.record(len(reqs) + sum(accepted), self._clock() - start - model_catch_up_s, drafted)

    def index_s(self, reqs: list[Request], shares: list[float], intake: float) -> float:
        """The lookup's indexing a lookahead of `reqs` would start with (see `LookupDrafter.index_s`)."""
        return self.lookup.index_s(reqs, shares, intake)

    @property
    def catch_up_s(self) -> float:
        """The lookup's indexing beyond what a round adds, in total (see `LookupDrafter`)."""
        return self.lookup.catch_up_s

    def _clock(self) -> float:
        """Seconds that stand still while the lookup catches up: the gate times rounds by it."""
        return time.perf_counter() - self.lookup.catch_up_s

    def release(self, req: Request) -> None:
        self.model.release(req)
        self.lookup.release(req)

    def forget(self) -> None:
        self.lookup.forget()

