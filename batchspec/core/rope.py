"""RoPE's angles read off a table of every position so far, grown on demand.

A model's rotary module computes each angle as one product, inv_freq x position, then its cos and
sin: a table built by the module over positions 0..P-1 holds what it gives at each position, and
a forward pass reads its rows' angles with two lookups instead of about ten operations (on a GPU,
where a step is bound by its host, each one counts). The caller says how far the positions reach
(`need`: known from the layout), so the device is never asked. The lean forward and the EAGLE head
share it; RoPE types that scale with the sequence's length are not tabled (the lean forward
refuses them, the head computes them each time).

Example: positions [[5], [9]] with need 10 -> cos, sin [2, 1, D], rows 5 and 9 of a 256-row table.
"""

from __future__ import annotations

import torch


class RopeTable:
    def __init__(self, rotary) -> None:
        self.rotary = rotary  # transformers' rotary embedding module: (x, position_ids) -> cos, sin
        self.cos: torch.Tensor | None = None  # [P, D] over positions 0..P-1
        self.sin: torch.Tensor | None = None

    def __call__(self, positions: torch.Tensor, need: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [*positions.shape, D] in `dtype` at `positions`, all below `need`."""
        cos = self.cos
        if cos is None or cos.shape[0] < need or cos.dtype != dtype or cos.device != positions.device:
            have = 0 if cos is None else cos.shape[0]
            size = max(need, 256, 2 * have if have < need else have)
            like = torch.zeros(1, dtype=dtype, device=positions.device)  # (the module reads its dtype and device)
            with torch.no_grad():
                cos, sin = self.rotary(like, torch.arange(size, device=positions.device)[None])
            self.cos, self.sin = cos[0], sin[0]
        return self.cos[positions], self.sin[positions]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE applied to x [..., D] with cos, sin broadcast to it: x cos + rotate_half(x) sin, where
    rotate_half(x) = [-x[D/2:], x[:D/2]] (transformers' convention)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
