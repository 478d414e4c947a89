"""Hybrid drafting (`--drafter hybrid[:suffix[:...]|ngram[:...]]`): a model-free lookup where it
has a proposal, the draft model for the other rows, decided per row and per round.

The lookup is `suffix` by default (suffix.py) or `ngram` (ngram.py), with its own options:
`hybrid:ngram:2,4,10`, `hybrid:suffix:20,8,0.25` (the older `hybrid:2,4,10` means ngram). It is
an ordinary drafter composed of two: its `offer` is the lookup's where the lookup found something
(those rows cost no draft step) and None elsewhere (the draft model's rows, priced at its step),
so the policy (sched/policy.py) decides, like for any drafter, which rows draft and how far;
where the draft model does not pay for its step, the plan gives its rows no drafts.

The draft model runs only on its rows, in slot order, as a sub-batch. Its bookkeeping stays exact
across rounds in which a row was drafted by the lookup: such a row's draft KV simply lags, and the
next time the draft model drafts for it, it first feeds the tokens it has not seen, then commits
u + min(a, n - 1) as always (n: the tokens it drafted for the row). Its prefill is lazy for the
same reason: a prompt enters the draft KV the first time the model drafts for its row (at most
a window's worth, drafters/model.py), so a request the lookup serves alone costs no draft forward.

Example, rows r0 r1 r2, lengths [3, 2, 3], r1 with a 2-token lookup proposal:
    draft model on [r0, r2]      tokens [2, 3] and, when sampling, q [2, 3, V]
    proposal tokens [3, 3]       rows r0, r2 from the model; r1 = its 2 tokens + 1 padding
             looked [F, T, F]    q [3, 3, V]: r1's rows one-hot at its tokens (point masses)
    observe(accepted [1, 2, 0])  the model commits for r0 and r2 only
"""

from __future__ import annotations

import torch

from ..core.request import Request
from ..sampling import BatchSampling
from .base import DraftProposal, RoundOutcome
from .model import DraftModelDrafter
from .ngram import LookupDrafter, padded

LOOKUP = "suffix"  # what `--drafter hybrid` is built on


class HybridDrafter:
    """`model`: the draft model's drafter, or any drafter whose rows cost a step (an EAGLE head:
    drafters/eagle.py); one that reads the target's features (`features`) sees every row's,
    whoever drafted it, since it drafts from them."""

    synthetic = False
    sources = (False, True)

    def __init__(self, model: DraftModelDrafter, lookup: LookupDrafter) -> None:
        self.model, self.lookup = model, lookup
        self.features = model.features if model is not None else None
        self.confident = model is not None and model.confident  # (a gate steers the model's rows)
        self.runner_ups = model.runner_ups if model is not None else 0
        self.label = "hybrid:" + lookup.label + ("+" + model.label if self.features else "")
        self._model_rows: list[int] = []  # rows the draft model drafted for this round

    def step_probe(self, rows: int, context: int):
        return self.model.step_probe(rows, context)

    def offer(self, reqs: list[Request], caps: list[int]) -> list[int | None]:
        return [n if n else None for n in self.lookup.offer(reqs, caps)]

    def prefill(self, reqs: list[Request], ends: list[int], hidden=None, counts=None) -> None:
        self.lookup.prefill(reqs, ends)  # the draft model catches up when it first drafts a row
        if self.features:  # (a head drafts from the target's features: it takes them as they come)
            self.model.prefill(reqs, ends, hidden, counts)

    def propose(self, reqs: list[Request], lengths: list[int], uniforms: torch.Tensor | None,
                sampling: BatchSampling, gate=None) -> DraftProposal:
        found = self.lookup.lookups(reqs, lengths)
        gamma, device = max(lengths), self.model.device
        tokens = padded(found, gamma, 0, device, torch.long)
        rows = self._model_rows = [i for i, (f, n) in enumerate(zip(found, lengths)) if n > 0 and not f]
        if gate is not None:
            for i, f in enumerate(found):
                if f and gate.steered[i]:
                    gate.drop(i)  # (the lookup drafts it after all)
        out = [len(f) for f in found]
        looked = [bool(f) for f in found]
        if not rows:
            return DraftProposal(tokens, None, out, looked=looked)
        sub = [reqs[i] for i in rows]  # a subsequence of a batch in slot order: still in slot order
        sub_lengths = [lengths[i] for i in rows]
        width = max(sub_lengths)
        drafted = self.model.propose(sub, sub_lengths, uniforms[rows, :width] if uniforms is not None else None,
                                     BatchSampling.of([r.params for r in sub], device),
                                     **({"gate": gate.sub(rows)} if gate is not None else {}))
        index = torch.tensor(rows, device=device)
        tokens[index, :width] = drafted.tokens
        probs = None
        if drafted.probs is not None:  # some model row samples: the lookup rows need their one-hot q
            probs = torch.zeros(len(reqs), gamma, drafted.probs.shape[-1], dtype=drafted.probs.dtype, device=device)
            probs.scatter_(-1, tokens.unsqueeze(-1), 1.0)
            probs[index, :width] = drafted.probs
        for i, n in zip(rows, drafted.lengths or sub_lengths):
            out[i] = n
        confidence = ups = up_q = None
        if drafted.confidence is not None:
            confidence = torch.zeros(len(reqs), gamma, device=device)
            confidence[index, :width] = drafted.confidence
        if drafted.runner_ups is not None:  # (the lookup rows have none: q 0)
            w = drafted.runner_ups.shape[-1]
            ups = torch.zeros(len(reqs), gamma, w, dtype=torch.long, device=device)
            up_q = torch.zeros(len(reqs), gamma, w, device=device)
            ups[index, :width], up_q[index, :width] = drafted.runner_ups, drafted.runner_up_q
        return DraftProposal(tokens, probs, out, looked=looked, confidence=confidence, runner_ups=ups,
                             runner_up_q=up_q)

    def observe(self, reqs: list[Request], outcome: RoundOutcome) -> None:
        rows, self._model_rows = self._model_rows, []
        if self.features:
            self.model.observe(reqs, outcome)
        elif rows:
            self.model.observe([reqs[i] for i in rows],
                               RoundOutcome([outcome.accepted[i] for i in rows], [outcome.lengths[i] for i in rows]))

    def release(self, req: Request) -> None:
        self.model.release(req)
        self.lookup.release(req)

    def forget(self) -> None:
        self.lookup.forget()


class Alongside(HybridDrafter):
    """A hybrid recorded for trace replay (sched/replay.py): its model drafts every row, and each
    round its lookup is asked, alongside, what it would have proposed there (never verified). A
    greedy row's output is the target's whatever was drafted, so afterwards each proposal's
    accepted count is its common prefix with the row's final tokens (`lookup_outcome`): the
    trace then holds both sources' drafts for every row, and replay can compare the hybrid's
    choice (the lookup wherever it matched) with any other.

    Example: a row holding 12 tokens when the lookup proposed [5, 9, 9]; its final tokens at 12..
    are [5, 9, 4, ...] -> (3 proposed, 2 accepted)."""

    sources = (False,)  # (the lookup is only asked alongside)
    confident = False  # (recorded at fixed γ)

    def __init__(self, hybrid: HybridDrafter) -> None:
        if hybrid.model is None:
            raise ValueError("a hybrid without a model drafts by its lookup alone: record it as it is")
        super().__init__(hybrid.model, hybrid.lookup)
        self.label = hybrid.label
        self._asked: list[tuple[Request, int, list[int]]] | None = None  # the last offer's rows

    def offer(self, reqs: list[Request], caps: list[int]) -> list[int | None]:
        found = self.lookup.lookups(reqs, caps)  # (every row looked up; rows at cap 0 find nothing)
        self._asked = [(r, r.num_tokens, f) for r, f in zip(reqs, found)]
        return self.model.offer(reqs, caps)

    def take(self) -> list[tuple[Request, int, list[int]]] | None:
        """The last offer's (request, its length then, what the lookup proposed) per row, once."""
        asked, self._asked = self._asked, None
        return asked

    def propose(self, reqs, lengths, uniforms, sampling) -> DraftProposal:
        return self.model.propose(reqs, lengths, uniforms, sampling)

    def observe(self, reqs: list[Request], outcome: RoundOutcome) -> None:
        self.model.observe(reqs, outcome)


def lookup_outcome(req: Request, at: int, proposal: list[int]) -> tuple[int, int]:
    """(proposed, accepted): `proposal` made when `req` held `at` tokens, against its final tokens."""
    final, a = req.token_ids[at:], 0
    while a < len(proposal) and a < len(final) and proposal[a] == final[a]:
        a += 1
    return len(proposal), a
