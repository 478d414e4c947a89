"""The model runner: the one place that turns requests into input ids, masks and positions.

The request record holds the truth: `req.slot` is its row in the model's `RowKV` (see
`core/rows.py`) and `req.kv_len[model]` how many of its tokens that row has committed. A round
feeds each row its own number of tokens, written at its own offset; committing keeps a prefix
of what was fed, so rejecting drafts is only a length change.

A forward runs over the contiguous slot range [lo, hi) that holds the batch; slots in the range
that are not in the batch (free rows, or exspec rows not chosen this round) are fed nothing:
their query columns are computed and ignored, and nothing of theirs is written.

Example, batch rows at slots 0 and 2, slot 1 not in the batch, n = 2 columns fed:

    slot 0: kv_len 3, feeds [a, b]     positions [3, 4]   mask row 0 sees c <= 3 + j
    slot 1: (not in the batch)         fed [0, 0], nothing written, output ignored
    slot 2: kv_len 5, feeds [c]        positions [5, 6]   (column 1 is padding, not written)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..sched.slots import is_tight
from .attention import SLIDING, attention_layout, layer_masks, rope_limit, rope_rows
from .forward import cache_arg, make_forward
from .request import Request
from .rows import RowBatch, RowKV


@dataclass
class LayoutStats:
    """What batches cost in layout work (for the benchmark's overhead anatomy)."""

    forwards: int = 0  # forwards run
    idle_rows: int = 0  # rows in a forward's slot range that were not in its batch
    moved_rows: int = 0  # rows copied to another slot (exspec gathering a spread batch)
    moved_tokens: int = 0  # KV columns copied by those moves
    gathered_rows: int = 0  # rows read through a gathered copy (prefills of rows spread apart)


def kv_shape(model) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a causal LM, found by running it on one token."""
    attention_layout(model)  # refuses layer types it cannot serve
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=model.device), use_cache=True,
              **{cache_arg(model): cache})
    shapes = {(tuple(layer.keys.shape), tuple(layer.values.shape)) for layer in cache.layers}
    if not all(isinstance(layer, DynamicLayer) for layer in cache.layers) or len(shapes) != 1:
        raise ValueError(f"{type(model).__name__} uses a KV cache layout batchspec does not support "
                         "(layers of different shapes or non-attention state)")
    (k_shape, v_shape), = shapes
    if k_shape != v_shape:
        raise ValueError(f"{type(model).__name__} has keys and values of different shapes; not supported")
    return len(cache.layers), k_shape[1], k_shape[3]


def row_inputs(starts: list[int], n: int, width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids [b, n] and attention mask [b, 1, n, width] for rows whose fed columns start at
    starts[i]: query j of row i has position starts[i] + j and sees key columns c <= starts[i] + j.

    Example, starts [3, 5], n = 2, width 6:
        positions [[3, 4], [5, 6]]
        row 0: query 0 sees c <= 3 -> [1, 1, 1, 1, 0, 0];  query 1 -> [1, 1, 1, 1, 1, 0]
        row 1: query 0 sees c <= 5 -> [1, 1, 1, 1, 1, 1];  query 1 (padding) -> all
    """
    start = torch.tensor(starts, dtype=torch.long, device=device)
    positions = start[:, None] + torch.arange(n, device=device)[None, :]
    visible = torch.arange(width, device=device)[None, None, :] <= positions[:, :, None]
    return positions, visible[:, None]


def tree_inputs(positions: torch.Tensor, visible: torch.Tensor, starts: list[int],
                parents: list[list[int] | None], rows: list[int]) -> None:
    """Rewrite `row_inputs`' positions [b, n] and mask [b, 1, n, T] in place for the rows given a
    tree: column j of batch row rows[i] (its first fed column at starts[i]) has position starts[i]
    + depth(j) and sees the committed columns (< starts[i]) and the columns of j and its ancestors.

    Example, start 4, parents [-1, 0, 1, 0] (newest, d_1, d_2, a sibling of d_1):
        positions [4, 5, 6, 5];  column 3 sees c < 4 and c in {4, 7}: [1, 1, 1, 1, 1, 0, 0, 1]
    """
    for start, tree, r in zip(starts, parents, rows):
        if tree is None:
            continue
        depth, sees = [], []
        for j, p in enumerate(tree):
            if not -1 <= p < j:
                raise ValueError(f"parents must name an earlier column (or -1), got {p} for column {j}")
            depth.append(0 if p < 0 else depth[p] + 1)
            sees.append((sees[p] if p >= 0 else []) + [start + j])
        k = len(tree)
        positions[r, :k] = start + torch.tensor(depth, device=positions.device)
        mask = torch.zeros(k, visible.shape[-1], dtype=torch.bool, device=visible.device)
        mask[:, :start] = True
        for j, cols in enumerate(sees):
            mask[j, cols] = True
        visible[r, 0, :k] = mask


def padded_ids(rows: list[list[int]], device) -> torch.Tensor:
    """[b, longest row] ids, each row right-padded with 0 (feed's counts say what is real)."""
    n = max(map(len, rows))
    return torch.tensor([row + [0] * (n - len(row)) for row in rows], dtype=torch.long, device=device)


def content_ids(reqs: list[Request], ends: list[int], counts: list[int], device) -> torch.Tensor:
    """[b, max count] ids: row i holds its tokens [ends[i] - counts[i], ends[i]), right-padded with 0."""
    return padded_ids([r.token_ids[e - c:e] for r, e, c in zip(reqs, ends, counts)], device)


class ModelRunner:
    """Runs one model over rows of its KV buffer. Per round: `feed(...)` one or more times, then
    `commit(...)` to keep a prefix of what was fed."""

    def __init__(self, model, name: str, vocab_size: int, rows: int, capacity: int, timer=None,
                 debug: bool = False, forward: str = "auto") -> None:
        self.model, self.name, self.vocab_size = model, name, vocab_size
        self.attention = attention_layout(model)
        # LongRoPE: rows longer than this are rotated (and recomputed) long, per row (core/attention.py)
        self.rope_limit = rope_limit(model)
        self.long_rows: set[int] = set()  # request ids this model holds in the long regime
        self.forward = make_forward(model, forward)
        self.device, self.dtype = model.device, model.dtype
        # a Parameter object survives `model.to(...)` (only its data changes): a cheap way to see a move
        self._probe = next(model.parameters())
        layers, heads, head_dim = kv_shape(model)
        self.kv = RowKV(layers, heads, head_dim, rows, capacity, model.dtype, self.device)
        self.fed: dict[int, int] = {}  # request id -> tokens fed since its last commit
        self.stats = LayoutStats()
        self.timer = timer
        self.debug = debug

    # ----------------------------------------------------------------------------- rounds
    def feed(self, reqs: list[Request], ids: torch.Tensor, counts: list[int], logits: str | list[int] = "all",
             hidden: tuple[int, ...] | None = None, parents: list[list[int] | None] | None = None):
        """Feed row i the tokens ids[i, :counts[i]] ([b, n], the rest padding) after what it holds.

        `reqs` are ordered by slot. Returns logits over the real vocabulary: "all" -> [b, n, V],
        "last" -> [b, V] at each row's last real column, a list `tail` -> [b, max(tail), V], row i's
        last tail[i] fed columns left-aligned (a round that also prefills prompts: the head runs on
        the columns verified, not on the prompts), "none" -> None.

        Example, counts [4, 2], tail [2, 1]: row 0's columns 2, 3; row 1's column 1 (and any
        column after it: padding the caller ignores).

        `hidden` (EAGLE heads, `Drafter.features`): hidden-state indices, HF's numbering (i < L: the
        input of decoder layer i; L: the final normed state). Then feed returns (logits as above,
        features [b, n, len(hidden) * H]): row i's states at its fed columns 0..counts[i]-1 (the
        ids' own layout; the rest padding), the indices' states side by side in the order given.
        Computed only when asked: a plain feed runs exactly as before.

        `parents` (a tree: siblings, `decode/siblings.py`): per row None (its columns a chain) or
        the parent of each fed column (-1: the row's committed tokens); a column's position is its
        depth and it sees the committed columns and its ancestors' (`tree_inputs`).
        """
        if self._probe.dtype != self.dtype or self._probe.device != self.device:
            raise RuntimeError(f"the {self.name} model was moved to {self._probe.device}/{self._probe.dtype} after "
                               f"this engine was built on {self.device}/{self.dtype}; build a new engine")
        name = self.name
        with self._stage("align"):
            slots = [r.slot for r in reqs]
            starts = [r.kv_len.get(name, 0) + self.fed.get(r.index, 0) for r in reqs]
            n = ids.shape[1]
            index, tight = None, is_tight(slots)
            if tight and slots != sorted(slots):
                raise ValueError("feed() takes the batch in slot order")
            if tight and slots[-1] - slots[0] + 1 != len(slots):  # idle rows inside the range
                lo, hi = slots[0], slots[-1] + 1
                full_starts, full_counts = [0] * (hi - lo), [0] * (hi - lo)
                for s, st, c in zip(slots, starts, counts):
                    full_starts[s - lo], full_counts[s - lo] = st, c
                index = torch.tensor([s - lo for s in slots], device=self.device)
                full_ids = torch.zeros(hi - lo, n, dtype=torch.long, device=self.device)
                full_ids[index] = ids
                row_slots = list(range(lo, hi))
                self.stats.idle_rows += hi - lo - len(reqs)
            else:  # a contiguous run, or rows spread too far apart: gathered (only prefills get here)
                full_starts, full_counts, full_ids, row_slots = starts, counts, ids, slots
                self.stats.gathered_rows += 0 if tight else len(slots)
            batch = RowBatch(self.kv, row_slots, full_starts, full_counts)
            self.kv.make_clean(slots, batch.width)
            positions, visible = row_inputs(full_starts, n, batch.width, self.device)
            if parents is not None and any(p is not None for p in parents):
                where = [s - slots[0] for s in slots] if index is not None else list(range(len(reqs)))
                tree_inputs(positions, visible, [full_starts[w] for w in where], parents, where)
                batch.trees = frozenset(w for w, p in zip(where, parents) if p is not None)
            if n == 1 and index is None and len(set(starts)) == 1 and SLIDING not in self.attention.kinds:
                visible = None  # one token per row, all rows the same length: every key is visible
            else:
                visible = layer_masks(visible, positions, self.attention)
            select = None
            if logits == "last":
                select = torch.tensor([c - 1 for c in full_counts], device=self.device).clamp(min=0)
            elif not isinstance(logits, str):
                select = self._tail_columns(slots, row_slots, full_counts, logits, n)
        rows_long = None
        if self.rope_limit is not None:
            by_slot = {r.slot: r.index in self.long_rows for r in reqs}
            rows_long = [by_slot.get(s, False) for s in row_slots]
        with rope_rows(self.model, rows_long):
            args = (full_ids, positions, batch, visible)
            select = False if logits == "none" else select
            out = self.forward(*args, select=select) if hidden is None else \
                self.forward(*args, select=select, hidden=tuple(hidden))
        self.stats.forwards += 1
        for r, c in zip(reqs, counts):
            self.fed[r.index] = self.fed.get(r.index, 0) + c
        if hidden is not None:
            out, states = out
            states = states if index is None else states[index]
            return (self._logits(out, index), states)
        return self._logits(out, index)

    def _logits(self, out: torch.Tensor | None, index: torch.Tensor | None) -> torch.Tensor | None:
        if out is None:
            return None
        out = out[..., : self.vocab_size]
        return out if index is None else out[index]

    def _tail_columns(self, slots: list[int], row_slots: list[int], full_counts: list[int], tail: list[int],
                      n: int) -> torch.Tensor:
        """[rows of the pass, max(tail)] columns: row i's last tail[i] fed ones, then repeats of its
        last (rows of the range not in the batch: column 0)."""
        by_slot = dict(zip(slots, tail))
        k = max(tail)
        cols = []
        for s, c in zip(row_slots, full_counts):
            t = by_slot.get(s, 0)
            cols.append([min(c - t + j, c - 1) if t else 0 for j in range(k)])
        return torch.tensor(cols, dtype=torch.long, device=self.device).clamp_(0, n - 1)

    def commit(self, reqs: list[Request], keep: list[int]) -> None:
        """Keep the first keep[i] tokens fed to row i since its last commit; the rest (rejected
        drafts) stay beyond its length, masked until overwritten."""
        name = self.name
        for r, k in zip(reqs, keep):
            fed = self.fed.pop(r.index, 0)
            if not 0 <= k <= fed:
                raise ValueError(f"{name}: cannot commit {k} tokens for request {r.index}; {fed} were fed")
            r.kv_len[name] = r.kv_len.get(name, 0) + k
            if self.debug and r.kv_len[name] > self.kv.clean[r.slot]:
                raise AssertionError(f"{name}: request {r.index} committed past the written columns")

    def move_columns(self, reqs: list[Request], moves: list[tuple[int, int]]) -> None:
        """Before `commit`: copy column src of what was fed to row i since its last commit to
        column dst (a sibling taken in a rejected draft's place, `decode/siblings.py`)."""
        with self._stage("align"):
            for r, (src, dst) in zip(reqs, moves):
                fed, start = self.fed.get(r.index, 0), r.kv_len.get(self.name, 0)
                if not 0 <= dst < src < fed:
                    raise ValueError(f"{self.name}: cannot move fed column {src} to {dst} for request {r.index}")
                self.kv.data[:, :, r.slot, :, start + dst] = self.kv.data[:, :, r.slot, :, start + src]

    def move(self, pairs: list[tuple[int, int]], lengths: list[int]) -> None:
        """Copy rows between slots (see `sched.slots.arrange`); lengths are the rows' KV lengths."""
        with self._stage("align"):
            self.kv.move(pairs, lengths)
        self.stats.moved_rows += len(pairs)
        self.stats.moved_tokens += sum(lengths)

    def release(self, req: Request) -> None:
        self.fed.pop(req.index, None)
        self.long_rows.discard(req.index)
        req.kv_len.pop(self.name, None)

    def enter_long_rope(self, req: Request) -> bool:
        """LongRoPE: once `req` is longer than the limit its whole KV belongs to the long regime.
        Returns True when that drops what this model held of it (to be recomputed, as transformers'
        generate does at that step)."""
        if self.rope_limit is None or req.num_tokens <= self.rope_limit or req.index in self.long_rows:
            return False
        self.long_rows.add(req.index)
        dropped = req.kv_len.get(self.name, 0) > 0
        req.kv_len[self.name] = 0
        return dropped

    def _stage(self, name: str):
        return self.timer.stage(name) if self.timer is not None else _NULL


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NULL = _Null()
