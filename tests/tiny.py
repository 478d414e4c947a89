"""Tiny random-init model pairs built from configs, and the oracle drafter the tests use.

Weights are initialised with a large std so that logits are spread out (top-2 gaps far above
fp32 rounding), which makes greedy decoding numerically stable; fp64 reruns confirm it.
"""

from __future__ import annotations

import copy
import functools
import random

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from batchspec import EngineConfig, ModelPair, SamplingParams, SpecEngine
from batchspec.drafters import DraftModelDrafter, OracleDrafter

VOCAB = 256
ARCHS = ("llama", "qwen3", "gpt2")
# For parametrize: llama in the fast tier, the others `slow` (`./scripts/test.sh -m "not slow"`).
ARCH_PARAMS = ("llama", *(pytest.param(a, marks=pytest.mark.slow) for a in ARCHS[1:]))


def make_model(arch: str, hidden: int, layers: int, seed: int, dtype=torch.float32, vocab: int = VOCAB):
    torch.manual_seed(seed)
    if arch == "llama":
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                          initializer_range=0.2)
        model = LlamaForCausalLM(cfg)
    elif arch == "qwen3":
        cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                          max_position_embeddings=256, initializer_range=0.2)
        model = Qwen3ForCausalLM(cfg)
    elif arch == "gpt2":
        cfg = GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=4, n_positions=256,
                         initializer_range=0.2, bos_token_id=None, eos_token_id=None)
        model = GPT2LMHeadModel(cfg)
    else:
        raise ValueError(arch)
    return model.to(dtype).eval()


def perturbed(model, scale: float, seed: int):
    """A copy of `model` with noise on every weight: a real draft model that agrees often."""
    torch.manual_seed(seed)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * scale * p.std().clamp(min=1e-3))
    return draft


@functools.cache
def pair(arch: str, draft_kind: str = "small", dtype: torch.dtype = torch.float32, eos: tuple[int, ...] = ()):
    target = make_model(arch, 64, 2, seed=0, dtype=dtype)
    if draft_kind == "small":
        draft = make_model(arch, 32, 1, seed=1, dtype=dtype)
    elif draft_kind == "perturbed":
        draft = perturbed(target, 0.02, seed=2)
    else:
        draft = None
    return ModelPair(target, draft, None, VOCAB, eos)


def prompts(n: int = 32, seed: int = 0, max_len: int = 60) -> list[list[int]]:
    """Prompts of very different lengths (1 .. max_len tokens)."""
    rng = random.Random(seed)
    lengths = [1, max_len, 2, max_len // 2] + [rng.randint(1, max_len) for _ in range(n - 4)]
    return [[rng.randrange(VOCAB) for _ in range(k)] for k in lengths[:n]]


def references(p: ModelPair, prompt_ids: list[list[int]], max_new: int) -> list[list[int]]:
    eng = SpecEngine(p, EngineConfig(drafter="draft_model", method="autoregressive", batch_size=1))
    sp = SamplingParams(max_new_tokens=max_new)
    return [eng.generate([ids], sp)[0].token_ids for ids in prompt_ids]


def ragged_mismatch(gamma: int):
    """Mismatch positions that differ per row and per round: each row-round rejects at a position
    m in 0..γ+1 (m >= γ accepts everything), cycling so that some rows accept 0 and others all γ."""

    def mismatch(req, round_: int, pos: int) -> bool:
        m = (sum(req.token_ids[: req.prompt_len]) + req.prompt_len * 3 + round_ * 5) % (gamma + 2)
        return pos == m

    return mismatch


def oracle_engine(p: ModelPair, refs: dict, config: EngineConfig, with_cost: bool = False) -> SpecEngine:
    """An engine whose drafter proposes the reference with injected mismatches."""
    engine = SpecEngine(p, EngineConfig(**{**config.__dict__, "drafter": "draft_model"})) if with_cost else \
        SpecEngine(ModelPair(p.target, None, None, p.vocab_size, p.eos_token_ids),
                   EngineConfig(**{**config.__dict__, "drafter": "oracle:1"}))
    cost = DraftModelDrafter(engine.draft_runner) if with_cost else None
    engine.drafter = OracleDrafter(refs, ragged_mismatch(config.gamma), p.vocab_size, engine.device, cost)
    return engine


def run_rows(forward, model, lengths: list[int], extra: int, seed: int = 0, ids=None, more=None):
    """Feed rows of the KV layout as the engine does, through `forward`: first each row's prompt
    of lengths[i] tokens in one call (rows of different lengths: right padding inside the call),
    then `extra` more tokens per row in a second call, each row at its own offset. Returns
    (first logits [rows, max length, V], second logits [rows, extra, V], lengths); only columns
    < lengths[i] of the first are real. `ids` [rows, max length] and `more` [rows, extra] fix the
    tokens (default: random, seeded)."""
    from batchspec.core.rows import RowBatch, RowKV
    from batchspec.core.runner import kv_shape, row_inputs

    gen = torch.Generator().manual_seed(seed)
    layers, heads, head_dim = kv_shape(model)
    rows, width = len(lengths), max(lengths)
    kv = RowKV(layers, heads, head_dim, rows, width + extra, model.dtype, model.device)
    kv.make_clean(list(range(rows)), width + extra)
    ids = torch.randint(0, VOCAB, (rows, width), generator=gen) if ids is None else ids
    batch = RowBatch(kv, list(range(rows)), [0] * rows, lengths)
    positions, visible = row_inputs([0] * rows, width, batch.width, model.device)
    first = forward(ids, positions, batch, visible)
    more = torch.randint(0, VOCAB, (rows, extra), generator=gen) if more is None else more
    batch = RowBatch(kv, list(range(rows)), lengths, [extra] * rows)
    positions, visible = row_inputs(lengths, extra, batch.width, model.device)
    second = forward(more, positions, batch, visible)
    return first, second, lengths
