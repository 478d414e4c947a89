"""Head checkpoints: round trips through vLLM speculators' layout and the EAGLE authors' layouts,
with tiny heads written in each (names and shapes as the module docstring of eagle/formats.py
lists them), and a head the recipe trains for a few steps."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from tiny import VOCAB, make_model

from batchspec.eagle.formats import load_head, save_head
from batchspec.eagle.head import new_head

torch.set_num_threads(1)


def tiny_head(kind: str, draft_vocab: int | None, seed: int = 1):
    target = make_model("llama", 64, 4, seed=0)
    head = new_head(target, kind, draft_vocab=draft_vocab, seed=seed)
    if draft_vocab:
        head.set_vocab(torch.arange(0, 2 * draft_vocab, 2))
    return target, head


def same_outputs(a, b, width: int) -> None:
    gen = torch.Generator().manual_seed(0)
    tokens, feats = torch.randint(0, VOCAB, (2, 6), generator=gen), torch.randn(2, 6, width, generator=gen)
    with torch.no_grad():
        for (la, oa), (lb, ob) in zip(a(tokens, feats, steps=2), b(tokens, feats, steps=2)):
            assert torch.equal(la, lb) and torch.equal(oa, ob)
    if a.d2t is not None:
        assert torch.equal(a.d2t, b.d2t) and torch.equal(a.t2d, b.t2d)


@pytest.mark.parametrize("kind,draft_vocab", [("eagle", None), ("eagle", 100), ("eagle3", 100), ("eagle3", None)])
def test_speculators_round_trip(tmp_path, kind, draft_vocab):
    target, head = tiny_head(kind, draft_vocab)
    save_head(head, tmp_path, target_name="tiny-target")
    config = json.loads((tmp_path / "config.json").read_text())
    weights = load_file(str(tmp_path / "model.safetensors"))
    assert config["speculators_model_type"] == kind
    assert config["transformer_layer_config"]["vocab_size"] == VOCAB
    assert config["speculators_config"]["verifier"]["name_or_path"] == "tiny-target"
    assert not any("embed" in k for k in weights)  # the target's embeddings are never saved
    if kind == "eagle3":
        assert config["architectures"] == ["Eagle3Speculator"]
        assert config["eagle_aux_hidden_state_layer_ids"] == [2, 2, 1]
        assert weights["fc.weight"].shape == (64, 3 * 64)
        assert weights["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * 64
        assert {"layers.0.hidden_norm.weight", "layers.0.input_layernorm.weight", "norm.weight",
                "lm_head.weight"} <= set(weights)
    else:
        assert config["architectures"][0] == "EagleSpeculator"
        assert weights["fusion_fc.weight"].shape == (64, 2 * 64) and "fusion_fc.bias" in weights
        assert "transformer.self_attn.q_proj.weight" in weights
        # (tiny_head remaps the vocabulary: its LM head is no longer the target's rows, so it is saved)
        assert ("lm_head.weight" in weights) == (draft_vocab is not None)
    if draft_vocab:
        assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
        assert int(weights["t2d"].sum()) == draft_vocab == config.get("draft_vocab_size")
    loaded = load_head(tmp_path, target)
    assert loaded.spec == head.spec
    same_outputs(head, loaded, 64 * len(head.spec.layers))


def test_a_reduced_lm_head_is_saved_only_when_trained_and_in_the_dtype_asked(tmp_path):
    target, head = tiny_head("eagle", 100)
    rows = target.get_output_embeddings().weight[head.target_ids]
    with torch.no_grad():
        head.lm_head.weight.copy_(rows)  # as `new_head` starts it and frozen training keeps it
    save_head(head, tmp_path / "frozen", dtype=torch.bfloat16)
    weights = load_file(str(tmp_path / "frozen" / "model.safetensors"))
    assert "lm_head.weight" not in weights and weights["fusion_fc.weight"].dtype == torch.bfloat16
    assert json.loads((tmp_path / "frozen" / "config.json").read_text())["dtype"] == "bfloat16"
    assert weights["d2t"].dtype == torch.int64  # (only floating weights change dtype)
    loaded = load_head(tmp_path / "frozen", target)
    assert torch.equal(loaded.lm_head.weight, rows)  # filled from the target it is loaded onto
    assert loaded.q_proj.weight.dtype == torch.float32  # (the target's dtype)
    assert torch.equal(loaded.q_proj.weight, head.q_proj.weight.to(torch.bfloat16).float())
    with torch.no_grad():
        head.lm_head.weight[3] += 1.0  # trained: its own rows now
    save_head(head, tmp_path / "trained")
    weights = load_file(str(tmp_path / "trained" / "model.safetensors"))
    assert torch.equal(weights["lm_head.weight"], head.lm_head.weight)
    same_outputs(head, load_head(tmp_path / "trained", target), 64)


def test_eagle1_authors_layout(tmp_path):
    """EAGLE-1 by its authors: fc.{weight,bias}, layers.0.* without an input norm, embed_tokens
    (ignored: the target's are used), a llama-like config.json, pytorch_model.bin."""
    target, head = tiny_head("eagle", None)
    save_head(head, tmp_path, layout="eagle")
    state = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight",
            "layers.0.post_attention_layernorm.weight"} <= set(state)
    assert not any("input_layernorm" in k for k in state)
    state["embed_tokens.weight"] = torch.randn(VOCAB, 64)  # as the authors' checkpoints may carry it
    torch.save(state, tmp_path / "pytorch_model.bin")
    same_outputs(head, load_head(tmp_path, target), 64)


def test_eagle3_authors_layout(tmp_path):
    """EAGLE-3 by its authors: midlayer.*, fc [H, 3H], norm, lm_head, d2t, t2d; config.json with
    draft_vocab_size; here as safetensors."""
    from safetensors.torch import save_file

    target, head = tiny_head("eagle3", 100)
    save_head(head, tmp_path, layout="eagle")
    state = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert {"midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight", "midlayer.self_attn.q_proj.weight",
            "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= set(state)
    (tmp_path / "pytorch_model.bin").unlink()
    save_file(state, str(tmp_path / "model.safetensors"))
    assert json.loads((tmp_path / "config.json").read_text())["draft_vocab_size"] == 100
    same_outputs(head, load_head(tmp_path, target), 3 * 64)


def test_bad_folders(tmp_path):
    target, head = tiny_head("eagle", None)
    with pytest.raises(ValueError, match="no config.json"):
        load_head(tmp_path, target)
    save_head(head, tmp_path)
    other = make_model("llama", 32, 2, seed=0)
    with pytest.raises(ValueError, match="width|vocabulary"):
        load_head(tmp_path, other)
    config = json.loads((tmp_path / "config.json").read_text())
    config["speculators_model_type"] = "mtp"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="not an EAGLE head"):
        load_head(tmp_path, target)
