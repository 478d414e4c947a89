"""A synthetic drafter that knows the answer: for tests and overhead studies only.

It proposes the next γ tokens of a reference continuation (the target's own greedy output),
replacing chosen positions with a wrong token. Tests choose the positions to force ragged
acceptance; `oracle:<p>` in the CLI keeps each token with probability p, seeded, so the
system overhead of a method can be measured at any acceptance rate. With a draft model
attached, the draft model is run on the proposed tokens, so a round costs what a real
drafting round costs (and the draft's KV stays consistent).

Its proposals are deterministic (q one-hot). Every report labels it synthetic.
"""

from __future__ import annotations

import random
from collections.abc import Callable, MutableMapping

import torch

from ..core.request import Request
from ..sampling import BatchSampling
from .base import DraftProposal
from .model import DraftModelDrafter

# mismatch(request, round, position) -> True to propose a wrong token there
Mismatch = Callable[[Request, int, int], bool]


def bernoulli_mismatch(accept_prob: float, seed: int = 0) -> Mismatch:
    """Each proposed token is right with probability `accept_prob`, independently, seeded."""

    def mismatch(req: Request, round_: int, pos: int) -> bool:
        key = hash((seed, tuple(req.token_ids[: req.prompt_len]), round_, pos))
        return random.Random(key).random() >= accept_prob

    return mismatch


class OracleDrafter:
    synthetic = True
    features = None
    sources = (False,)
    confident = False
    runner_ups = 0

    def __init__(self, references: MutableMapping[tuple[int, ...], list[int]], mismatch: Mismatch,
                 vocab_size: int, device, cost_model: DraftModelDrafter | None = None,
                 label: str = "oracle", compute: Callable[[Request], list[int]] | None = None) -> None:
        self.references = references
        self.compute = compute  # target-only greedy output of a request, for prompts without a reference
        self.device = device
        self.mismatch = mismatch
        self.vocab_size = vocab_size
        self.cost_model = cost_model
        self.label = label
        self._rounds: dict[int, int] = {}

    def reference(self, req: Request) -> list[int]:
        key = tuple(req.token_ids[: req.prompt_len])
        ref = self.references.get(key)
        short = ref is not None and len(ref) < req.params.max_new_tokens and not (ref and ref[-1] in req.stop_ids)
        if ref is None or short:
            if self.compute is None:
                raise KeyError("the oracle drafter has no reference continuation for this prompt; "
                               "it only works on prompts whose target-only output was computed first")
            ref = self.references[key] = self.compute(req)
        return ref

    def step_probe(self, rows: int, context: int):
        """Priced as the draft model it runs for its cost, or free without one."""
        return self.cost_model.step_probe(rows, context) if self.cost_model is not None else None

    def offer(self, reqs: list[Request], caps: list[int]) -> list[int | None]:
        return [None] * len(reqs)

    def prefill(self, reqs: list[Request], ends: list[int], hidden=None, counts=None) -> None:
        for r in reqs:
            self.reference(r)
        if self.cost_model is not None:
            self.cost_model.prefill(reqs, ends)

    def propose(self, reqs: list[Request], lengths: list[int], uniforms: torch.Tensor | None,
                sampling: BatchSampling) -> DraftProposal:
        gamma, rows = max(lengths), []
        for r in reqs:
            ref = self.reference(r)
            start = r.num_generated
            round_ = self._rounds.get(r.index, 0)
            row = []
            for j in range(gamma):
                tok = ref[start + j] if start + j < len(ref) else 0
                if self.mismatch(r, round_, j):
                    tok = (tok + 1) % self.vocab_size
                row.append(tok)
            rows.append(row)
            self._rounds[r.index] = round_ + 1
        tokens = torch.tensor(rows, dtype=torch.long, device=self.device)
        if self.cost_model is not None:
            self.cost_model.propose(reqs, lengths, uniforms, sampling, forced=tokens)
        return DraftProposal(tokens, None)

    def observe(self, reqs: list[Request], outcome) -> None:
        if self.cost_model is not None:
            self.cost_model.observe(reqs, outcome)

    def forget(self) -> None:
        pass  # the references are the task, not history

    def release(self, req: Request) -> None:
        self._rounds.pop(req.index, None)
        if self.cost_model is not None:
            self.cost_model.release(req)
