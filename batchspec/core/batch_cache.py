"""The working KV of one batch, behind transformers' `Cache` interface.

A `BatchKV` is preallocated with room to grow: `buf` has shape [L, 2, H, B * capacity, D]
(the layout `KVStore.gather` returns), and columns [0, width) of every row are in use.
A forward pass of n tokens writes its new keys/values into columns [width, width + n) in place
and the model attends over [0, width + n); `advance(n)` then moves `width`. No tensor is ever
concatenated, unlike `DynamicCache`, which copies the whole cache on every step.

Per layer the model sees views of shape [B, H, width + n, D] in which each (row, head) slab is
contiguous, which is what attention kernels want.
"""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class _Layer(CacheLayerMixin):
    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner: BatchKV, index: int) -> None:
        super().__init__()
        # A weak reference: a cycle BatchKV <-> layer would keep every replaced buffer alive until
        # Python's cyclic collector happens to run, which it does not schedule by tensor memory.
        self._owner, self.index = weakref.ref(owner), index
        self.is_initialized = True

    @property
    def owner(self) -> BatchKV:
        return self._owner()

    def lazy_initialization(self, key_states, value_states) -> None:  # preallocated
        return None

    def update(self, key_states, value_states, *args, **kwargs):
        return self.owner.write(self.index, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.width + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.width

    def get_max_length(self) -> int:
        return -1


class BatchKV(Cache):
    def __init__(self, buf: torch.Tensor, rows: int, capacity: int, width: int) -> None:
        layers, two, heads, slots, head_dim = buf.shape
        if slots != rows * capacity:
            raise ValueError(f"buffer holds {slots} slots, expected {rows} x {capacity}")
        self.buf, self.rows, self.capacity, self.width = buf, rows, capacity, width
        # [L, 2, B, H, capacity, D] view: each (row, head) slab of `capacity` tokens contiguous
        self.view = buf.view(layers, two, heads, rows, capacity, head_dim).transpose(2, 3)
        super().__init__(layers=[_Layer(self, i) for i in range(layers)])

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor):
        n = keys.shape[2]
        end = self.width + n
        if end > self.capacity:
            raise RuntimeError(f"BatchKV overflow: {end} columns > capacity {self.capacity}")
        k, v = self.view[layer, 0], self.view[layer, 1]
        k[:, :, self.width:end] = keys
        v[:, :, self.width:end] = values
        return k[:, :, :end], v[:, :, :end]

    def advance(self, n: int) -> None:
        self.width += n

    def columns(self, start: int, stop: int) -> torch.Tensor:
        """Entries of columns [start, stop) of every row: [L, 2, H, B * (stop - start), D]."""
        layers, two, heads, _, head_dim = self.buf.shape
        part = self.buf.view(layers, two, heads, self.rows, self.capacity, head_dim)[:, :, :, :, start:stop]
        return part.reshape(layers, two, heads, self.rows * (stop - start), head_dim)

    def flat_index(self, row: int, column: int) -> int:
        return row * self.capacity + column
