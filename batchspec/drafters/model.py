"""Drafting with a small causal LM that keeps its own KV cache across rounds.

The draft model's context can be a window (`window` W, `EngineConfig.draft_window`): its row of a
request holds the request's first SINKS tokens and its last W to 2W, as StreamingLLM keeps a
model's attention sinks and its recent tokens (Xiao et al. 2023; MagicDec drafts with such a
cache at large batch sizes). A feed that would take the row past SINKS + 2W re-cuts it: the row
starts again from its first SINKS tokens and the last W of what it has seen. Drafts only propose,
so this changes no output (verification keeps the target's greedy tokens, and rejection sampling
uses the q the drafts were drawn from); it bounds what a draft step attends over and what a draft
model catches up on: at most SINKS + W tokens where it would have fed a whole prompt.

Example, W = 4, SINKS = 2 (4 in the engine), a prompt of 15 tokens t0..t14: the first feed is t0
t1 t11..t14 (6 tokens, at the draft's positions 0..5; 9 skipped). The row grows by what the draft
model drafts and the target accepts; when a feed would take it past 2 + 8 = 10 tokens, it is cut
again to t0 t1 and the last 4 tokens.
"""

from __future__ import annotations

import torch

from ..core.request import Request
from ..core.runner import ModelRunner, padded_ids
from ..core.timing import step_runner
from ..sampling import BatchSampling, probabilities, sample
from .base import DraftProposal

SINKS = 4  # a windowed row keeps its request's first tokens (StreamingLLM's attention sinks)


class DraftModelDrafter:
    """Each round feeds the draft model only what it has not seen (the last one or two tokens,
    or more after rounds without drafting), then γ - 1 of its own drafts, each row at its own
    offset; after verification it commits the accepted prefix, so nothing is fed twice but a
    window's worth when a row is cut again (see the module docstring). d_γ is never fed: when all
    drafts are accepted the next round feeds d_γ with the bonus token."""

    label = "draft_model"
    synthetic = False
    features = None
    sources = (False,)
    confident = False
    runner_ups = 0

    def __init__(self, runner: ModelRunner, window: int | None = None, forward: str = "auto") -> None:
        self.runner, self.forward = runner, forward  # (forward: how `step_probe` runs it, as the runner does)
        self.window = window  # None: a row holds its whole request (see the module docstring)
        self._skipped: dict[int, int] = {}  # request index -> its tokens after the sinks its row leaves out
        self._unseen: list[int] = []  # what each row was fed first this round (what it had not seen)
        self._lengths: list[int] = []

    @property
    def device(self):
        return self.runner.device

    def unseen(self, req: Request, end: int | None = None) -> int:
        """How many of `req`'s tokens before `end` (default: all) the draft model has not seen."""
        end = req.num_tokens if end is None else end
        held = req.kv_len.get(self.runner.name, 0)
        return end - (self._skipped.get(req.index, 0) if held else 0) - held  # (an empty row skips nothing)

    def feeds(self, req: Request) -> int:
        """How many tokens catching `req`'s row up feeds it: what it has not seen, or a window's
        worth where that re-cuts the row."""
        unseen = self.unseen(req)
        return SINKS + self.window if self._recut(req, unseen) else unseen

    def _recut(self, req: Request, unseen: int) -> bool:
        return self.window is not None and req.kv_len.get(self.runner.name, 0) + unseen > SINKS + 2 * self.window

    def _catch_up(self, reqs: list[Request], ends: list[int], counts: list[int]) -> tuple[torch.Tensor, list[int]]:
        """[b, max fed] ids that feed row i what it has not seen of reqs[i] before ends[i] (counts[i]
        tokens) or, where that would take it past its window, the request's first SINKS tokens and
        its last `window` (the row re-cut: its KV is written again from column 0); and how many
        tokens each row is fed."""
        rows = []
        for r, end, count in zip(reqs, ends, counts):
            if count and self._recut(r, count):
                r.kv_len[self.runner.name] = 0  # (called before anything is fed this round)
                self._skipped[r.index] = end - SINKS - self.window
                rows.append(r.token_ids[:SINKS] + r.token_ids[end - self.window:end])
            else:
                if not r.kv_len.get(self.runner.name, 0):
                    self._skipped.pop(r.index, None)
                rows.append(r.token_ids[end - count:end])
        return padded_ids(rows, self.runner.device), [len(row) for row in rows]

    def step_probe(self, rows: int, context: int):
        return step_runner(self.runner.model, rows, context, 1, self.forward)

    def offer(self, reqs: list[Request], caps: list[int]) -> list[int | None]:
        return [None] * len(reqs)

    def prefill(self, reqs: list[Request], ends: list[int], hidden=None, counts=None) -> None:
        rows = [(r, e, n) for r, e in zip(reqs, ends) if (n := self.unseen(r, e)) > 0]
        if not rows:
            return
        reqs, ends = [r for r, _, _ in rows], [e for _, e, _ in rows]
        ids, fed = self._catch_up(reqs, ends, [n for _, _, n in rows])
        self.runner.feed(reqs, ids, fed, logits="none")
        self.runner.commit(reqs, fed)

    def propose(self, reqs: list[Request], lengths: list[int], uniforms: torch.Tensor | None,
                sampling: BatchSampling, forced: torch.Tensor | None = None) -> DraftProposal:
        """`reqs` in slot order; row i drafts lengths[i] tokens: a row is fed only while it drafts,
        so a row drafting 0 is not fed at all and catches up on what it has not seen the next
        time it drafts. With `forced` [B, γ] the model is run on those tokens instead of its own
        (for a synthetic drafter that wants a real draft model's cost and KV)."""
        runner, gamma = self.runner, max(lengths)
        self._lengths = lengths = list(lengths)
        unseen = [self.unseen(r) if n > 0 else 0 for r, n in zip(reqs, lengths)]
        ids, self._unseen = self._catch_up(reqs, [r.num_tokens for r in reqs], unseen)
        logits = runner.feed(reqs, ids, self._unseen, logits="last")
        tokens, probs = [], []
        for j in range(gamma):
            if j > 0:
                counts = [1 if n > j else 0 for n in lengths]
                logits = runner.feed(reqs, tokens[-1][:, None], counts, logits="last")  # [B, V]
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

    def observe(self, reqs: list[Request], outcome) -> None:
        # row i was fed its unseen tokens and d_1..d_{n_i - 1}; keep those the target accepted
        self.runner.commit(reqs, [u + min(a, n - 1) if n > 0 else 0
                                  for u, a, n in zip(self._unseen, outcome.accepted, self._lengths)])

    def release(self, req: Request) -> None:
        self._skipped.pop(req.index, None)
        self.runner.release(req)

    def forget(self) -> None:
        pass  # nothing is learned across requests
