"""Drafting with a small causal LM that keeps its own KV cache across rounds."""

from __future__ import annotations

import torch

from ..core.request import Request
from ..core.runner import ModelRunner, content_ids
from ..sampling import BatchSampling, probabilities, sample
from .base import DraftProposal


class DraftModelDrafter:
    """Each round feeds the draft model only what it has not seen (the last one or two tokens,
    or more after rounds without drafting), then γ - 1 of its own drafts, each row at its own
    offset; after verification it commits the accepted prefix, so nothing is ever re-prefilled.
    d_γ is never fed: when all drafts are accepted the next round feeds d_γ with the bonus token."""

    label = "draft_model"
    synthetic = False

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._unseen: list[int] = []
        self._gamma = 0

    def prefill(self, reqs: list[Request], ends: list[int]) -> None:
        runner = self.runner
        rows = [(r, e, e - r.kv_len.get(runner.name, 0)) for r, e in zip(reqs, ends)]
        rows = [row for row in rows if row[2] > 0]
        if not rows:
            return
        reqs, ends, counts = [r for r, _, _ in rows], [e for _, e, _ in rows], [c for _, _, c in rows]
        runner.feed(reqs, content_ids(reqs, ends, counts, runner.device), counts, logits="none")
        runner.commit(reqs, counts)

    def propose(self, reqs: list[Request], gamma: int, uniforms: torch.Tensor | None,
                sampling: BatchSampling, forced: torch.Tensor | None = None) -> DraftProposal:
        """`reqs` in slot order. With `forced` [B, γ] the model is run on those tokens instead of
        its own (for a synthetic drafter that wants a real draft model's cost and KV)."""
        runner = self.runner
        self._unseen = [r.num_tokens - r.kv_len.get(runner.name, 0) for r in reqs]
        self._gamma = gamma
        ends = [r.num_tokens for r in reqs]
        logits = runner.feed(reqs, content_ids(reqs, ends, self._unseen, runner.device), self._unseen, logits="last")
        ones = [1] * len(reqs)
        tokens, probs = [], []
        for j in range(gamma):
            if j > 0:
                logits = runner.feed(reqs, tokens[-1][:, None], ones, logits="last")  # [B, V]
            if forced is not None:
                token = forced[:, j]
            elif sampling.all_greedy:
                token = logits.argmax(-1)
            else:
                q = probabilities(logits[:, None], sampling)[:, 0]
                token = sample(q, uniforms[:, j])
                probs.append(q)
            tokens.append(token)
        return DraftProposal(torch.stack(tokens, dim=1), torch.stack(probs, dim=1) if probs else None)

    def observe(self, reqs: list[Request], accepted: list[int]) -> None:
        last_fed = self._gamma - 1  # d_1..d_{γ-1} were fed
        self.runner.commit(reqs, [u + min(a, last_fed) for u, a in zip(self._unseen, accepted)])

    def release(self, req: Request) -> None:
        self.runner.release(req)
