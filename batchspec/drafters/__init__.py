"""Drafters behind one protocol, built from a spec string by a registry."""

from __future__ import annotations

from collections.abc import Callable, MutableMapping

from .base import Drafter, DraftProposal
from .model import DraftModelDrafter
from .oracle import OracleDrafter, bernoulli_mismatch

DRAFTERS = ("draft_model", "oracle:<p>")


def parse_drafter(spec: str) -> tuple[str, float | None]:
    """'draft_model' -> ('draft_model', None); 'oracle:0.7' -> ('oracle', 0.7). Raises ValueError."""
    name, _, arg = spec.partition(":")
    if name == "draft_model" and not arg:
        return name, None
    if name == "oracle":
        try:
            prob = float(arg)
        except ValueError:
            prob = -1.0
        if not 0.0 <= prob <= 1.0:
            raise ValueError(f"oracle drafter needs an acceptance probability in [0, 1], e.g. oracle:0.7; got {spec!r}")
        return name, prob
    raise ValueError(f"unknown drafter {spec!r}; choose one of {', '.join(DRAFTERS)}")


def make_drafter(spec: str, *, draft_runner, device, vocab_size: int,
                 references: MutableMapping[tuple[int, ...], list[int]] | None = None, seed: int = 0,
                 compute_reference: Callable | None = None) -> Drafter:
    name, prob = parse_drafter(spec)
    if name == "draft_model":
        if draft_runner is None:
            raise ValueError("drafter 'draft_model' needs a draft model; pass --draft or choose another drafter")
        return DraftModelDrafter(draft_runner)
    if references is None and compute_reference is None:
        raise ValueError("the oracle drafter needs the target's reference outputs or a way to compute them")
    cost = DraftModelDrafter(draft_runner) if draft_runner is not None else None
    label = f"oracle:{prob:g} (synthetic{', draft-model cost' if cost else ', zero draft cost'})"
    return OracleDrafter(references if references is not None else {}, bernoulli_mismatch(prob, seed), vocab_size,
                         device, cost, label, compute_reference)


__all__ = ["DRAFTERS", "DraftModelDrafter", "DraftProposal", "Drafter", "OracleDrafter", "make_drafter",
           "parse_drafter"]
