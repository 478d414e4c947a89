"""The drafter seam: propose a batch of drafts, then observe what the target accepted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..core.request import Request
from ..sampling import BatchSampling


@dataclass
class DraftProposal:
    tokens: torch.Tensor  # [B, γ] long: drafted tokens d_1..d_γ per row
    probs: torch.Tensor | None  # [B, γ, V] the q each d_j was drawn from; None: deterministic (q one-hot)
    # row i proposes only its first lengths[i] tokens (a model-free drafter with a short or no
    # match); the rest of its row is padding and is never verified. None: every row all γ.
    lengths: list[int] | None = None
    confidence: torch.Tensor | None = None  # [B, γ] q(d_j) where the drafter knows it (TETRIS uses it)
    # tokens a draft model fed to catch up on what it missed (rows it skipped), beyond the 1 or 2
    # a row it drafted last round has unseen: a one-off that a policy must not take for the cost
    # of drafting (sched/adaptive.py)
    caught_up: int = 0
    # rows a hybrid drafter's lookup drafted (no draft-model step; judged on their own: sched/adaptive.py)
    looked: list[bool] | None = None


class Drafter(Protocol):
    label: str  # how outputs and reports name it
    synthetic: bool  # True for drafters that cheat (know the answer); reports must say so

    def prefill(self, reqs: list[Request], ends: list[int]) -> None:
        """Cover tokens [0, ends[i]) of each request's content (a prefill chunk; the last chunk
        ends at len - 1; a one-token prompt has nothing to prefill and is never passed). The
        engine may skip this (an adaptive policy that is not drafting at this batch size):
        `propose` must then catch up on whatever it has not seen."""

    def propose(self, reqs: list[Request], gamma: int, uniforms: torch.Tensor | None,
                sampling: BatchSampling, lengths: list[int] | None = None) -> DraftProposal:
        """Draft up to `gamma` tokens per row, row i at most lengths[i] (None: gamma); uniforms
        [B, γ] drive sampling (None when all greedy)."""

    def observe(self, reqs: list[Request], accepted: list[int]) -> None:
        """The target accepted accepted[i] of row i's drafts (its bonus/recovered token follows)."""

    def release(self, req: Request) -> None:
        """The request left the engine."""

    def forget(self) -> None:
        """Drop what finished requests taught the drafter (the suffix drafter's shared trie), so a
        benchmark's repeats each start from the same history; requests in flight are untouched."""
