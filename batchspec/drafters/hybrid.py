"""Hybrid drafting (`--drafter hybrid[:min_n,max_n,k]`): prompt lookup where it is confident, the
draft model elsewhere, decided per row and per round.

A row is confident when its newest min_n tokens (default 3, stricter than `ngram`'s 2) occurred
earlier: it gets the n-gram proposal (see ngram.py). The draft model runs only on the other
rows, in slot order, as a sub-batch. Its bookkeeping stays exact across rounds in which a row
was drafted by n-gram: such a row's draft KV simply lags, and the next time the draft model
drafts for it, it first feeds the tokens it has not seen (`DraftModelDrafter` computes them from
the row's committed draft length), then commits u + min(a, n - 1) as always (n: the tokens it
drafted for the row).

Example, γ = 3, rows r0 r1 r2, r1 confident with a 2-token n-gram proposal:
    draft model on [r0, r2]      tokens [2, 3] and, when sampling, q [2, 3, V]
    proposal tokens [3, 3]       rows r0, r2 from the model; r1 = its 2 tokens + 1 padding
             lengths [3, 2, 3]   q [3, 3, V]: r1's rows one-hot at its tokens (point masses)
    observe(accepted [1, 2, 0])  the model commits for r0 and r2 only
"""

from __future__ import annotations

import torch

from ..core.request import Request
from ..sampling import BatchSampling
from .base import DraftProposal
from .model import DraftModelDrafter
from .ngram import NgramDrafter

MIN_N = 3


class HybridDrafter:
    synthetic = False

    def __init__(self, model: DraftModelDrafter, ngram: NgramDrafter) -> None:
        self.model, self.ngram = model, ngram
        self.label = "hybrid:" + ngram.label.partition(":")[2]
        self._model_rows: list[int] = []  # rows the draft model drafted for this round

    def prefill(self, reqs: list[Request], ends: list[int]) -> None:
        self.model.prefill(reqs, ends)
        self.ngram.prefill(reqs, ends)

    def propose(self, reqs: list[Request], gamma: int, uniforms: torch.Tensor | None,
                sampling: BatchSampling, lengths: list[int] | None = None) -> DraftProposal:
        caps = lengths if lengths is not None else [gamma] * len(reqs)
        found = [self.ngram.find(r, c)[0] if c > 0 else [] for r, c in zip(reqs, caps)]
        device = self.model.runner.device
        tokens = torch.tensor([f + [0] * (gamma - len(f)) for f in found], dtype=torch.long, device=device)
        rows = self._model_rows = [i for i, (f, c) in enumerate(zip(found, caps)) if c > 0 and not f]
        if not rows:
            return DraftProposal(tokens, None, [len(f) for f in found])
        sub = [reqs[i] for i in rows]  # a subsequence of a batch in slot order: still in slot order
        sub_caps = [caps[i] for i in rows]
        width = max(sub_caps)
        drafted = self.model.propose(sub, width, uniforms[rows, :width] if uniforms is not None else None,
                                     BatchSampling.of([r.params for r in sub], device), sub_caps)
        index = torch.tensor(rows, device=device)
        tokens[index, :width] = drafted.tokens
        probs = None
        if drafted.probs is not None:  # some model row samples: the n-gram rows need their one-hot q
            probs = torch.zeros(len(reqs), gamma, drafted.probs.shape[-1], dtype=drafted.probs.dtype, device=device)
            probs.scatter_(-1, tokens.unsqueeze(-1), 1.0)
            probs[index, :width] = drafted.probs
        lengths = [len(f) for f in found]
        for i, c in zip(rows, sub_caps):
            lengths[i] = c
        return DraftProposal(tokens, probs, lengths)

    def observe(self, reqs: list[Request], accepted: list[int]) -> None:
        if self._model_rows:
            self.model.observe([reqs[i] for i in self._model_rows], [accepted[i] for i in self._model_rows])
            self._model_rows = []

    def release(self, req: Request) -> None:
        self.model.release(req)
        self.ngram.release(req)

