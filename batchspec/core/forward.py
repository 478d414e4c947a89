"""One forward pass of a causal LM over a `BatchKV`: logits for the last `keep` fed columns.

Two implementations behind one call signature, `forward(ids, mask, positions, kv, keep)`:

* `HFForward` calls the model's own `forward` (any architecture transformers can load);
* `LeanForward` runs Llama-family decoders (Llama, Mistral without a sliding window, Qwen2,
  Qwen3) straight from the model's own weight tensors: the same arithmetic, without
  transformers' per-call machinery (mask factories, output recorders, kwargs plumbing, rotary
  recomputation), with q/k/v and gate/up each computed as one matrix product and q, k rotated
  together. At
  batch size 1 that machinery is most of a small model's step on a CPU. The weights are the
  model's, not copies (the fused matrices are shared with the modules, whose weights become views
  into them), except where the kernel plan runs some token count through oneDNN: that kernel
  reads a second copy of every matrix, laid out for it (`core/kernels.py`), so the linears'
  memory is doubled; `tests/test_forward.py` checks both paths give the same logits and greedy tokens.
  Moving the model afterwards (`model.to(dtype or device)`) gives the modules new weight tensors;
  every call checks that the modules' weights are still views into the fused matrices (one data
  pointer per fused linear) and re-fuses when they are not.

Inputs (as `core.runner.ModelRunner.feed` builds them), for b rows fed n columns each:
    ids        [b, n]             tokens fed this call (padding columns hold any id)
    positions  [b, n]             position ids, per row
    kv         core.rows.RowBatch the rows' KV: writes each row's real tokens at its own offset
    visible    [b, 1, n, T] bool  which key columns each query sees (None: all of them)
    select     None: logits for every fed column [b, n, V]; a LongTensor [b]: one column per row
               [b, V]; a LongTensor [b, k]: k columns per row [b, k, V] (a round whose rows include
               prompts: each row's last columns); False: no logits (prefill)
    hidden     None (plain rounds: nothing else is computed or kept), or a tuple of hidden-state
               indices in HF's `output_hidden_states` numbering (i < L: the input of decoder layer
               i, 0 the embeddings; L: the last layer's output after the final norm): the call then
               returns (logits, features [b, n, len(hidden) * H]), the states side by side in the
               order given, at every fed column (padding columns: garbage), whatever `select` says.
               EAGLE-1 heads read (L,), EAGLE-3 heads (2, L // 2, L - 3) (batchspec/eagle/head.py).
"""

from __future__ import annotations

import inspect
import weakref
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .kernels import kernel_plan, packed_kernel
from .linear import VIEW_ROWS, FusedLinear, Linear, RMSNorm
from .rope import RopeTable, rotate

LEAN_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# Attention kernels allowed on CUDA: all but cuDNN's, which (by torch.profiler: docs/gpu.md) costs
# ~1 ms of CPU per call on shapes it has not met, a plan built per shape (H200, torch 2.11, bf16).
# Speculative rounds feed a new (rows, tokens, keys) shape nearly every round: at batch 32 the
# adaptive default spent 65 % of its time there and ran at 0.39x plain decoding (1421 tokens/s
# against 3642).
CUDA_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
STATIC_ROPE = ("default", "linear", "llama3")  # inverse frequencies that do not depend on length


def cache_arg(model) -> str:
    """The name the model's forward takes its KV cache by: `cache` in recent transformers 5.x,
    `past_key_values` before (which later versions still take, with a deprecation warning)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class HFForward:
    """The model's own forward (transformers modules)."""

    # the modules compute logits for every fed column (or the last k): a pass that carries prompts
    # would compute them for every prompt token ([b, n, V]), so prompts are prefilled apart
    selects_before_head = False

    def __init__(self, model) -> None:
        self.model = model
        self.cache_arg = cache_arg(model)

    def __call__(self, ids, positions, kv, visible, select=None, hidden=None):
        # transformers takes a prepared 4-D mask as it is; an additive float mask suits eager and sdpa alike
        dtype = self.model.dtype
        if visible is None:
            visible = torch.ones(ids.shape[0], 1, ids.shape[1], kv.width, dtype=torch.bool, device=ids.device)

        def additive(v: torch.Tensor) -> torch.Tensor:
            return torch.zeros(v.shape, dtype=dtype, device=ids.device).masked_fill_(~v, torch.finfo(dtype).min)

        # one mask per layer type ({"full_attention": ..., "sliding_attention": ...}) or one for all
        mask = {k: additive(v) for k, v in visible.items()} if isinstance(visible, dict) else additive(visible)
        with torch.no_grad(), attention_kernels(ids.device):
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                             use_cache=True, **{self.cache_arg: kv}, logits_to_keep=1 if select is False else 0,
                             output_hidden_states=hidden is not None)
        if hidden is None:
            return _select(out.logits, select)
        states = out.hidden_states  # L + 1: the input of each layer, then the final normed state
        _check_layers(hidden, len(states) - 1)
        return _select(out.logits, select), torch.cat([states[i] for i in hidden], dim=-1)


def _check_layers(hidden: tuple[int, ...], layers: int) -> None:
    if not hidden or any(not 0 <= i <= layers for i in hidden):
        raise ValueError(f"hidden-state indices must be within 0..{layers} (the model has {layers} layers), "
                         f"got {tuple(hidden)}")


def attention_kernels(device: torch.device):
    """The SDPA kernels a forward pass may use on `device` (`CUDA_ATTENTION` on CUDA; all on a CPU)."""
    return sdpa_kernel(CUDA_ATTENTION) if device.type == "cuda" else nullcontext()


def lean_unsupported(model) -> str | None:
    """Why `LeanForward` cannot run `model` (None when it can)."""
    config = model.config
    if config.model_type not in LEAN_TYPES:
        return f"model type {config.model_type!r} is not one of {', '.join(LEAN_TYPES)}"
    if config.model_type == "mistral" and getattr(config, "sliding_window", None) is not None:
        return "Mistral with a sliding window"
    if getattr(config, "sliding_window", None) is not None or any(t != "full_attention" for t in
                                                                   getattr(config, "layer_types", None) or []):
        return "sliding-window attention layers"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    rope = getattr(model.model.rotary_emb, "rope_type", "default")
    if rope not in STATIC_ROPE:
        return f"RoPE type {rope!r}"
    if any(getattr(layer.mlp, "gate_proj", None) is None for layer in model.model.layers):
        return "a decoder layer without a gated MLP"
    projections = [m for layer in model.model.layers for m in (layer.self_attn, layer.mlp) for m in m.children()]
    if any(isinstance(m, torch.nn.Linear) and type(m) is not torch.nn.Linear for m in projections):
        return "projections that are not plain torch Linear layers (quantised or wrapped)"
    return None


FOLD_TOKENS = 32  # at most this many query tokens per row: `LeanForward._attend` folds GQA heads
# A packed pass feeding more columns than this attends row by row (prefill), on a CPU only: on a GPU
# the rows' kernel launches cost more than the padded layout's wasted query-key pairs (an H100, 64
# bundled prompts x 32 new tokens at 64 rows: by row, 1264 attention calls took 0.44 s of a 1.16 s
# run, docs/gpu.md).
ROW_ATTENTION_TOKENS = 32
# A verify pass (fewer columns, packed or not) attends row by row on a CPU where the padded layout
# would compute more than this many query-key pairs a row that the rows' own widths do not need: a
# call per row costs ~45 us, a (query, key) pair ~0.02 us (see `attends_by_row`).
ROW_WASTE_PAIRS = 2250
# In a pass attending row by row, the rows fed one token after their KV attend in one padded call
# over the batch's keys where its wasted query-key pairs (the other rows' whole width, each of
# these rows' padding) are fewer than this many per call it saves (`_row_masks`). On the EPYC a
# 30-token prompt joining 16 decoding rows: 51 -> 41 ms a round (32 rows: 77 -> 64); 32 rows with
# 28 of them verifying 2 tokens, grouped, the 4 others' call cost 127 ms a pass against 99 by row.
GROUP_WASTE_PAIRS = 560
LEAN_REVISION = 3  # raised when the lean forward's costs change: step-cost profiles cached before are stale


class LeanForward:
    """A Llama-family decoder run directly on its weights (see the module docstring)."""

    selects_before_head = True  # `select` picks the columns before the LM head runs

    def __init__(self, model) -> None:
        reason = lean_unsupported(model)
        if reason is not None:
            raise ValueError(f"the lean forward does not support this model: {reason}")
        # No reference to `model` itself: make_forward caches by weak key.
        self.body, self.head = model.model, model.lm_head
        self._build()

    def _build(self) -> None:
        """Fuse the projections and take the weights from the modules as they are now. Embeddings
        and norms are held as their Parameter objects and the head and o/down projections as
        modules, which follow `model.to(...)` by themselves (it replaces `.data`); the fused
        matrices are copies, so they and the rope tables built in the old dtype are rebuilt."""
        body = self.body
        self.layers = []  # drop the old fused matrices (perhaps on the old device) before making new ones
        self.embed = body.embed_tokens.weight
        self.norm = RMSNorm(body.norm)
        for layer in body.layers:
            attn = layer.self_attn
            q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            self.layers.append((
                RMSNorm(layer.input_layernorm), FusedLinear(attn.q_proj, attn.k_proj, attn.v_proj), Linear(attn.o_proj),
                RMSNorm(q_norm) if q_norm is not None else None, RMSNorm(k_norm) if k_norm is not None else None,
                RMSNorm(layer.post_attention_layernorm), FusedLinear(layer.mlp.gate_proj, layer.mlp.up_proj),
                Linear(layer.mlp.down_proj),
            ))
        first = body.layers[0].self_attn
        self.head_dim, self.scaling = first.head_dim, first.scaling
        self.heads = [size // self.head_dim for size in self.layers[0][1].sizes]  # q, k, v heads
        self.rotary = body.rotary_emb
        self.angles = RopeTable(self.rotary)  # cos, sin over positions 0..P-1, grown on demand
        fused = [f for layer in self.layers for f in (layer[1], layer[6])]
        self.lm_head = Linear(self.head)
        linears = [m for layer in self.layers for m in (layer[1], layer[2], layer[6], layer[7])] + [self.lm_head]
        weights = [m.weight for m in linears]
        nbytes = sum(w.numel() * w.element_size() for w in weights)
        self.plan = kernel_plan(weights, packed=packed_kernel(nbytes))  # which kernel over how many rows, per CPU
        for m in linears:
            m.pack(self.plan)
        watch = [entry for f in fused for entry in f.watch]
        if self.plan.dnn:  # (the other linears' packed copies go stale with their weights too)
            watch += [(m.module._parameters, m.weight.data_ptr()) for m in linears if isinstance(m, Linear)]
        self._params, self._ptrs = [params for params, _ in watch], [ptr for _, ptr in watch]

    def stale(self) -> bool:
        """Whether some fused linear's weight is no longer its view into the fused matrix (or some
        other linear's weight no longer the one its packed copy was made from), as after
        `model.to(another dtype or device)` (which gives every parameter new data) or a reassigned
        weight. A data pointer comparison per linear suffices: the fused matrix keeps its memory
        alive, so no other tensor, of any dtype, can start at that address. Cheap (no device sync)."""
        return [params["weight"].data_ptr() for params in self._params] != self._ptrs

    def refresh(self) -> LeanForward:
        """Re-fuse if the model's weights were replaced since the last fusing; returns self."""
        if self.stale():
            self._build()
        return self

    def _rope(self, positions: torch.Tensor, need: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, n, 1, head_dim] (broadcast over heads) for `positions` [B, n], all below
        `need` (known from the layout, so the device is not asked); from the model's own rotary."""
        cos, sin = self.angles(positions, need, dtype)
        return cos[:, :, None], sin[:, :, None]

    def __call__(self, ids, positions, kv, visible, select=None, hidden=None):
        if self.stale():
            self._build()
        grab = None
        if hidden is not None:
            _check_layers(hidden, len(self.layers))
            grab = dict.fromkeys(hidden)  # index -> its state: [B, n, H] (padded) or [C, H] (packed)
        with torch.no_grad(), attention_kernels(ids.device):
            out = self._forward(ids, positions, kv, visible, select, grab)
            if grab is None:
                return out
            return out, self._features(grab, hidden, ids.shape, getattr(kv, "packed", None))

    def _features(self, grab: dict, hidden: tuple[int, ...], shape, packed) -> torch.Tensor:
        """The grabbed states side by side [B, n, len(hidden) * H] (packed ones scattered back)."""
        x = torch.cat([grab[i] for i in hidden], dim=-1)
        if packed is None:
            return x
        out = x.new_zeros(shape[0] * shape[1], x.shape[-1])
        out[packed] = x
        return out.view(shape[0], shape[1], -1)

    def _forward(self, ids, positions, kv, visible, select, grab=None) -> torch.Tensor | None:
        packed = getattr(kv, "packed", None)
        if packed is not None:
            return self._forward_packed(ids, positions, kv, visible, select, packed, grab)
        batch, n = ids.shape
        x = F.embedding(ids, self.embed)  # [B, n, hidden]
        cos, sin = self._rope(positions, kv.width + n, x.dtype)  # positions < T + n (padding columns included)
        folded = self._fold_mask(visible, n)
        fresh, tree = _fresh(kv), bool(getattr(kv, "trees", None))
        # a verify pass over rows of unequal width: row by row (a prompt chunk here stays padded, `fresh`)
        real = kv.real if n <= ROW_ATTENTION_TOKENS and attends_by_row(n, kv, ids.device) else None  # [C] into [B, n]
        masks = self._row_masks(kv, visible) if real is not None else None
        copy_act = batch * n < VIEW_ROWS  # (see `matmul`)
        for index, (ln1, qkv, o_proj, q_norm, k_norm, ln2, gate_up, down) in enumerate(self.layers):
            if grab is not None and index in grab:  # (EAGLE features: the inputs of the layers asked for)
                grab[index] = x
            q, k, v = self._qkv(qkv(ln1(x)), q_norm, k_norm, cos, sin)  # [B, n, heads, head_dim] each
            if real is None:
                q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, n, head_dim]
                keys, values = kv.write(index, k, v)  # [B, kv_heads, T, head_dim]
                a = self._attend(q, keys, values, visible, folded, fresh, tree).transpose(1, 2)  # [B, n, heads, D]
            else:  # the real tokens only, in packed order: written, then attended row by row (no read)
                q, k, v = (t.reshape(batch * n, -1, self.head_dim)[real] for t in (q, k, v))  # [C, heads, D]
                kv.write_packed(index, k, v)
                a = q.new_zeros(batch * n, q.shape[1], self.head_dim)
                a[real] = self._attend_by_row(q, kv, index, masks)
            x = x + o_proj(a.reshape(batch, n, -1), contiguous=False)
            gate, up = gate_up(ln2(x), contiguous=copy_act).chunk(2, dim=-1)
            x = x + down(F.silu(gate) * up, contiguous=False)
        if grab is not None and len(self.layers) in grab:
            grab[len(self.layers)] = self.norm(x)
        if select is False:
            return None
        if select is not None and select.dim() == 2:  # [B, k] columns -> [B, k, hidden]
            return self.lm_head(self.norm(x[torch.arange(batch, device=x.device)[:, None], select]))
        if select is not None:
            x = x[torch.arange(batch, device=x.device), select][:, None]  # [B, 1, hidden]
        return _select(self.lm_head(self.norm(x)), None if select is None else 0)

    def _fold_mask(self, visible: torch.Tensor | None, n: int) -> torch.Tensor | None:
        """The mask of `_attend`'s folded queries, built once per forward: [B, 1, n, T] ->
        [B, 1, g * n, T], repeated for each of the g query heads that share a KV head (None when
        `_attend` does not fold)."""
        group = self.heads[0] // self.heads[1]
        if visible is None or group == 1 or n > FOLD_TOKENS:
            return visible
        return fold_mask(visible, group)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible, folded,
                fresh: bool = False, tree: bool = False) -> torch.Tensor:
        """Attention of q [B, Hq, n, D] over keys, values [B, Hk, T, D] -> [B, Hq, n, D].

        With grouped KV heads (Hq = g * Hk) the g query heads of each KV head are folded into its
        query rows, q -> [B, Hk, g * n, D] (heads h = i * g + j, as transformers' repeat_kv pairs
        them), so one attention over the KV as it is replaces `enable_gqa`, which repeats K and V
        g times on a CPU: 12-25 % less time at 8 rows of 5 tokens over 400 keys. Only for a few
        query tokens per row (decoding, verifying): from ~64 on (prefill) `enable_gqa` is as fast or
        faster. Example, Hq 6, Hk 2, n 5: query heads 0-2 read KV head 0 as rows 0-14, heads 3-5
        KV head 1.

        `fresh`: every row is fed from column 0 (prompts), so each row's mask is the causal one
        (a row shorter than n: its padding queries see its padding keys either way, and no real
        query sees them), which SDPA runs unmasked 25-45 % faster (2 prompts of 700 tokens of the
        bundled target: 16.8 -> 12.5 ms; one: 9.0 -> 5.0)."""
        b, hq, n, d = q.shape
        hk = keys.shape[1]
        if hq == hk or n > FOLD_TOKENS:
            causal = (fresh or (b == 1 and not tree)) and keys.shape[2] == n and visible is not None
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=None if causal else visible,
                                                  is_causal=causal, scale=self.scaling, enable_gqa=hq != hk)
        out = F.scaled_dot_product_attention(q.reshape(b, hk, hq // hk * n, d), keys, values, attn_mask=folded,
                                             scale=self.scaling)
        # a view on a CPU; CUDA's memory-efficient kernel (float32) returns [B, g * n, Hk, D] in
        # memory, transposed, whose heads cannot be unfolded without a copy
        return out.reshape(b, hq, n, d)

    def _row_masks(self, kv, visible) -> tuple[list, tuple | None]:
        """For `_attend_by_row`, built once for every layer: per row, None where it is fed from
        column 0 (causal over itself), else its mask rows over its own keys [1, 1, count, start +
        count], its grouped query heads folded into them ([1, 1, g * count, start + count], as
        `_fold_mask`) for a few tokens (a verify pass's row); and the rows fed one token after
        their KV, attended together where one padded call for them pays (`GROUP_WASTE_PAIRS`):
        (their batch rows [s], their places among the packed tokens [s], the batch's column-0 mask
        [B, 1, 1, T] and as `_fold_mask` folds it, the set of those rows), or None."""
        _, starts, counts = kv.row_spans
        trees = getattr(kv, "trees", frozenset())  # (rows fed a tree from column 0: not causal)
        g = self.heads[0] // self.heads[1]
        out, singles, at = [], [], 0
        for i, (start, count) in enumerate(zip(starts, counts)):
            width = start + count
            mask = None if (start == 0 and i not in trees) or count == 0 else visible[i:i + 1, :, :count, :width]
            if mask is not None and g > 1 and count <= FOLD_TOKENS:
                mask = mask.expand(1, g, count, width).reshape(1, 1, g * count, width)
            out.append(mask)
            if count == 1 and start > 0:
                singles.append((i, at))
            at += count
        # the call's query-key pairs no row needs: every other row's whole width, these rows' padding
        wasted = max(s + c for s, c in zip(starts, counts)) * len(starts) - sum(starts[i] + 1 for i, _ in singles)
        if wasted >= (len(singles) - 1) * GROUP_WASTE_PAIRS or visible is None or not getattr(kv, "contiguous", False):
            return out, None
        device = visible.device
        rows = torch.tensor([i for i, _ in singles], device=device)
        where = torch.tensor([a for _, a in singles], device=device)
        column = visible[:, :, :1]  # [B, 1, 1, T]
        return out, (rows, where, column, self._fold_mask(column, 1), {i for i, _ in singles})

    def _attend_by_row(self, q: torch.Tensor, kv, index: int, masks: tuple[list, tuple | None]) -> torch.Tensor:
        """Attention of the packed queries q [C, Hq, D] (row by row, as `packed` orders them) ->
        [C, Hq, D], one row at a time over its own keys, under `masks` (`_row_masks`): a prefill
        chunk mixes prompts of different lengths, and attention over the padded [B, heads, n, T]
        layout costs every row the longest row's n x T. Example, a chunk of 5 prompts of 303, 150,
        120, 40 and 17 tokens: padded, 5 x 303 x 303 query-key pairs; by row, 303² + 150² + ... (a
        quarter of that). On the EPYC, the prefill of 64 bundled prompts at 32 rows took 0.79x the
        time (2.0 s against 2.5), at 8 rows 0.83x. A verify pass's rows (a few tokens each, after
        their KV) fold their grouped query heads as `_attend` does.

        Rows fed one token after their KV (decoding rows in a round that prefills a prompt beside
        them, rows that draft nothing in a verify pass) are attended in one padded call over the
        batch's keys, as a plain decoding step is, where that pays (`_row_masks`), the others row
        by row: a call per row costs ~45 us a layer, and a prompt joining 16 decoding rows made 16
        calls a layer, now 2."""
        row_masks, singles = masks
        hq, d = q.shape[1], q.shape[2]
        out = q.new_empty(q.shape)
        if singles is not None:  # one query per batch row (the others' are zeros, their outputs dropped)
            rows, where, column, folded, single = singles
            keys, values = kv.read(index)  # [B, Hk, T, D]
            qs = q.new_zeros(keys.shape[0], hq, 1, d)
            qs[rows] = q[where][:, :, None]
            out[where] = self._attend(qs, keys, values, column, folded)[rows, :, 0]  # [s, Hq, D]
        else:
            single = ()
        at = 0
        for i, count in enumerate(kv.row_spans[2]):
            if count == 0 or i in single:
                at += count
                continue
            keys, values = kv.read_row(index, i)  # [1, Hk, start + count, D]
            qi = q[at:at + count].transpose(0, 1)[None]  # [1, Hq, count, D]
            hk, mask = keys.shape[1], row_masks[i]
            if mask is not None and mask.shape[2] > count:  # folded
                a = F.scaled_dot_product_attention(qi.reshape(1, hk, -1, d), keys, values, attn_mask=mask,
                                                   scale=self.scaling).reshape(1, hq, count, d)
            else:
                a = F.scaled_dot_product_attention(qi, keys, values, attn_mask=mask, is_causal=mask is None,
                                                   scale=self.scaling, enable_gqa=hq != hk)
            out[at:at + count] = a[0].transpose(0, 1)  # [count, Hq, D]
            at += count
        return out

    def _qkv(self, out: torch.Tensor, q_norm, k_norm, cos, sin):
        """The fused q/k/v output [..., (q + k + v heads) * D] -> q, k, v [..., heads, D], rotated."""
        heads = self.heads
        out = out.view(*out.shape[:-1], -1, self.head_dim)
        if q_norm is None:  # rotate q and k in one go
            qk, v = rotate(out[..., :-heads[2], :], cos, sin), out[..., -heads[2]:, :]
            return qk[..., :heads[0], :], qk[..., heads[0]:, :], v
        q, k, v = out.split(heads, dim=-2)
        return rotate(q_norm(q), cos, sin), rotate(k_norm(k), cos, sin), v

    def _forward_packed(self, ids, positions, kv, visible, select, packed, grab=None) -> torch.Tensor | None:
        """The same arithmetic on the real tokens only: every projection, norm and the head run on
        [C, hidden] (C = real tokens, `packed` their flat indices into [B, n]); attention alone
        works on the padded [B, heads, n, D] layout, the queries scattered into it and the outputs
        gathered back. Padding columns cost nothing but their (masked) attention.

        Example, counts [3, 1] (n = 3): packed = [0, 1, 2, 3], the linears see 4 tokens, not 6."""
        batch, n = ids.shape
        x = F.embedding(ids.reshape(-1)[packed], self.embed)  # [C, hidden]
        flat_positions = positions.reshape(-1)[packed]
        cos, sin = self._rope(flat_positions[None], kv.width + n, x.dtype)
        cos, sin = cos[0], sin[0]  # [C, 1, head_dim]
        q_heads = self.heads[0]
        folded = self._fold_mask(visible, n)
        by_row, fresh, tree = attends_by_row(n, kv, ids.device), _fresh(kv), bool(getattr(kv, "trees", None))
        masks = self._row_masks(kv, visible) if by_row else None
        copy_act = packed.numel() < VIEW_ROWS  # (see `matmul`)
        for index, (ln1, qkv, o_proj, q_norm, k_norm, ln2, gate_up, down) in enumerate(self.layers):
            if grab is not None and index in grab:  # (EAGLE features: the inputs of the layers asked for)
                grab[index] = x
            q, k, v = self._qkv(qkv(ln1(x)), q_norm, k_norm, cos, sin)  # [C, heads, head_dim]
            kv.write_packed(index, k, v)
            if by_row:
                a = self._attend_by_row(q, kv, index, masks)  # [C, heads, D]
                x = x + o_proj(a.reshape(q.shape[0], -1), contiguous=False)
            else:
                keys, values = kv.read(index)  # [B, kv_heads, T, head_dim]
                q_pad = x.new_zeros(batch * n, q_heads, self.head_dim)
                q_pad[packed] = q
                a = self._attend(q_pad.view(batch, n, q_heads, -1).transpose(1, 2), keys, values, visible,
                                 folded, fresh, tree)  # [B, heads, n, D]
                x = x + o_proj(a.transpose(1, 2).reshape(batch * n, -1)[packed], contiguous=False)
            gate, up = gate_up(ln2(x), contiguous=copy_act).chunk(2, dim=-1)
            x = x + down(F.silu(gate) * up, contiguous=False)
        if grab is not None and len(self.layers) in grab:
            grab[len(self.layers)] = self.norm(x)
        if select is False:
            return None
        if select is not None:  # row i's column(s) select[i] -> their places among the real tokens
            where = torch.full((batch * n,), -1, dtype=torch.long, device=x.device)
            where[packed] = torch.arange(packed.numel(), device=x.device)
            rows = torch.arange(batch, device=x.device)
            pick = where.view(batch, n)[rows if select.dim() == 1 else rows[:, None], select].clamp(min=0)
            # [B, V] or [B, k, V] (a column no real token fills: any token's logits)
            return self.lm_head(self.norm(x[pick]))
        logits = self.lm_head(self.norm(x))  # [C, V]
        out = logits.new_zeros(batch * n, logits.shape[-1])
        out[packed] = logits
        return out.view(batch, n, -1)  # padding columns: zero logits


def fold_mask(visible: torch.Tensor, group: int) -> torch.Tensor:
    """A mask [B, 1, n, T] for queries whose `group` query heads per KV head are folded into that
    head's query rows (heads h = i g + j read KV head i, as rows j n .. j n + n - 1): [B, 1, g n, T]."""
    b, _, n, width = visible.shape
    return visible.expand(b, group, n, width).reshape(b, 1, group * n, width)


def _fresh(kv) -> bool:
    """Whether every row of the pass is fed from column 0 as a chain (prompts: see
    `LeanForward._attend`; a tree's mask is not the causal one: `ModelRunner.feed(..., parents=)`)."""
    spans = getattr(kv, "row_spans", None)
    return spans is not None and not any(spans[1]) and not getattr(kv, "trees", None)


def attends_by_row(n: int, kv, device: torch.device) -> bool:
    """Whether a pass feeding n columns attends row by row (`_attend_by_row`), on a CPU, over
    a KV that reads one row at a time: prefill chunks (more than ROW_ATTENTION_TOKENS columns), and
    verify passes whose rows are so unequal in width that the padded layout's wasted query-key pairs
    cost more than a call per row (ROW_WASTE_PAIRS a row). Padded, every row's n queries attend
    over the widest row's keys; by row, row i's count_i over its own start_i + count_i.

    Example, 8 rows verifying 9 tokens over 910 keys at the widest and 445 on average: padded 8 x 9
    x 910 pairs, by row 8 x 9 x 445, 4185 fewer a row: by row (SDPA over the bundled target's heads
    on the EPYC: 1.31 -> 1.00 ms a layer). At 354 and 235: 1071 fewer, padded (0.43 against 0.62 by
    row). One token a row at 910 and 445: 465 fewer, padded (0.35 against 0.45 ms by row)."""
    if device.type != "cpu" or not hasattr(kv, "read_row"):
        return False
    if n > ROW_ATTENTION_TOKENS:
        return True
    _, starts, counts = kv.row_spans
    rows = [(s + c, c) for s, c in zip(starts, counts) if c]
    if not rows:
        return False
    widest = max(w for w, _ in rows)
    wasted = sum(n * widest - c * w for w, c in rows)
    return wasted > ROW_WASTE_PAIRS * len(rows)


def _select(logits: torch.Tensor, select) -> torch.Tensor | None:
    """logits [B, n, V] -> all of them (None), one column per row (LongTensor [B] or an int), k columns
    per row (LongTensor [B, k] -> [B, k, V]), none (False)."""
    if select is False:
        return None
    if select is None:
        return logits
    if isinstance(select, int):
        return logits[:, select]
    rows = torch.arange(logits.shape[0], device=logits.device)
    return logits[rows if select.dim() == 1 else rows[:, None], select]


_LEAN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # one per model: its fused weights


def make_forward(model, kind: str = "auto"):
    """The forward for `model`: kind "hf", "lean", or "auto" (lean where supported, else hf)."""
    if kind == "hf":
        return HFForward(model)
    if kind == "lean" or (kind == "auto" and lean_unsupported(model) is None):
        lean = _LEAN.get(model)
        if lean is None:
            lean = _LEAN[model] = LeanForward(model)
        return lean.refresh()  # not stale if the model was moved since it was cached
    if kind == "auto":
        return HFForward(model)
    raise ValueError(f"unknown forward {kind!r}; choose auto, lean or hf")
