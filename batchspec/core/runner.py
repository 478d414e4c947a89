"""The model runner: the one place that turns requests into input ids, masks and positions.

Each round a runner lays a batch out right-aligned to one width. With n_i tokens to cover for
row i, k_i of them already in the KV cache and c tokens fed this round (the same c for every
row), row i starts at column s_i and its position ids are 0..len-1 over its content:

    width w = max k_i,  pad p_i = w - k_i,  columns [0, w + c + extra)

    row 0: k=3, feeds 1    . . P P P | T | D D       P = KV from earlier rounds
    row 1: k=5, feeds 1    P P P P P | T | D D       T = the newest committed token
    row 2: k=0 (new), 1    . . . . . | T | D D       D = extra tokens (drafts)
                           s_0 = 2, s_1 = 0, s_2 = 5; position of column x = x - s_i

When rows feed different numbers of tokens, c is their maximum and a row with fewer re-feeds
its latest committed tokens (their KV is recomputed), so the layout stays rectangular without
holes; a row with fewer than c tokens in all (a short prompt) is left-padded instead.

Realignment — moving each row's KV to its new offset after ragged acceptance — is one
`index_select` from the paged KV store for the whole model. It is skipped when the previous
round's buffer is already aligned (every row advanced by the same amount, as in plain
decoding or when all rows accept the same number of drafts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .batch_cache import BatchKV
from .forward import make_forward
from .kv_store import KVStore
from .request import Request

HEADROOM = 32  # spare columns gathered so that aligned rounds can reuse the buffer


@dataclass
class AlignStats:
    """How often and how much a runner had to realign (for the benchmark's overhead anatomy)."""

    begins: int = 0  # batches laid out
    gathers: int = 0  # ... of which needed a gather from the store (a realignment)
    padded_rows: int = 0  # rows laid out with left padding in a gather
    padding_tokens: int = 0  # padding columns in all laid-out batches
    gathered_tokens: int = 0  # token slots copied by gathers


@dataclass
class BeginInfo:
    """What the last `begin()` cost: a gather, and how many rows it had to pad (realign)."""

    gathered: bool = False
    padded_rows: int = 0  # rows shifted by left padding in a gather; 0 when the buffer was reused
    padding: int = 0  # padding columns in the layout


@dataclass
class _Layout:
    rids: tuple[int, ...]
    width: int  # w: committed KV columns
    tail: int  # c: tokens fed from the requests' content this round (same for all rows)
    kept: list[int]  # k_i: committed KV entries kept per row
    first: list[int]  # s_i = p_i + cp_i: first content column per row
    tail_pad: list[int]  # cp_i: padding inside the tail (rows shorter than c)
    tail_ids: torch.Tensor  # [B, c] left-padded tail tokens
    start: torch.Tensor  # [B] s_i on the device
    fed: int = 0  # columns fed since begin()
    extra_budget: int = 0
    committed: list[int] | None = None  # k_i + keep_i after commit()


def layout_inputs(start: torch.Tensor, first: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention mask [B, first + n] and position ids [B, n] for feeding columns [first, first + n)
    of rows whose content starts at column start[i] and runs to the right edge.

    Example, start = [2, 0], first = 3, n = 2:
        mask      [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
        positions [[1, 2], [3, 4]]
    """
    cols = torch.arange(first + n, device=start.device)
    mask = cols[None, :] >= start[:, None]
    positions = (cols[None, first:] - start[:, None]).clamp(min=0)  # padding columns get 0, masked anyway
    return mask, positions


def kv_shape(model) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a causal LM, found by running it on one token."""
    config = model.config.get_text_config()
    layer_types = getattr(config, "layer_types", None) or []
    unsupported = sorted({t for t in layer_types if t != "full_attention"})
    if unsupported:
        raise ValueError(
            f"{type(model).__name__} has {', '.join(unsupported)} layers; batchspec supports decoder-only "
            "models whose layers all use full attention with a KV cache (Llama, Qwen, GPT-2, Mistral, ...)"
        )
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=model.device), past_key_values=cache,
              use_cache=True)
    shapes = {(tuple(layer.keys.shape), tuple(layer.values.shape)) for layer in cache.layers}
    if not all(type(layer) is DynamicLayer for layer in cache.layers) or len(shapes) != 1:
        raise ValueError(f"{type(model).__name__} uses a KV cache layout batchspec does not support "
                         "(layers of different shapes or non-attention state)")
    (k_shape, v_shape), = shapes
    if k_shape != v_shape:
        raise ValueError(f"{type(model).__name__} has keys and values of different shapes; not supported")
    return len(cache.layers), k_shape[1], k_shape[3]


class ModelRunner:
    """Runs one model (target or draft) over batches of requests, keeping their KV.

    Usage per round: `begin(reqs)`, one or more `feed(...)`, then `commit(keep)`.
    """

    def __init__(self, model, name: str, vocab_size: int, block_size: int = 16, timer=None,
                 debug: bool = False, forward: str = "auto", kv_tokens: int = 4096) -> None:
        self.model, self.name, self.vocab_size = model, name, vocab_size
        self.forward_kind = forward
        self.forward = make_forward(model, forward)
        self.device, self.dtype = model.device, model.dtype
        layers, heads, head_dim = kv_shape(model)
        num_blocks = 1 + -(-kv_tokens // block_size)  # + the null block
        self.store = KVStore(layers, heads, head_dim, model.dtype, self.device, block_size, num_blocks)
        self.kv: BatchKV | None = None
        self.layout: _Layout | None = None
        self.stats = AlignStats()
        self.last_layout = BeginInfo()
        self.timer = timer
        self.debug = debug

    # ----------------------------------------------------------------------------- KV room
    def can_reserve(self, req: Request, num_tokens: int) -> bool:
        return self.store.can_reserve(req.index, num_tokens)

    def reserve(self, req: Request, num_tokens: int) -> None:
        """Give `req` room for `num_tokens` committed tokens (before the forward that fills them)."""
        self.store.reserve(req.index, num_tokens)

    # ----------------------------------------------------------------------------- layout
    def begin(self, reqs: list[Request], leave: int = 0, extra: int = 0, ends: list[int] | None = None) -> int:
        """Lay out `reqs` to feed each one its content[kv_len : len - leave] (or [kv_len : ends[i]])
        plus `extra` more tokens over later `feed` calls. Returns c, the content tokens the first
        feed will carry."""
        if self.model.dtype != self.dtype or self.model.device != self.device:
            raise RuntimeError(f"the {self.name} model was moved to {self.model.device}/{self.model.dtype} after this "
                               f"engine was built on {self.device}/{self.dtype}; build a new engine")
        with self._stage("align"):
            return self._begin(reqs, leave, extra, ends)

    def _begin(self, reqs: list[Request], leave: int, extra: int, ends: list[int] | None) -> int:
        name = self.name
        ends = ends if ends is not None else [r.num_tokens - leave for r in reqs]
        have = [min(r.kv_len.get(name, 0), n) for r, n in zip(reqs, ends)]
        tail = max(n - k for n, k in zip(ends, have))
        kept = [max(0, n - tail) for n in ends]
        width = max(kept)
        rids = tuple(r.index for r in reqs)
        tail_pad = [tail - (n - k) for n, k in zip(ends, kept)]
        first = [width - k + cp for k, cp in zip(kept, tail_pad)]  # = padding columns of each row
        need = width + tail + extra
        self.stats.begins += 1
        self.stats.padding_tokens += sum(first)

        prev = self.layout
        reusable = (
            prev is not None and self.kv is not None and prev.committed is not None
            and prev.rids == rids and need <= self.kv.capacity
            and all(s + k == width for s, k in zip(prev.first, kept))  # old starts + kept align at width
            and all(k <= c for k, c in zip(kept, prev.committed))
        )
        if reusable:
            self.kv.width = width
            self.last_layout = BeginInfo(False, 0, sum(first))
        else:
            capacity = need + HEADROOM
            index = self.store.gather_index(list(rids), kept, width, capacity)
            self.kv = BatchKV(self.store.gather(index), len(reqs), capacity, width)
            self.stats.gathers += 1
            padded = sum(1 for s in first if s > 0)
            self.stats.padded_rows += padded
            self.stats.gathered_tokens += len(reqs) * capacity
            self.last_layout = BeginInfo(True, padded, sum(first))

        tail_rows = [[0] * cp + r.token_ids[k:n] for r, k, n, cp in zip(reqs, kept, ends, tail_pad)]
        self.layout = _Layout(
            rids=rids, width=width, tail=tail, kept=kept, first=first, tail_pad=tail_pad,
            tail_ids=torch.tensor(tail_rows, dtype=torch.long, device=self.device).view(len(reqs), tail),
            start=torch.tensor(first, dtype=torch.long, device=self.device), extra_budget=extra,
        )
        if self.debug:
            self.check_layout()
        return tail

    def feed(self, extra: torch.Tensor | None = None, keep: int = 1) -> torch.Tensor:
        """Run the model on the pending tail (first call) and/or `extra` tokens [B, e].

        Returns logits [B, keep, V] for the last `keep` fed columns, over the real vocabulary.
        """
        lay = self.layout
        with self._stage("align"):
            parts = [lay.tail_ids] if lay.fed == 0 and lay.tail > 0 else []
            if extra is not None:
                parts.append(extra)
            ids = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
            n = ids.shape[1]
            if lay.fed + n > lay.tail + lay.extra_budget:
                raise RuntimeError(f"{self.name}: feeding {n} more columns exceeds the {lay.extra_budget} "
                                   "extra columns announced to begin()")
            mask, positions = layout_inputs(lay.start, lay.width + lay.fed, n)
        logits = self.forward(ids, mask, positions, self.kv, keep, padded=any(lay.first))
        self.kv.advance(n)
        lay.fed += n
        return logits[..., : self.vocab_size]

    def commit(self, reqs: list[Request], keep: list[int]) -> None:
        """Make the first keep[i] real tokens fed to row i since begin() part of its KV.

        Entries fed after them (rejected drafts) are simply not committed."""
        with self._stage("align"):
            lay = self.layout
            src, dst = [], []
            for i, (r, k) in enumerate(zip(reqs, keep)):
                real = lay.fed - lay.tail_pad[i]
                if not 0 <= k <= real:
                    raise ValueError(f"{self.name}: cannot commit {k} tokens for row {i}; {real} were fed")
                kept = lay.kept[i]
                self.store.reserve(r.index, kept + k)
                first_col = lay.width + lay.tail_pad[i]
                src.extend(self.kv.flat_index(i, first_col + j) for j in range(k))
                dst.extend(self.store.slots(r.index, kept, kept + k))
                r.kv_len[self.name] = kept + k
            lay.committed = [kept + k for kept, k in zip(lay.kept, keep)]
            if src:
                values = self.kv.buf.index_select(3, torch.tensor(src, device=self.device))
                self.store.write(torch.tensor(dst, device=self.device), values)

    def release(self, req: Request) -> None:
        self.store.release(req.index, poison=self.debug)
        req.kv_len.pop(self.name, None)

    # ----------------------------------------------------------------------------- checks
    def check_layout(self) -> None:
        """Debug invariant: the working buffer holds each row's committed KV right-aligned at
        `width`, equal to the store's entries, so every row's content ends at the right edge
        (masks and positions then follow from `layout_inputs`)."""
        lay, kv = self.layout, self.kv
        if kv.width != lay.width:
            raise AssertionError(f"{self.name}: buffer width {kv.width} != layout width {lay.width}")
        expect = self.store.gather(self.store.gather_index(list(lay.rids), lay.kept, lay.width, lay.width))
        got = kv.columns(0, lay.width)
        for i, k in enumerate(lay.kept):
            if lay.first[i] - lay.tail_pad[i] != lay.width - k:
                raise AssertionError(f"{self.name}: row {i} is not right-aligned")
            sl = slice(i * lay.width + lay.width - k, (i + 1) * lay.width)
            if not torch.equal(expect[:, :, :, sl], got[:, :, :, sl]):
                raise AssertionError(f"{self.name}: row {i} KV differs from the store after alignment")

    def _stage(self, name: str):
        return self.timer.stage(name) if self.timer is not None else _NULL


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NULL = _Null()
