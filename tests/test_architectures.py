"""The architectures users run, as tiny random-init pairs built from configs: hybrid sliding-window
attention (Gemma 2, Gemma 3, Qwen2 with use_sliding_window, Mistral with a window) and LongRoPE
(Phi-3), with windows and the LongRoPE threshold crossed during generation.

Each is exact against the batch-1 reference for every method and batch size, with the real
(perturbed) draft and with the oracle drafter forcing ragged acceptance; the reference itself is
checked against transformers' generate; what cannot be served exactly is refused up front.
"""

from __future__ import annotations

import functools

import pytest
import torch
from tiny import VOCAB, perturbed, prompts, ragged_mismatch, references
from transformers import (
    FalconConfig,
    FalconForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from batchspec import EngineConfig, ModelPair, SamplingParams, SpecEngine
from batchspec.core.attention import rope_limit, rope_rows
from batchspec.drafters import OracleDrafter
from batchspec.harness import hf_generate_greedy

MAX_NEW = 24
WINDOW = 4
LONGROPE_LIMIT = 32  # original_max_position_embeddings of the Phi-3 pair
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, bos_token_id=None,
              eos_token_id=None, pad_token_id=None)
HYBRID = ["sliding_attention", "full_attention"]


def build(arch: str):
    torch.manual_seed(0)
    if arch == "gemma2":
        model = Gemma2ForCausalLM(Gemma2Config(**COMMON, head_dim=16, sliding_window=WINDOW, layer_types=HYBRID))
    elif arch == "gemma3":
        model = Gemma3ForCausalLM(Gemma3TextConfig(**COMMON, head_dim=16, sliding_window=WINDOW, layer_types=HYBRID))
    elif arch == "qwen2-sliding":
        model = Qwen2ForCausalLM(Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW,
                                             max_window_layers=1))
    elif arch == "mistral-window":
        model = MistralForCausalLM(MistralConfig(**COMMON, sliding_window=WINDOW))
    elif arch == "phi3-longrope":
        half = 64 // 4 // 2
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * half,
                "long_factor": [1.0 + 0.5 * i for i in range(half)],
                "original_max_position_embeddings": LONGROPE_LIMIT}
        model = Phi3ForCausalLM(Phi3Config(**COMMON, rope_parameters=rope,
                                           original_max_position_embeddings=LONGROPE_LIMIT))
    elif arch == "gpt-neox":
        model = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                                 num_hidden_layers=2, num_attention_heads=4,
                                                 max_position_embeddings=256, initializer_range=0.2))
    elif arch == "opt":
        model = OPTForCausalLM(OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=256, init_std=0.2,
                                         word_embed_proj_dim=64, bos_token_id=None, eos_token_id=None,
                                         pad_token_id=None))
    elif arch in ("falcon", "falcon-alibi"):
        model = FalconForCausalLM(FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, alibi=arch == "falcon-alibi",
                                               initializer_range=0.2, bos_token_id=None, eos_token_id=None))
    else:
        raise ValueError(arch)
    return model.eval()


ARCHS = ("gemma2", "gemma3", "qwen2-sliding", "mistral-window", "phi3-longrope", "gpt-neox", "opt", "falcon")


@functools.cache
def workload(arch: str):
    target = build(arch)
    pair = ModelPair(target, perturbed(target, 0.02, seed=2), None, VOCAB, ())
    # prompt + output cross the window and the LongRoPE limit; some prompts are longer than the limit
    ids = prompts(12, seed=5, max_len=40)
    return pair, ids, references(pair, ids, MAX_NEW)


@pytest.mark.slow  # every architecture but llama (the fast tier's, tests/test_equivalence.py)
@pytest.mark.parametrize("arch", ARCHS)
def test_reference_equals_transformers_generate(arch):
    pair, ids, refs = workload(arch)
    assert any(len(p) < LONGROPE_LIMIT < len(p) + MAX_NEW for p in ids)  # crossing the limit while generating
    assert max(len(p) for p in ids) > LONGROPE_LIMIT  # and starting beyond it
    hf = [hf_generate_greedy(pair.target, p, SamplingParams(max_new_tokens=MAX_NEW), (), 0) for p in ids]
    assert refs == hf


@pytest.mark.slow  # every architecture but llama (the fast tier's, tests/test_equivalence.py)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", ["autoregressive", "eqspec", "exspec"])
def test_every_method_and_batch_size_is_exact(arch, method):
    pair, ids, refs = workload(arch)
    ref_map = {tuple(i): r for i, r in zip(ids, refs)}
    for bs in (1, 3, 8):
        config = EngineConfig(drafter="draft_model", adaptive=False, method=method, batch_size=bs, gamma=4, debug=True)
        engine = SpecEngine(pair, config)
        outs = engine.generate(ids, SamplingParams(max_new_tokens=MAX_NEW))
        assert [o.token_ids for o in outs] == refs, f"{arch} {method} bs={bs} draft model"
        if method != "autoregressive":
            engine = SpecEngine(pair, config)
            engine.drafter = OracleDrafter(ref_map, ragged_mismatch(4), VOCAB, engine.device)
            outs = engine.generate(ids, SamplingParams(max_new_tokens=MAX_NEW))
            assert [o.token_ids for o in outs] == refs, f"{arch} {method} bs={bs} oracle"
            assert len(engine.stats.accept_hist) == 5  # ragged: every acceptance length occurred


def test_longrope_regime_is_per_row():
    """transformers lets the batch's longest row pick the factor for all; batchspec rotates each row
    in its own regime, so a short row next to a long one gets what it gets alone."""
    model = build("phi3-longrope")
    assert rope_limit(model) == LONGROPE_LIMIT
    rotary = model.model.rotary_emb
    x = torch.zeros(1, 1, 16)
    both = torch.stack([torch.arange(20), torch.arange(40, 60)])
    alone_short = rotary(x, torch.arange(20)[None])  # transformers, alone: short
    with rope_rows(model, [False, True]):
        ours = rotary(x.expand(2, 1, 16), both)
    torch.testing.assert_close(ours[0][0], alone_short[0][0], rtol=0, atol=0)
    torch.testing.assert_close(ours[0][1], rotary(x, torch.arange(40, 60)[None])[0][0], rtol=0, atol=0)
    hf_batched = rotary(x.expand(2, 1, 16), both)  # transformers, batched: the long row decides for both
    assert not torch.allclose(hf_batched[0][0], alone_short[0][0])
    with rope_rows(model, [True]):  # a recomputed row: long at every position, even below the limit
        torch.testing.assert_close(rotary(x, torch.arange(20)[None])[0],
                                   rotary(x, torch.arange(40)[None])[0][:, :20], rtol=0, atol=0)


def test_alibi_is_refused_up_front():
    with pytest.raises(ValueError, match="ALiBi"):
        SpecEngine(ModelPair(build("falcon-alibi"), None, None, VOCAB, ()), EngineConfig(drafter="draft_model",
                                                                                         method="autoregressive"))


def test_dynamic_ntk_rope_is_refused():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**COMMON, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                    "rope_theta": 10000.0})).eval()
    with pytest.raises(ValueError, match="dynamic NTK"):
        SpecEngine(ModelPair(model, None, None, VOCAB, ()), EngineConfig(drafter="draft_model",
                                                                         method="autoregressive"))


@pytest.mark.slow  # every architecture but llama (the fast tier's, tests/test_equivalence.py)
@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "qwen2-sliding", "mistral-window", "phi3-longrope"])
def test_ragged_rows_match_transformers_logits(arch):
    """Logits, not only tokens (a window changes few argmaxes of a 2-layer model): two rows of
    different lengths fed in ragged chunks, each column compared with transformers' forward over the
    whole sequence alone, with its own window masks."""
    from batchspec.core.request import Request
    from batchspec.core.runner import ModelRunner

    model = build(arch)
    runner = ModelRunner(model, "target", VOCAB, rows=2, capacity=64)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (30, 23)]
    reqs = [Request(i, [], SamplingParams(), frozenset()) for i in range(2)]
    for i, r in enumerate(reqs):
        r.slot = i
    got = [[], []]
    for chunk in ((7, 3), (5, 9), (1, 4), (17, 7)):  # per-row chunk sizes; rows at different offsets
        counts = [min(c, len(s) - len(r.token_ids)) for c, s, r in zip(chunk, seqs, reqs)]
        live = [(r, s, c) for r, s, c in zip(reqs, seqs, counts) if c > 0]
        rows = [[*s[len(r.token_ids):len(r.token_ids) + c]] for r, s, c in live]
        width = max(len(x) for x in rows)
        ids = torch.tensor([x + [0] * (width - len(x)) for x in rows])
        logits = runner.feed([r for r, _, _ in live], ids, [c for _, _, c in live], logits="all")
        runner.commit([r for r, _, _ in live], [c for _, _, c in live])
        for k, (r, s, c) in enumerate(live):
            got[r.index].append(logits[k, :c])
            r.token_ids.extend(s[len(r.token_ids):len(r.token_ids) + c])
    for i, s in enumerate(seqs):
        with torch.no_grad():
            want = model(torch.tensor([s])).logits[0, :, :VOCAB]
        torch.testing.assert_close(torch.cat(got[i]), want, rtol=1e-4, atol=1e-4)
