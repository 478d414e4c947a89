"""Greedy verification: keep the longest prefix of the draft that equals the target's argmax.

This is `rejection_verify` at temperature 0 (p and q one-hot), computed without softmax.
"""

from __future__ import annotations

import torch

from .rejection import VerifyResult


def greedy_verify(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                  lengths: torch.Tensor | None = None) -> VerifyResult:
    """target_logits [B, γ+1, V] at positions (last token, d_1, ..., d_γ); draft_tokens [B, γ];
    lengths [B] (default γ): row i verifies only its first lengths[i] drafts.

    Example, γ = 3:  draft  [7, 4, 9]   argmax [7, 4, 2, 5]  ->  accepted 2, emits [7, 4, 2]
                     draft  [1, 1, 1]   argmax [1, 1, 1, 8]  ->  accepted 3, emits [1, 1, 1, 8]
                     same, length 1                          ->  accepted 1, emits [1, 1]
    """
    best = target_logits.argmax(-1)  # [B, γ+1]
    gamma = draft_tokens.shape[1]
    match = best[:, :gamma] == draft_tokens
    if lengths is not None:
        match &= torch.arange(gamma, device=match.device)[None, :] < lengths[:, None]
    match = match.to(torch.long)
    accepted = match.cumprod(dim=1).sum(dim=1)
    # Where accepted, best equals the draft token; at index `accepted` it is the target's own token.
    return VerifyResult(accepted=accepted, tokens=best)
