"""EAGLE draft heads: one decoder layer that drafts from the target's own hidden states.

A head entry at position p pairs the token x_p with a hidden input h_{p-1}: the target's feature
of position p - 1 (whose logits predict x_p) on committed positions, or the head's own output
of the entry before on positions it drafts. The layer's output o_p is the head's guess of the
target's feature at p; its logits draft x_{p+1}, and o_p is the next entry's hidden input.

    EAGLE-1 (Li et al. 2024)   feature = the target's last hidden state after its final norm
                               (HF `hidden_states[L]`); x = fc([embed(x_p) ; h]) -> the layer
                               (no input norm) -> the target's LM head (or a reduced one).
    EAGLE-3 (Li et al. 2025)   feature = the inputs of target layers (2, L // 2, L - 3) side by
                               side ([3H]); h = fc(feature) -> the layer reads
                               [input_norm(embed(x_p)) ; hidden_norm(h)] (q/k/v over 2H), adds
                               h as its residual -> its own final norm and LM head over a reduced
                               draft vocabulary: draft id d is target id d + d2t[d]; t2d [V] bool
                               marks the target ids the draft vocabulary holds.

The token embeddings (and, for a full vocabulary, the LM head) are the target's tensors, held by
reference and never saved with the head. Layer indices name HF's `output_hidden_states`: index i
is the input of decoder layer i (0: the embeddings), index L the final normed state.

Rows keep their own KV (`HeadKV`, as core/rows.py keeps the target's): row r's entries sit at
columns 0.. of its buffer row; rejecting drafts is only a lower length. `step` feeds rows
ragged numbers of entries, each at its own offset.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from ..core.forward import FOLD_TOKENS, fold_mask
from ..core.rope import RopeTable, rotate

KINDS = ("eagle", "eagle3")


def eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """The target layers EAGLE-3 reads (low, middle, high): the inputs of layers 2, L // 2, L - 3,
    as the EAGLE authors' code and vLLM pick them, kept within 0..L for targets of under 6 layers
    (e.g. L = 2: 2, 1, 0)."""
    return (min(2, num_layers), num_layers // 2, max(0, num_layers - 3))


@dataclass
class HeadSpec:
    """What a head is, apart from its weights (saved in its config)."""

    kind: str  # "eagle" (EAGLE-1) or "eagle3"
    layers: tuple[int, ...]  # target hidden-state indices it reads (HF output_hidden_states numbering)
    feature_size: int  # the target's hidden size H_t (features are len(layers) * H_t wide)
    fc_bias: bool = False  # EAGLE-1's fc has a bias in the authors' checkpoints
    layernorms: bool = False  # EAGLE-1 + extra norms (speculators' `layernorms`: HASS/TTT variants)
    norm_before_residual: bool = False  # EAGLE-3: the residual is hidden_norm(h), not h

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"head kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        self.layers = tuple(int(i) for i in self.layers)


class HeadKV:
    """A head's KV buffer: data [layers, 2, rows, kv heads, capacity, head dim]. Rows and columns
    grow on demand (a copy, rare: doubling); fresh memory is zeroed so masked columns are finite."""

    def __init__(self, layers: int, heads: int, head_dim: int, rows: int = 1, capacity: int = 256,
                 dtype=torch.float32, device="cpu") -> None:
        self.data = torch.zeros(layers, 2, rows, heads, capacity, head_dim, dtype=dtype, device=device)

    @property
    def rows(self) -> int:
        return self.data.shape[2]

    @property
    def capacity(self) -> int:
        return self.data.shape[4]

    def ensure(self, rows: int, width: int) -> None:
        if rows <= self.rows and width <= self.capacity:
            return
        r, c = max(rows, self.rows), self.capacity
        while c < width:
            c *= 2
        grown = self.data.new_zeros(*self.data.shape[:2], r, self.data.shape[3], c, self.data.shape[5])
        grown[:, :, : self.rows, :, : self.capacity] = self.data
        self.data = grown


class EagleHead(nn.Module):
    """An EAGLE-1 or EAGLE-3 head over a target (see the module docstring)."""

    def __init__(self, config: LlamaConfig, spec: HeadSpec, draft_vocab: int | None = None) -> None:
        super().__init__()
        self.config, self.spec = config, spec
        hidden, vocab = config.hidden_size, config.vocab_size
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // heads
        self.heads, self.kv_heads = heads, kv_heads
        eps = config.rms_norm_eps
        eagle3 = spec.kind == "eagle3"
        if eagle3 and draft_vocab is None:
            draft_vocab = vocab
        self.draft_vocab = draft_vocab or vocab
        width = len(spec.layers) * spec.feature_size
        if eagle3:
            self.fc = nn.Linear(width, hidden, bias=False)  # [3 H_t] -> H
            self.input_norm = nn.RMSNorm(hidden, eps=eps)
            self.hidden_norm = nn.RMSNorm(hidden, eps=eps)
            attn_in = 2 * hidden
        else:
            if width != hidden:
                raise ValueError(f"an EAGLE-1 head reads one feature of its own width {hidden}, got {width}")
            self.fc = nn.Linear(2 * hidden, hidden, bias=spec.fc_bias)  # [embed ; feature] -> H
            self.embed_norm = nn.RMSNorm(hidden, eps=eps) if spec.layernorms else None
            self.input_norm = nn.RMSNorm(hidden, eps=eps) if spec.layernorms else None
            attn_in = hidden
        self.q_proj = nn.Linear(attn_in, heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(attn_in, kv_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(attn_in, kv_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=config.attention_bias)
        self.post_norm = nn.RMSNorm(hidden, eps=eps)
        self.gate_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, hidden, bias=False)
        # before the LM head: EAGLE-3's own norm; EAGLE-1 none (its output mimics a normed feature)
        self.norm = nn.RMSNorm(hidden, eps=eps) if eagle3 or spec.layernorms else None
        reduced = self.draft_vocab != vocab
        # own LM head: EAGLE-3 always, EAGLE-1 over a reduced vocabulary; else the target's (`attach`)
        self.lm_head = nn.Linear(hidden, self.draft_vocab, bias=False) if eagle3 or reduced else None
        self.register_buffer("d2t", torch.zeros(self.draft_vocab, dtype=torch.long) if reduced else None)
        self.register_buffer("t2d", torch.zeros(vocab, dtype=torch.bool) if reduced else None)
        self.rotary = LlamaRotaryEmbedding(config)
        self.angles = RopeTable(self.rotary)  # RoPE's cos, sin over positions so far (`_qkv`)
        self.embed: torch.Tensor | None = None  # [V, H] the target's, by reference (`attach`)
        self.target_head: torch.Tensor | None = None  # [V, H] the target's LM head (full vocabulary)

    # ----------------------------------------------------------------------------- set-up
    def attach(self, target) -> EagleHead:
        """Borrow the target's token embeddings and LM head (not copied, not saved)."""
        embed = target.get_input_embeddings().weight
        if embed.shape != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(f"the head is for a vocabulary of {self.config.vocab_size} x {self.config.hidden_size}, "
                             f"the target's embeddings are {tuple(embed.shape)}")
        # plain tensors sharing the target's storage: a Parameter assigned here would become one of
        # the head's (trained, saved)
        self.embed = embed.detach()
        self.target_head = target.get_output_embeddings().weight.detach()
        return self

    def set_vocab(self, target_ids: torch.Tensor) -> None:
        """A reduced vocabulary: the draft ids 0..N-1 stand for target_ids [N] (sorted, distinct),
        stored as EAGLE-3's d2t offsets and t2d mask."""
        if self.d2t is None or target_ids.numel() != self.draft_vocab:
            raise ValueError(f"this head drafts over {self.draft_vocab} ids, got {target_ids.numel()}")
        ids = target_ids.to(self.d2t.device, torch.long)
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def target_ids(self) -> torch.Tensor | None:
        """[N] the target id of each draft id (None: the full vocabulary)."""
        if self.d2t is None:
            return None
        return torch.arange(self.draft_vocab, device=self.d2t.device) + self.d2t

    def new_kv(self, rows: int = 1, capacity: int = 256) -> HeadKV:
        p = self.q_proj.weight
        return HeadKV(1, self.kv_heads, self.head_dim, rows, capacity, p.dtype, p.device)

    # ----------------------------------------------------------------------------- math
    def lift(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [..., F] -> hidden inputs [..., H] (EAGLE-3's fc; EAGLE-1 as they are)."""
        return self.fc(features) if self.spec.kind == "eagle3" else features

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Layer outputs [..., H] -> draft logits [..., V_draft]."""
        x = self.norm(out) if self.norm is not None else out
        return self.lm_head(x) if self.lm_head is not None else F.linear(x.to(self.target_head.dtype), self.target_head)

    def cast(self, dtype: torch.dtype) -> EagleHead:
        """The head's own weights in `dtype` (its layer, norms and own LM head): RoPE's frequencies
        stay float32 (HF computes the angles in float32 from them) and the target's tensors, held by
        reference, stay the target's."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.RMSNorm)):
                m.to(dtype)
        return self

    def _inputs(self, tokens: torch.Tensor, hidden: torch.Tensor):
        """-> (the attention's input [.., n, attn_in], the residual [.., n, H])."""
        if self.embed is None:
            raise RuntimeError("attach the head to its target first (head.attach(target_model))")
        emb = F.embedding(tokens, self.embed).to(hidden.dtype)
        if self.spec.kind == "eagle3":
            normed = self.hidden_norm(hidden)
            residual = normed if self.spec.norm_before_residual else hidden
            return torch.cat([self.input_norm(emb), normed], dim=-1), residual
        if self.embed_norm is not None:
            emb = self.embed_norm(emb)
        x = self.fc(torch.cat([emb, hidden], dim=-1))
        return (self.input_norm(x) if self.input_norm is not None else x), x

    def _qkv(self, z: torch.Tensor, positions: torch.Tensor, upto: int):
        """z [b, n, attn_in], positions [b, n] (all < upto) -> q [b, Hq, n, D], k, v [b, Hk, n, D] (rotated)."""
        b, n, _ = z.shape
        q = self.q_proj(z).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(z).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(z).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        dynamic = self.rotary.rope_type in ("dynamic", "longrope")  # (angles that scale with the length)
        cos, sin = self.rotary(v, positions) if dynamic else self.angles(positions, upto, v.dtype)  # [b, n, D]
        cos, sin = cos[:, None], sin[:, None]
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def _finish(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """attn [b, Hq, n, D] -> the layer's output [b, n, H]."""
        b, _, n, _ = attn.shape
        x = residual + self.o_proj(attn.transpose(1, 2).reshape(b, n, -1))
        y = self.post_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))

    def step(self, kv: HeadKV, rows: list[int], tokens: torch.Tensor, hidden: torch.Tensor, starts: list[int],
             counts: list[int] | None = None, last: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed buffer row rows[i] the entries (tokens[i, j], hidden[i, j]) for j < counts[i] (default
        all n) at columns starts[i] + j, each entry at position starts[i] + j + 1 (x_1 is the first
        token a head sees), attending over its row's columns <= its own. `hidden` is target features
        [b, n, F] (lifted here) or the head's own outputs [b, n, H]. Returns (logits [b, n, V_draft],
        outputs [b, n, H]); padding columns' are garbage, and nothing of theirs is written. `last`:
        logits [b, 1, V_draft] of each row's last entry only (a prompt entered at once: the LM
        head over every entry would cost n times the step).

        Example, starts [3, 0], counts [2, 1]: row 0 writes columns 3, 4 (query 0 sees 0..3, query
        1 sees 0..4); row 1 writes column 0; key width max(3 + 2, 0 + 1) = 5.
        """
        b, n = tokens.shape
        counts = [n] * b if counts is None else list(counts)
        if not (len(rows) == len(starts) == len(counts) == b):
            raise ValueError(f"step: {b} rows of tokens but {len(rows)} rows, {len(starts)} starts, "
                             f"{len(counts)} counts")
        if any(c > n or c < 0 for c in counts) or any(s < 0 for s in starts):
            raise ValueError(f"step: counts {counts} must be within 0..{n} and starts {starts} >= 0")
        if hidden.shape[-1] != self.config.hidden_size:
            hidden = self.lift(hidden)
        device = tokens.device
        width = max(s + c for s, c in zip(starts, counts))
        kv.ensure(max(rows) + 1, width)
        start = torch.tensor(starts, device=device)
        positions = start[:, None] + torch.arange(n, device=device)[None]  # [b, n] columns written
        z, residual = self._inputs(tokens, hidden)
        q, k, v = self._qkv(z, positions + 1, max(starts) + n + 1)  # (padding columns too)
        slots = torch.tensor(rows, dtype=torch.long, device=device)
        if all(c == n for c in counts):  # no padding entries (a drafting step, n = 1)
            # data[0, 0] [R, Hk, C, D]: row slots[i] column positions[i, j] <- k[i, :, j]
            row = slots[:, None]
            kv.data[0, 0][row, :, positions] = k.transpose(1, 2).to(kv.data.dtype)
            kv.data[0, 1][row, :, positions] = v.transpose(1, 2).to(kv.data.dtype)
        else:
            real_b = torch.tensor([i for i, c in enumerate(counts) for _ in range(c)], dtype=torch.long, device=device)
            real_j = torch.tensor([j for c in counts for j in range(c)], dtype=torch.long, device=device)
            cols = positions[real_b, real_j]
            # data[0, 0] [R, Hk, C, D]: row slots[real_b] column cols <- k[real_b, :, real_j]
            kv.data[0, 0][slots[real_b], :, cols] = k[real_b, :, real_j].to(kv.data.dtype)
            kv.data[0, 1][slots[real_b], :, cols] = v[real_b, :, real_j].to(kv.data.dtype)
        read = span(rows)  # (consecutive rows: a view, not a gathered copy)
        keys, values = kv.data[0, 0][read, :, :width], kv.data[0, 1][read, :, :width]  # [b, Hk, W, D]
        visible = torch.arange(width, device=device)[None, None, :] <= positions[:, :, None]  # [b, n, W]
        out = self._finish(self._attend(q, keys.to(q.dtype), values.to(q.dtype), visible), residual)
        if last:
            at = torch.tensor(counts, device=device).clamp(min=1) - 1
            return self.logits(out[torch.arange(b, device=device), at][:, None]), out
        return self.logits(out), out

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """q [b, Hq, n, D] over keys, values [b, Hk, W, D] where visible [b, n, W] -> [b, Hq, n, D].
        With grouped KV heads (Hq = g Hk) and few queries, the g query heads of each KV head are
        folded into its query rows (as `LeanForward._attend` does: heads h = i g + j read KV head i):
        `enable_gqa` beside a mask sends CUDA's SDPA to its math kernels, and a CPU repeats K and V."""
        b, hq, n, d = q.shape
        hk = keys.shape[1]
        g = hq // hk
        if g == 1 or n > FOLD_TOKENS:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible[:, None], enable_gqa=g > 1)
        out = F.scaled_dot_product_attention(q.reshape(b, hk, g * n, d), keys, values,
                                             attn_mask=fold_mask(visible[:, None], g))
        return out.reshape(b, hq, n, d)

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, steps: int = 1) -> list[tuple[torch.Tensor,
                                                                                                    torch.Tensor]]:
        """Training: entries (tokens[:, e], features[:, e]) for e < n, no KV, run `steps` times
        (training-time test, EAGLE-3): at step s > 0 entry e's hidden input is step s - 1's output of
        entry e - 1 (what the head would have drafted from) and it attends to step 0's entries
        <= e - s and to its own chain, the entry at e - s + t of each step t in 1..s, as drafting at
        depth s from base e - s does. Returns per step (logits [b, n, V_draft], outputs [b, n, H]);
        step s's first s entries have no chain behind them (their outputs are garbage).

        Example, n = 3, steps = 2: step 1's entry 2 attends to step 0's entries 0, 1 and to step 1's
        entry 2; its hidden input is step 0's output of entry 1."""
        b, n = tokens.shape
        device = tokens.device
        positions = torch.arange(n, device=device)[None].expand(b, n) + 1
        hidden = self.lift(features)
        e = torch.arange(n, device=device)
        keys, values, results = [], [], []
        for s in range(steps):
            if s > 0:
                hidden = torch.cat([hidden.new_zeros(b, 1, hidden.shape[-1]), results[-1][1][:, :-1]], dim=1)
            z, residual = self._inputs(tokens, hidden)
            q, k, v = self._qkv(z, positions, n + 1)
            keys.append(k)
            values.append(v)
            # [n, (s + 1) n]: step 0's columns e' <= e - s, then step t's column e - s + t
            parts = [e[None, :] <= (e[:, None] - s)] + [e[None, :] == (e[:, None] - s + t) for t in range(1, s + 1)]
            mask = torch.cat(parts, dim=1)
            attn = F.scaled_dot_product_attention(q, torch.cat(keys, dim=2), torch.cat(values, dim=2),
                                                  attn_mask=mask, enable_gqa=self.heads != self.kv_heads)
            out = self._finish(attn, residual)
            results.append((self.logits(out), out))
        return results


def span(ids: list[int]) -> slice | list[int]:
    """Indices as a slice where they are consecutive (the usual case): indexing by it is a view,
    with no index tensor to build, send to the device and gather by. Example: [2, 3, 4] -> 2:5."""
    if ids and ids[-1] - ids[0] + 1 == len(ids) and all(b == a + 1 for a, b in zip(ids, ids[1:])):
        return slice(ids[0], ids[-1] + 1)
    return ids




def head_config(target_config, intermediate_size: int | None = None) -> LlamaConfig:
    """A one-layer Llama config with the target's width, heads and RoPE (the head's own hyperparameters)."""
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    hidden = text.hidden_size
    heads = text.num_attention_heads
    rope = getattr(text, "rope_parameters", None) or {"rope_type": "default",
                                                      "rope_theta": getattr(text, "rope_theta", 10000.0)}
    return LlamaConfig(vocab_size=text.vocab_size, hidden_size=hidden,
                       intermediate_size=intermediate_size or text.intermediate_size, num_hidden_layers=1,
                       num_attention_heads=heads, num_key_value_heads=getattr(text, "num_key_value_heads", heads),
                       head_dim=getattr(text, "head_dim", None) or hidden // heads,
                       max_position_embeddings=getattr(text, "max_position_embeddings", 4096),
                       rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6), rope_parameters=dict(rope),
                       attention_bias=False, tie_word_embeddings=False)


def new_head(target, kind: str = "eagle", draft_vocab: int | None = None, seed: int = 0,
             vocab_ids: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> EagleHead:
    """A freshly initialised head for `target` (attached): EAGLE-1 reads the final normed state,
    EAGLE-3 the three layers `eagle3_layers` names. A reduced vocabulary of `draft_vocab` ids
    drafts over `vocab_ids` (default the first ids); an own LM head starts as the target's rows
    and EAGLE-3's final norm as the target's. `dtype`: the head's (default the target's; training
    keeps float32 weights under a bfloat16 target)."""
    config = head_config(target.config)
    text = target.config.get_text_config()
    layers = (text.num_hidden_layers,) if kind == "eagle" else eagle3_layers(text.num_hidden_layers)
    spec = HeadSpec(kind=kind, layers=layers, feature_size=text.hidden_size, fc_bias=kind == "eagle")
    torch.manual_seed(seed)
    head = EagleHead(config, spec, draft_vocab if draft_vocab and draft_vocab < config.vocab_size else None)
    with torch.no_grad():
        for m in head.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
    head = head.to(dtype=dtype or target.dtype, device=target.device).attach(target)
    if head.d2t is not None:
        ids = vocab_ids[: head.draft_vocab] if vocab_ids is not None else torch.arange(head.draft_vocab)
        head.set_vocab(ids.sort().values)
    with torch.no_grad():
        if head.lm_head is not None:
            rows = head.target_ids if head.target_ids is not None else torch.arange(config.vocab_size)
            head.lm_head.weight.copy_(head.target_head[rows.to(head.target_head.device)])
        if kind == "eagle3":
            norm = getattr(getattr(target, "model", None), "norm", None)
            if norm is not None and norm.weight.shape == head.norm.weight.shape:
                head.norm.weight.copy_(norm.weight)
    return head
