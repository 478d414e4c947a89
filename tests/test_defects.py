"""Regression tests for three fixed defects: a stale lean forward after the model is moved, the
torch version floor, and sampling precision / host syncs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from tiny import VOCAB, make_model, run_rows

from batchspec.core.forward import HFForward, make_forward
from batchspec.sampling import BatchSampling, SamplingParams, draw_uniforms, make_generator, probabilities, sample
from batchspec.verify.rejection import rejection_verify


# ---------------------------------------------------------------- 1. lean forward after model.to()
def prefill(forward, model, lengths=(5, 2, 7), seed=0):
    """Logits of one ragged prefill (rows of different lengths in one call), and the row lengths."""
    first, _, lengths = run_rows(forward, model, list(lengths), 1, seed)
    return first, lengths


def test_lean_forward_follows_the_model_to_another_dtype():
    model = make_model("llama", 64, 2, seed=0)
    lean = make_forward(model, "lean")
    before, _ = prefill(lean, model)
    assert before.dtype == torch.float32

    model.to(torch.float64)
    # Reference: the transformers modules of an independently built float64 copy (same init).
    reference, start = prefill(HFForward(make_model("llama", 64, 2, seed=0, dtype=torch.float64)), model)
    assert reference.dtype == torch.float64
    for forward in (lean, make_forward(model, "lean")):  # the instance held from before, and a fresh lookup
        logits, _ = prefill(forward, model)
        assert logits.dtype == torch.float64
        for i, n in enumerate(start):
            torch.testing.assert_close(logits[i, :n], reference[i, :n], rtol=0, atol=1e-10)

    # The modules' weights are views into the lean forward's (new, float64) fused matrices again.
    fused = make_forward(model, "lean").layers[0][1]
    attn = model.model.layers[0].self_attn
    assert fused.weight.dtype == torch.float64
    assert attn.q_proj.weight.data_ptr() == fused.weight.data_ptr()
    assert attn.q_proj.weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()
    assert attn.v_proj.weight.data_ptr() == fused.weight[sum(fused.sizes[:2]):].data_ptr()
    # ... and the transformers modules of the moved model agree with the lean forward too.
    hf, _ = prefill(HFForward(model), model)
    for i, n in enumerate(start):
        torch.testing.assert_close(hf[i, :n], reference[i, :n], rtol=0, atol=1e-10)


# ---------------------------------------------------------------- 2. torch floor
def test_torch_floor_admits_no_torch_without_sdpa_enable_gqa():
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        tomllib = pytest.importorskip("tomli", reason="Python 3.10 has no tomllib and tomli is not installed")
    from packaging.requirements import Requirement
    from packaging.version import Version

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    (torch_req,) = [r for r in map(Requirement, pyproject["project"]["dependencies"]) if r.name == "torch"]
    # F.scaled_dot_product_attention(..., enable_gqa=...) in the lean forward appeared in torch 2.5.
    assert Version("2.4.1") not in torch_req.specifier
    assert Version("2.4.0") not in torch_req.specifier
    assert Version("2.5.0") in torch_req.specifier


# ---------------------------------------------------------------- 3. sampling precision and host syncs
def test_sample_resolves_tokens_below_float32_resolution():
    tiny = 5e-10  # far below float32's spacing at 1.0 (~1.2e-7)
    probs = torch.tensor([1.0, tiny, tiny], dtype=torch.float32)
    p64 = probs.double()
    cdf = p64.cumsum(-1)
    total = cdf[-1].item()
    # u such that u * total falls in [cdf[0], cdf[1]): token 1; similarly for tokens 0 and 2.
    us = torch.tensor([0.5, (1.0 + 0.5 * p64[1].item()) / total, (cdf[1].item() + 0.5 * p64[2].item()) / total],
                      dtype=torch.float64)
    expected = [int((cdf <= u * total).sum()) for u in us.tolist()]  # inverse CDF by hand, in float64
    assert expected == [0, 1, 2]
    got = sample(probs.expand(3, 3).contiguous(), us)
    assert got.tolist() == expected
    # the same through rejection_verify's final draw (no drafts rejected: p_{γ+1} is used)
    p = probs.expand(3, 2, 3).contiguous()
    res = rejection_verify(p, None, torch.zeros(3, 1, dtype=torch.long), torch.zeros(3, 1, dtype=torch.float64), us)
    assert res.accepted.tolist() == [1, 1, 1]
    assert res.tokens[:, 1].tolist() == expected


def test_draw_uniforms_are_float64():
    gens = [make_generator(1), None, make_generator(2)]
    u = draw_uniforms(gens, 5, "cpu")
    assert u.dtype == torch.float64 and u.shape == (3, 5)
    assert torch.equal(u[1], torch.zeros(5, dtype=torch.float64))
    assert torch.equal(u[0], torch.rand(5, generator=make_generator(1), dtype=torch.float64))


@pytest.fixture
def host_syncs(monkeypatch):
    """Counts of Tensor -> Python conversions (each a device -> host sync on an accelerator)."""
    counts = {}
    for name in ("__bool__", "item", "tolist", "__int__", "__float__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return counts


PARAM_MIXES = {
    "mixed": [SamplingParams(), SamplingParams(temperature=0.8, top_k=5), SamplingParams(temperature=1.2, top_p=0.7),
              SamplingParams(temperature=1.0, top_k=3, top_p=0.9), SamplingParams(temperature=1.0)],
    "plain": [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5)],
    "greedy+plain": [SamplingParams(), SamplingParams(temperature=0.7)],
}


@pytest.mark.parametrize("mix", PARAM_MIXES)
@pytest.mark.parametrize("with_q", [True, False])
def test_no_host_syncs_in_sampling_and_verification(host_syncs, mix, with_q):
    params = PARAM_MIXES[mix]
    batch, gamma, vocab = len(params), 3, 11
    gen = torch.Generator().manual_seed(0)
    sampling = BatchSampling.of(params, "cpu")
    u = torch.rand(batch, 2 * gamma + 1, generator=gen, dtype=torch.float64)
    draft_logits = torch.randn(batch, gamma, vocab, generator=gen)
    target_logits = torch.randn(batch, gamma + 1, vocab, generator=gen)
    host_syncs.clear()

    q = probabilities(draft_logits, sampling)
    drafts = sample(q, u[:, :gamma])
    p = probabilities(target_logits, sampling)
    result = rejection_verify(p, q if with_q else None, drafts, u[:, gamma:2 * gamma], u[:, 2 * gamma])
    assert host_syncs == {}
    assert result.tokens.shape == (batch, gamma + 1)
    for i, sp in enumerate(params):  # greedy rows stay one-hot at the argmax
        if sp.greedy:
            assert torch.equal(p[i], torch.nn.functional.one_hot(target_logits[i].argmax(-1), vocab).float())
    # an autoregressive round verifies no drafts at all
    res = rejection_verify(p[:, :1], None, torch.zeros(batch, 0, dtype=torch.long), u[:, :0], u[:, 0])
    assert host_syncs == {}
    assert torch.equal(res.accepted, torch.zeros(batch, dtype=torch.long))


def test_a_row_without_top_p_is_not_filtered_by_its_batch_mates():
    """[0, 0, -30]: float32 puts the mass before token 2 at exactly 1, which must not drop it from a
    row with top_p = 1 just because another row of the batch uses top-p (and so the filter runs)."""
    logits = torch.tensor([[[0.0, 0.0, -30.0]]])
    alone = probabilities(logits, BatchSampling.of([SamplingParams(temperature=1.0)], "cpu"))
    assert alone[0, 0, 2] > 0
    both = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.5)]
    mixed = probabilities(logits.expand(2, 1, 3), BatchSampling.of(both, "cpu"))
    assert torch.equal(mixed[0], alone[0])
    assert mixed[1, 0].tolist() == [0.5, 0.5, 0.0]  # top-p 0.5 keeps the tie at its threshold, not the tail


def test_an_engine_whose_model_was_moved_says_so():
    from batchspec import EngineConfig, ModelPair, SpecEngine

    model = make_model("llama", 64, 2, seed=0)
    engine = SpecEngine(ModelPair(model, None, None, VOCAB, ()), EngineConfig(drafter="draft_model",
                                                                              method="autoregressive"))
    model.to(torch.float64)
    with pytest.raises(RuntimeError, match="build a new engine"):
        engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
