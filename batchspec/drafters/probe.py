"""A drafter asked at every position and verified nowhere: what a walk records (sched/walk.py).

`Probe` wraps an engine's drafter. Each round its model part (a draft model or an EAGLE head)
drafts every row to its cap, and its lookup part (a hybrid's, or a lookup drafter itself) is
asked what it would propose; both are kept, and the round verifies none of them: `propose`
says every row found 0 tokens, so the target's pass is a plain step and each row gains exactly
one token. A run then visits every position of every request, and afterwards each proposal is
judged against its row's final tokens (`lookup_outcome`: a greedy row's output is the target's,
whatever was drafted, so its common prefix is what the target would have accepted there).

The drafters underneath keep their state exact as in any round that accepted nothing: a model
part commits u + min(0, n - 1) of what it fed, a head keeps the features of the newest token.

Example, γ 2, one row holding 5 tokens whose final tokens from 5 on are [7, 8, 9]: the head
drafts [7, 3], the lookup proposes [7, 8]; the pass commits 7 alone. Judged: the head (2
proposed, 1 accepted), the lookup (2, 2). A head also reports its runner-ups at each depth, say
[4, 8, 5] after 3 at depth 2: the target's token there (8) is the runner-up of rank 1, which a
sibling of rank 1 at that depth would have committed (`WalkRecorder.finish`).
"""

from __future__ import annotations

import torch

from ..core.request import Request
from .base import DraftProposal, RoundOutcome


class Probe:
    """`model`: a drafter whose rows cost a step (None: none); `lookup`: a `LookupDrafter` (None:
    none). `take()` hands over each round's asks: (request, its length then, the model's
    proposal or None, the lookup's or None, the model's confidence in each of its drafts or None,
    its runner-ups at each depth [(token, q), ...] or None: `DraftProposal.runner_ups`) per row."""

    synthetic = False

    def __init__(self, model, lookup) -> None:
        if model is None and lookup is None:
            raise ValueError("a probe needs a model part, a lookup, or both")
        self.model, self.lookup = model, lookup
        self.features = model.features if model is not None else None
        self.sources = (False,)  # (every row is "drafted" by a step, or by nothing: a plain pass)
        self.confident = False  # (fixed γ: every row drafts its cap; a confident model's confidences are kept)
        self.runner_ups = 0  # (chains: what a recording asks is the drafts)
        self.label = "probe:" + (model.label if model is not None else lookup.label)
        self._asked: list[tuple] | None = None

    @classmethod
    def of(cls, drafter) -> Probe:
        """The probe of an engine's drafter: a hybrid's two parts, a lookup alone or a model alone."""
        from .hybrid import HybridDrafter
        from .ngram import LookupDrafter

        if isinstance(drafter, HybridDrafter):
            return cls(drafter.model, drafter.lookup)
        if isinstance(drafter, LookupDrafter):
            return cls(None, drafter)
        if getattr(drafter, "synthetic", False):
            raise ValueError(f"{drafter.label} knows the answer: a walk of it would say nothing")
        return cls(drafter, None)

    def step_probe(self, rows: int, context: int):
        return self.model.step_probe(rows, context) if self.model is not None else None

    def offer(self, reqs: list[Request], caps: list[int]) -> list[int | None]:
        found = self.lookup.lookups(reqs, caps) if self.lookup is not None else [None] * len(reqs)
        self._asked = [(r, r.num_tokens, None, f, None, None) for r, f in zip(reqs, found)]
        return [None] * len(reqs)  # (fixed γ: every row is planned at its cap)

    def prefill(self, reqs: list[Request], ends: list[int], hidden=None, counts=None) -> None:
        if self.lookup is not None:
            self.lookup.prefill(reqs, ends)
        if self.model is not None:
            self.model.prefill(reqs, ends, hidden, counts)

    def propose(self, reqs: list[Request], lengths: list[int], uniforms, sampling) -> DraftProposal:
        b = len(reqs)
        if self.model is not None and any(lengths):
            drafted = self.model.propose(reqs, lengths, uniforms, sampling)
            rows = drafted.tokens.tolist()
            cut = drafted.lengths or lengths
            sure = drafted.confidence.tolist() if drafted.confidence is not None else [None] * b
            ups = ([[list(zip(t, q)) for t, q in zip(tok, qs)] for tok, qs in
                    zip(drafted.runner_ups.tolist(), drafted.runner_up_q.tolist())]
                   if drafted.runner_ups is not None else [None] * b)
            self._asked = [(r, at, row[:min(n, m)], f, c and [round(x, 3) for x in c[:min(n, m)]], u and u[:min(n, m)])
                           for (r, at, _, f, _, _), row, n, m, c, u in zip(self._asked, rows, lengths, cut, sure, ups)]
        device = self.model.device if self.model is not None else None
        return DraftProposal(torch.zeros(b, 0, dtype=torch.long, device=device), None, [0] * b, looked=[False] * b)

    def take(self) -> list[tuple] | None:
        """The last round's asks, once."""
        asked, self._asked = self._asked, None
        return asked

    def observe(self, reqs: list[Request], outcome: RoundOutcome) -> None:
        if self.model is not None:
            self.model.observe(reqs, outcome)

    def release(self, req: Request) -> None:
        for part in (self.model, self.lookup):
            if part is not None:
                part.release(req)

    def forget(self) -> None:
        if self.lookup is not None:
            self.lookup.forget()
