"""Drafting with a small causal LM that keeps its own KV cache across rounds."""

from __future__ import annotations

import torch

from ..core.request import Request
from ..core.runner import ModelRunner
from ..sampling import BatchSampling, probabilities, sample
from .base import DraftProposal


class DraftModelDrafter:
    """Each round feeds the draft model only what it has not seen (the last one or two tokens),
    then γ - 1 of its own drafts; after verification it commits the accepted prefix, so nothing
    is ever re-prefilled. d_γ is never fed: when all drafts are accepted the next round feeds
    d_γ together with the bonus token."""

    label = "draft_model"
    synthetic = False

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._real_tail: list[int] = []
        self._gamma = 0

    def prefill(self, reqs: list[Request], ends: list[int]) -> None:
        runner = self.runner
        tail = runner.begin(reqs, ends=ends)
        if tail > 0:
            runner.feed(keep=1)
        runner.commit(reqs, [tail - cp for cp in runner.layout.tail_pad])

    def propose(self, reqs: list[Request], gamma: int, uniforms: torch.Tensor | None,
                sampling: BatchSampling, forced: torch.Tensor | None = None) -> DraftProposal:
        """With `forced` [B, γ] the model is run on those tokens instead of its own (for a
        synthetic drafter that wants a real draft model's cost and KV)."""
        runner = self.runner
        tail = runner.begin(reqs, extra=gamma - 1)
        self._real_tail = [tail - cp for cp in runner.layout.tail_pad]
        self._gamma = gamma
        tokens, probs = [], []
        logits = runner.feed(keep=1)
        for j in range(gamma):
            if j > 0:
                logits = runner.feed(extra=tokens[-1][:, None], keep=1)
            if forced is not None:
                token = forced[:, j]
            elif sampling.all_greedy:
                token = logits[:, -1].argmax(-1)
            else:
                q = probabilities(logits, sampling)[:, -1]
                token = sample(q, uniforms[:, j])
                probs.append(q)
            tokens.append(token)
        return DraftProposal(torch.stack(tokens, dim=1), torch.stack(probs, dim=1) if probs else None)

    def observe(self, reqs: list[Request], accepted: list[int]) -> None:
        last_fed = self._gamma - 1  # d_1..d_{γ-1} were fed
        self.runner.commit(reqs, [t + min(a, last_fed) for t, a in zip(self._real_tail, accepted)])

    def release(self, req: Request) -> None:
        self.runner.release(req)
