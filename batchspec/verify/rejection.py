"""Speculative (rejection) sampling, vectorised over the batch.

Glossary
    accepted token   a drafted token x_j the target keeps: drawn u_j < p_j(x_j) / q_j(x_j).
    recovered token  at the first rejection j, a token drawn from the residual
                     normalize(max(0, p_j - q_j)) in place of x_j; the round ends there.
    bonus token      when all γ drafts are accepted, one token drawn from the target's own
                     p_{γ+1}; it needs no draft and no extra forward pass.

Why the output is distributed exactly as the target's (Leviathan et al., 2023, Thm. 1):
    P(emit y) = P(draft y, accept) + P(reject) P(residual = y)
              = min(q(y), p(y)) + (1 - sum_z min(q(z), p(z))) * max(0, p(y) - q(y)) / sum_z max(0, p(z) - q(z))
              = min(q(y), p(y)) + max(0, p(y) - q(y)) = p(y),   since 1 - sum min(p, q) = sum max(0, p - q).

Edge cases: q(x) = 0 for a proposed x (a deterministic drafter's q is one-hot, so this only
arises from inconsistent input) accepts iff p(x) > 0; if the residual has no mass (p <= q
everywhere, so p == q and rejection had probability 0) the target's p is used instead;
top-k / top-p supports that differ between p and q need nothing special, they are just
zeros in p or q.

No device sync: the residual is computed for every row and selected where a draft was
rejected, rather than asking the device whether any was.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling import sample


@dataclass
class VerifyResult:
    accepted: torch.Tensor  # [B] long: drafts kept, 0..γ
    tokens: torch.Tensor  # [B, γ+1] long: row i emits tokens[i, : accepted[i] + 1]


def rejection_verify(
    p: torch.Tensor,
    q: torch.Tensor | None,
    draft_tokens: torch.Tensor,
    u_accept: torch.Tensor,
    u_final: torch.Tensor,
    lengths: torch.Tensor | None = None,
) -> VerifyResult:
    """p [B, γ+1, V] target distributions at (last token, d_1..d_γ); q [B, γ, V] the draft
    distributions the tokens were sampled from (None: deterministic drafts, q one-hot);
    draft_tokens [B, γ]; u_accept [B, γ] and u_final [B] uniforms in [0, 1) (float64, as
    `draw_uniforms` returns them: the acceptance test u q(x) < p(x) is then made in float64);
    lengths [B] (default γ): row i verifies only its first lengths[i] drafts, and when it
    accepts all of them its bonus token is drawn from p at position lengths[i].
    """
    batch, gamma = draft_tokens.shape
    idx = draft_tokens.unsqueeze(-1)
    p_x = p[:, :gamma].gather(-1, idx).squeeze(-1)  # [B, γ]
    q_x = q.gather(-1, idx).squeeze(-1) if q is not None else torch.ones_like(p_x)
    accept = u_accept * q_x < p_x
    if lengths is None:
        lengths = torch.full((batch,), gamma, dtype=torch.long, device=p.device)
    accept &= torch.arange(gamma, device=p.device)[None, :] < lengths[:, None]
    accepted = accept.to(torch.long).cumprod(dim=1).sum(dim=1)  # [B]

    # Distribution of the one token the target adds: residual at the first rejection, else p_{γ+1}.
    rows = torch.arange(batch, device=p.device)
    p_at = p[rows, accepted]  # [B, V]
    if gamma > 0:  # (γ = 0: an autoregressive step, nothing to reject)
        rejected = accepted < lengths
        j = accepted.clamp(max=gamma - 1)
        if q is not None:
            q_at = q[rows, j]
        else:
            q_at = torch.zeros_like(p_at).scatter_(-1, draft_tokens[rows, j].unsqueeze(-1), 1.0)
        residual = (p_at - q_at).clamp(min=0)
        empty = residual.sum(-1, keepdim=True) <= 0
        residual = torch.where(empty, p_at, residual)
        p_at = torch.where(rejected[:, None], residual, p_at)
    final = sample(p_at, u_final)  # [B]

    tokens = torch.zeros(batch, gamma + 1, dtype=torch.long, device=p.device)
    tokens[:, :gamma] = draft_tokens
    tokens[rows, accepted] = final
    return VerifyResult(accepted=accepted, tokens=tokens)
