"""The KV store: every resident request's committed KV entries for one model, paged.

Layout: one tensor `data` of shape [L, 2, H, S, D] (layers, key/value, KV heads, token slots,
head dim). Token slots are grouped in blocks (see `blocks.py`); slot 0 is the null slot that
padding reads. Keeping all layers in one tensor makes moving a batch's KV one `index_select`
for the whole model instead of one copy per layer.

Rejecting draft tokens never touches the store: a request's committed length simply does not
advance over them, and later writes overwrite the stale slots.

The store is allocated once, to a budget of `num_blocks` blocks, and never grows: the engine
checks room before it admits or advances a request (and preempts when it must), so running out
here is a bug, reported as such. Only the null block is zeroed; every other slot is written
before it is ever read.
"""

from __future__ import annotations

import torch

from .blocks import BlockAllocator


class KVStore:
    def __init__(self, layers: int, heads: int, head_dim: int, dtype, device, block_size: int = 16,
                 num_blocks: int = 2) -> None:
        self.shape = (layers, 2, heads, head_dim)
        self.dtype, self.device = dtype, device
        self.alloc = BlockAllocator(block_size, num_blocks=max(2, num_blocks))
        self.data = torch.empty(layers, 2, heads, self.alloc.num_blocks * block_size, head_dim, dtype=dtype,
                                device=device)
        self.data[:, :, :, :block_size] = 0  # the null block that padding reads

    @staticmethod
    def bytes_per_token(layers: int, heads: int, head_dim: int, dtype) -> int:
        return layers * 2 * heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    @property
    def block_size(self) -> int:
        return self.alloc.block_size

    def can_reserve(self, key: int, num_tokens: int) -> bool:
        return self.alloc.blocks_needed(key, num_tokens) <= len(self.alloc.free)

    def reserve(self, key: int, num_tokens: int) -> None:
        """Make room for `num_tokens` tokens of request `key` (the caller checked there is)."""
        if not self.can_reserve(key, num_tokens):
            raise MemoryError(f"KV store out of blocks for request {key} ({num_tokens} tokens): the engine should "
                              "have preempted first; this is a bug")
        self.alloc.reserve(key, num_tokens)

    def release(self, key: int, poison: bool = False) -> None:
        """Free the blocks of `key`. With `poison` (debug mode) they are filled with NaN first, so
        that any later read of released KV shows up in the outputs instead of passing unnoticed."""
        if poison and key in self.alloc.tables:
            bs = self.block_size
            slots = torch.tensor([b * bs + i for b in self.alloc.tables[key] for i in range(bs)], device=self.device)
            self.data.index_fill_(3, slots, float("nan"))
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

    @property
    def capacity_tokens(self) -> int:
        return (self.alloc.num_blocks - 1) * self.block_size

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()
