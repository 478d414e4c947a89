"""The KV store: every resident request's committed KV entries for one model, paged.

Layout: one tensor `data` of shape [L, 2, H, S, D] (layers, key/value, KV heads, token slots,
head dim). Token slots are grouped in blocks (see `blocks.py`); slot 0 is the null slot that
padding reads. Keeping all layers in one tensor makes moving a batch's KV one `index_select`
for the whole model instead of one copy per layer.

Rejecting draft tokens never touches the store: a request's committed length simply does not
advance over them, and later writes overwrite the stale slots.
"""

from __future__ import annotations

import torch

from .blocks import BlockAllocator


class KVStore:
    def __init__(self, layers: int, heads: int, head_dim: int, dtype, device, block_size: int = 16) -> None:
        self.shape = (layers, 2, heads, head_dim)
        self.dtype, self.device = dtype, device
        self.alloc = BlockAllocator(block_size, num_blocks=1)
        self.data = self._zeros(block_size)

    def _zeros(self, slots: int) -> torch.Tensor:
        layers, two, heads, head_dim = self.shape
        return torch.zeros(layers, two, heads, slots, head_dim, dtype=self.dtype, device=self.device)

    @property
    def block_size(self) -> int:
        return self.alloc.block_size

    def reserve(self, key: int, num_tokens: int) -> None:
        """Make room for `num_tokens` tokens of request `key`, growing the tensor if needed."""
        need = self.alloc.blocks_needed(key, num_tokens)
        if need > len(self.alloc.free):
            new_blocks = max(2 * self.alloc.num_blocks, self.alloc.num_blocks + need + 1)
            grown = self._zeros(new_blocks * self.block_size)
            grown[:, :, :, : self.data.shape[3]] = self.data
            self.data = grown
            self.alloc.grow(new_blocks)
        self.alloc.reserve(key, num_tokens)

    def release(self, key: int) -> None:
        self.alloc.release(key)

    def gather_index(self, keys: list[int], lengths: list[int], width: int, capacity: int) -> torch.Tensor:
        """Slots that lay out rows right-aligned: [B, capacity] long.

        Row i holds its first lengths[i] tokens in columns [width - lengths[i], width); every
        other column (left padding, and the room in [width, capacity)) reads the null slot 0.

        Example, block_size 4, width 5, capacity 7, tables {a: [3], b: [1, 2]}:
            a, length 2 -> [0, 0, 0, 12, 13, 0, 0]
            b, length 5 -> [4, 5, 6, 7, 8, 0, 0]
        """
        bs = self.block_size
        tables = [self.alloc.tables.get(k, [0]) for k in keys]
        max_blocks = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.long)
        length = torch.tensor(lengths, dtype=torch.long)
        pos = torch.arange(width)[None, :] - (width - length)[:, None]  # [B, width]; < 0 is padding
        valid = pos >= 0
        pos = pos.clamp(min=0)
        slot = table.gather(1, (pos // bs).clamp(max=max_blocks - 1)) * bs + pos % bs
        out = torch.zeros(len(keys), capacity, dtype=torch.long)
        out[:, :width] = torch.where(valid, slot, 0)
        return out.to(self.device)

    def gather(self, index: torch.Tensor) -> torch.Tensor:
        """The entries at `index` ([B, C] slots) as one tensor [L, 2, H, B * C, D]."""
        return self.data.index_select(3, index.reshape(-1))

    def write(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Store values [L, 2, H, n, D] at `slots` [n] (distinct, never 0)."""
        self.data.index_copy_(3, slots, values)

    def slots(self, key: int, start: int, stop: int) -> list[int]:
        return self.alloc.slots(key, start, stop)

    def tokens_in_use(self) -> int:
        return self.alloc.used_blocks * self.block_size

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()
