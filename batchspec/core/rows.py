"""The KV layout: one persistent buffer per model in which every resident request owns a row.

    data [L, 2, R, H, C, D]    layers, key/value, row slots, KV heads, columns, head dim

A request's committed KV sits left-aligned in its row: token p at column p, for p < kv_len.
A forward pass writes each row's new tokens at that row's own offset (column kv_len onwards,
whatever the other rows' lengths) and attends with a mask built from per-row lengths; position
ids are per row. So:

* committed KV is written once, where it stays, and is never copied while the row is resident;
* rejecting drafts lowers the row's length: the stale columns beyond it are masked, then
  overwritten by the next round;
* a request that joins takes a free row and one that leaves frees its row; no other row is
  touched. (exspec picks a subset of the resident rows each round: rows are moved only when the
  chosen ones are spread too far apart, and only rows whose batch membership changed; see
  `sched.slots.arrange`.)

Why this and not block tables: attention on a CPU has no paged kernel, so reading KV through a
block table means gathering every row's whole context for every layer of every forward (what
the previous layout did, once per ragged round, at 14-16 % of the time at batch 32). A left-
aligned row is what `scaled_dot_product_attention` reads directly. The cost is memory: a row is
reserved at full capacity C, so the buffer holds R x C tokens per model (the `--max-kv-tokens`
budget, allocated once); only columns a forward has reached are ever touched (see `clean`).

Worked example, rows of lengths 3 and 5 feeding 2 and 1 real tokens (n = 2 columns):

    row 0: k k k N N . .      N = written this forward at columns 3, 4; positions [3, 4]
    row 1: k k k k k N .      N at column 5; its second query column is padding (not written)
    key width T = max(3 + 2, 5 + 1) = 6; query j of row i sees columns c <= len_i + j
"""

from __future__ import annotations

import functools
import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

# A forward computes only the real tokens (packed, see core/forward.py) when they are at most this
# share of the [b, n] input: rows fed different numbers of tokens (per-row draft lengths, prefill
# chunks of unequal prompts) or idle rows in the slot range. Packing costs a gather and a scatter
# per layer, so a nearly full input is run as it is.
PACK_SHARE = 0.85


class RowKV:
    """The buffer of one model and which columns of each row hold finite values."""

    def __init__(self, layers: int, heads: int, head_dim: int, rows: int, capacity: int, dtype, device) -> None:
        self.rows, self.capacity = rows, capacity
        self.data = torch.empty(layers, 2, rows, heads, capacity, head_dim, dtype=dtype, device=device)
        # Attention reads masked columns too, and 0 x NaN is NaN: columns [0, clean[r]) of row r have
        # been written or zeroed. Zeroing on demand keeps untouched memory untouched (on a CPU the OS
        # maps pages only when written), so memory follows the lengths reached, not the capacity.
        self.clean = [0] * rows

    def make_clean(self, rows: list[int], width: int) -> None:
        for r in rows:
            if self.clean[r] < width:
                self.data[:, :, r, :, self.clean[r]:width] = 0
                self.clean[r] = width

    def move(self, pairs: list[tuple[int, int]], lengths: list[int]) -> None:
        """Copy the first lengths[k] columns of row src to row dst for each (src, dst) at once."""
        if not pairs:
            return
        width = max(lengths)
        src = torch.tensor([s for s, _ in pairs], device=self.data.device)
        dst = torch.tensor([d for _, d in pairs], device=self.data.device)
        self.data[:, :, dst, :, :width] = self.data[:, :, src, :, :width]  # read fully before written
        old = list(self.clean)
        for s, d in pairs:
            copied = min(old[s], width)  # columns of dst now holding finite values from src
            self.clean[d] = max(copied, old[d]) if copied == width else copied



class _Layer(CacheLayerMixin):
    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner: RowBatch, index: int) -> None:
        super().__init__()
        self._owner, self.index = weakref.ref(owner), index  # no cycle: a RowBatch is freed at once
        self.is_initialized = True

    @property
    def owner(self) -> RowBatch:
        return self._owner()

    def lazy_initialization(self, key_states, value_states) -> None:  # preallocated
        return None

    def update(self, key_states, value_states, *args, **kwargs):
        return self.owner.write(self.index, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.width, 0

    def get_seq_length(self) -> int:
        return self.owner.width - self.owner.n

    def get_max_length(self) -> int:
        return -1


class RowBatch(Cache):
    """One forward's view of some rows of a `RowKV`, behind transformers' `Cache` interface.

    slots [b]      the rows, in batch order: a contiguous run of slots is read in place (rows of
                   the run that are not in the batch come with count 0); any other set of slots
                   is gathered into a copy for attention (prefills of newly admitted rows only)
    starts [b]     each row's first written column (its committed length plus what it was fed)
    counts [b]     real tokens fed per row
    n              columns fed (max of counts); T = width = max(starts + counts), the key width
    Only real tokens are written, into the buffer itself; padding query columns are ignored.
    """

    def __init__(self, kv: RowKV, slots: list[int], starts: list[int], counts: list[int]) -> None:
        self.kv = kv
        self.n = max(counts)
        self.width = max(s + c for s, c in zip(starts, counts))
        if self.width > kv.capacity:
            raise RuntimeError(f"row overflow: {self.width} columns > capacity {kv.capacity}")
        device = kv.data.device
        self.lo = slots[0]
        self.contiguous = slots == list(range(slots[0], slots[0] + len(slots)))
        rows = [i for i, c in enumerate(counts) for _ in range(c)]
        self.rows = torch.tensor(rows, dtype=torch.long, device=device)  # [real tokens]: batch row of each
        self.slots = torch.tensor(slots, dtype=torch.long, device=device)
        self.write_slots = self.slots[self.rows] if not self.contiguous else self.rows + self.lo
        self.cols = torch.tensor([s + j for s, c in zip(starts, counts) for j in range(c)], dtype=torch.long,
                                 device=device)
        self.feed_cols = torch.tensor([j for c in counts for j in range(c)], dtype=torch.long, device=device)
        self.uniform = self.contiguous and len(set(starts)) == 1 and len(set(counts)) == 1
        # `real` when padding is a large enough share that computing only real tokens pays
        self.packed = self.real if sum(counts) <= PACK_SHARE * len(counts) * self.n else None
        self.start0, self.hi = starts[0], slots[0] + len(slots)
        self.row_spans = (slots, starts, counts)  # for `read_row`
        self.trees: frozenset[int] = frozenset()  # rows fed a tree (`ModelRunner.feed(..., parents=)`): not causal
        super().__init__(layers=[_Layer(self, i) for i in range(kv.data.shape[0])])

    @functools.cached_property
    def real(self) -> torch.Tensor:
        """[real tokens] flat index (row * n + column) of each real token in the [b, n] input, made
        when a pass first asks (`packed`, or a verify pass attending row by row)."""
        return self.rows * self.n + self.feed_cols

    def write_packed(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys, values [real tokens, H, D] in `packed` order -> written at their rows' columns."""
        self.kv.data[layer, 0][self.write_slots, :, self.cols] = keys
        self.kv.data[layer, 1][self.write_slots, :, self.cols] = values

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys, values [b, H, T, D] (after `write_packed`)."""
        k_all, v_all = self.kv.data[layer, 0], self.kv.data[layer, 1]
        if self.contiguous:
            return k_all[self.lo:self.hi, :, : self.width], v_all[self.lo:self.hi, :, : self.width]
        return k_all[self.slots, :, : self.width], v_all[self.slots, :, : self.width]

    def read_row(self, layer: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch row i's keys, values [1, H, start + count, D] (after `write_packed`): views of the
        buffer as wide as the row itself, not the batch."""
        slots, starts, counts = self.row_spans
        slot, width = slots[i], starts[i] + counts[i]
        return (self.kv.data[layer, 0, slot:slot + 1, :, :width],
                self.kv.data[layer, 1, slot:slot + 1, :, :width])

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor):
        """keys, values [b, H, n, D] -> the layer's keys, values [b, H, T, D] after writing."""
        k_all, v_all = self.kv.data[layer, 0], self.kv.data[layer, 1]  # [R, H, C, D]
        if self.uniform:  # every row writes the same columns: one slice
            k_all[self.lo:self.hi, :, self.start0:self.start0 + self.n] = keys
            v_all[self.lo:self.hi, :, self.start0:self.start0 + self.n] = values
        elif self.rows.numel():
            k_all[self.write_slots, :, self.cols] = keys[self.rows, :, self.feed_cols]
            v_all[self.write_slots, :, self.cols] = values[self.rows, :, self.feed_cols]
        return self.read(layer)  # (gathered copies when the slots are not contiguous)
