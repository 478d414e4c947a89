"""`--drafter eagle:<dir>` through the engine: greedy output equals target-only decoding for every
method and batch size, with the head's features taken from prefill chunks, joining prompts and
every verify pass (plain rounds too)."""

from __future__ import annotations

import pytest
from tiny import pair, prompts, references

from batchspec import EngineConfig, SamplingParams, SpecEngine
from batchspec.eagle.formats import save_head
from batchspec.eagle.head import new_head

MAX_NEW = 12


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("head")
    save_head(new_head(pair("llama").target, "eagle3", draft_vocab=200, seed=3), out)
    return out


@pytest.mark.parametrize("method", ["eqspec", "exspec"])
@pytest.mark.parametrize("batch_size", [1, 3, 8, 32])
def test_an_eagle_head_keeps_greedy_output_exact(head_dir, method, batch_size):
    p, ids = pair("llama"), prompts(12)
    refs = references(p, ids, MAX_NEW)
    for adaptive in (False, True):
        engine = SpecEngine(p, EngineConfig(method=method, batch_size=batch_size, gamma=3, adaptive=adaptive,
                                            drafter=f"eagle:{head_dir}", debug=True, max_prefill_tokens=24))
        outs = engine.generate(ids, SamplingParams(max_new_tokens=MAX_NEW))
        assert [o.token_ids for o in outs] == refs
        if not adaptive:
            assert engine.last_run.drafted > 0  # (the head drafted: its features arrived)


def test_a_bad_head_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        SpecEngine(pair("llama"), EngineConfig(drafter=f"eagle:{tmp_path}"))
    with pytest.raises(ValueError, match="needs a head"):
        SpecEngine(pair("llama"), EngineConfig(drafter="eagle"))


@pytest.mark.parametrize("batch_size", [3, 8])
def test_a_hybrid_on_a_head_is_exact(head_dir, batch_size):
    from batchspec.drafters.eagle import EagleDrafter
    from batchspec.drafters.hybrid import HybridDrafter

    p, ids = pair("llama", draft_kind="none"), prompts(12)
    ids = [q + q[: len(q) // 2] for q in ids]  # (repeats: the lookup finds some drafts)
    refs = references(p, ids, MAX_NEW)
    engine = SpecEngine(p, EngineConfig(method="eqspec", batch_size=batch_size, gamma=3, adaptive=False,
                                        drafter=f"hybrid:suffix+eagle:{head_dir}", debug=True))
    assert isinstance(engine.drafter, HybridDrafter) and isinstance(engine.drafter.model, EagleDrafter)
    assert engine.drafter.label.startswith("hybrid:suffix") and "+eagle" in engine.drafter.label
    assert [o.token_ids for o in engine.generate(ids, SamplingParams(max_new_tokens=MAX_NEW))] == refs


def test_the_default_drafter_takes_the_head_batchspec_ships_for_the_target(head_dir, monkeypatch):
    """A target alone (no draft model) whose head batchspec knows: `hybrid` (the default) builds on
    it and `eagle` without a folder loads it; with a draft model loaded the hybrid keeps that."""
    import batchspec.catalog as catalog
    from batchspec.drafters.eagle import EagleDrafter

    monkeypatch.setattr(catalog, "known_head", lambda name: head_dir if name == "known-target" else None)
    alone = pair("llama", draft_kind="none")
    assert SpecEngine(alone, EngineConfig()).drafter.label.startswith("suffix")  # (no head known for "target")
    alone.target_name = "known-target"
    assert alone.head == str(head_dir)
    assert isinstance(SpecEngine(alone, EngineConfig()).drafter.model, EagleDrafter)
    assert isinstance(SpecEngine(alone, EngineConfig(drafter="eagle")).drafter, EagleDrafter)
    both = pair("llama")
    both.target_name = "known-target"
    assert not isinstance(SpecEngine(both, EngineConfig()).drafter.model, EagleDrafter)


def test_a_hybrid_takes_only_a_head_after_its_plus():
    with pytest.raises(ValueError, match="after '\\+' must be an EAGLE head"):
        SpecEngine(pair("llama"), EngineConfig(drafter="hybrid:suffix+ngram"))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_head_drafts_in_the_dtype_chosen_for_it_and_stays_exact(head_dir, dtype, monkeypatch):
    """The registry drafts in `auto_dtype`'s choice (bfloat16 on a CPU with native bfloat16
    matrices: forced both ways here): the head's weights in it, RoPE's frequencies and the target's
    tensors untouched, the label saying so; greedy output equals target-only decoding, drafts
    ragged (a random head)."""
    import torch

    from batchspec.drafters import eagle

    monkeypatch.setattr(eagle, "native_bf16", lambda: dtype == "bfloat16")
    p, ids = pair("llama"), prompts(12)
    refs = references(p, ids, MAX_NEW)
    engine = SpecEngine(p, EngineConfig(batch_size=3, gamma=3, adaptive=False, drafter=f"eagle:{head_dir}"))
    head = engine.drafter.head
    assert head.q_proj.weight.dtype == head.lm_head.weight.dtype == getattr(torch, dtype)
    assert head.rotary.inv_freq.dtype == torch.float32 and head.embed.dtype == torch.float32
    assert engine.drafter.label == ("eagle (bfloat16)" if dtype == "bfloat16" else "eagle")
    assert [o.token_ids for o in engine.generate(ids, SamplingParams(max_new_tokens=MAX_NEW))] == refs
    assert engine.last_run.drafted > 0
