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
    # greedy rounds: also report q(d_j) (a softmax per step); the engine turns it on when a policy
    # reads it (TETRIS pruning), so fixed-γ rounds skip the work
    report_confidence = False
    # stop(reqs, depth, confidence, lengths) -> lengths: between steps of a greedy round, a policy
    # may cut rows' drafts short at `depth` from the q(d_j) drafted so far (`AdaptivePolicy.cut`)
    stop = None

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._unseen: list[int] = []
        self._lengths: list[int] = []

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
                sampling: BatchSampling, lengths: list[int] | None = None,
                forced: torch.Tensor | None = None) -> DraftProposal:
        """`reqs` in slot order; row i drafts lengths[i] <= gamma tokens (default all gamma): a row
        is fed only while it drafts, so a row drafting 0 is not fed at all and catches up on what
        it has not seen the next time it drafts. With `forced` [B, γ] the model is run on those
        tokens instead of its own (for a synthetic drafter that wants a real draft model's cost
        and KV). The proposal's confidence is q(d_j), the draft's probability of its own token."""
        runner = self.runner
        self._lengths = lengths = list(lengths) if lengths is not None else [gamma] * len(reqs)
        self._unseen = [r.num_tokens - r.kv_len.get(runner.name, 0) if n > 0 else 0 for r, n in zip(reqs, lengths)]
        ends = [r.num_tokens for r in reqs]
        logits = runner.feed(reqs, content_ids(reqs, ends, self._unseen, runner.device), self._unseen, logits="last")
        tokens, probs, confidence = [], [], []
        asked, seen = list(lengths), [[] for _ in reqs]  # seen: q(d_1..d_j) per row, for `stop`
        for j in range(gamma):
            if j > 0:
                if max(lengths) <= j:  # every row was cut short (`stop`)
                    break
                counts = [1 if n > j else 0 for n in lengths]
                logits = runner.feed(reqs, tokens[-1][:, None], counts, logits="last")  # [B, V]
            if forced is not None:
                token = forced[:, j]
                q = None
            elif sampling.all_greedy:
                token = logits.argmax(-1)
                q = torch.softmax(logits.float(), dim=-1) if self.report_confidence else None
            else:
                q = probabilities(logits[:, None], sampling)[:, 0]
                token = sample(q, uniforms[:, j])
                probs.append(q)
            if q is not None:
                confidence.append(q.gather(-1, token[:, None])[:, 0])
            tokens.append(token)
            if self.stop is not None and confidence and not probs and j + 1 < max(lengths):
                for row, q_j in zip(seen, confidence[-1].tolist()):  # (only the newest column is read)
                    row.append(q_j)
                cut = self.stop(reqs, j + 1, seen, lengths)
                lengths[:] = [min(n, max(j + 1, m)) for n, m in zip(lengths, cut)]  # never below what is drafted
        pad = gamma - len(tokens)  # (rows cut short: their lengths say how much of a row is real)
        drafts = torch.stack(tokens, dim=1)
        conf = torch.stack(confidence, dim=1) if confidence else None
        if pad:
            drafts = torch.cat([drafts, drafts.new_zeros(len(reqs), pad)], dim=1)
            conf = torch.cat([conf, conf.new_zeros(len(reqs), pad)], dim=1) if conf is not None else None
        return DraftProposal(drafts, torch.stack(probs, dim=1) if probs else None,
                             lengths=list(lengths) if lengths != asked else None, confidence=conf,
                             caught_up=sum(max(0, u - 2) for u in self._unseen))

    def observe(self, reqs: list[Request], accepted: list[int]) -> None:
        # row i was fed its unseen tokens and d_1..d_{n_i - 1}; keep those the target accepted
        self.runner.commit(reqs, [u + min(a, n - 1) if n > 0 else 0
                                  for u, a, n in zip(self._unseen, accepted, self._lengths)])

    def release(self, req: Request) -> None:
        self.runner.release(req)

    def forget(self) -> None:
        pass  # nothing is learned across requests
