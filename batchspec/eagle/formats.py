"""Head checkpoints: vLLM speculators' layout (what `save_head` writes), and the EAGLE authors'.

speculators (0.9.0 for EAGLE-3; EAGLE-1 as its `eagle` model type defined it), config.json:
    speculators_model_type   "eagle3" | "eagle"
    architectures            ["Eagle3Speculator"] | ["EagleSpeculator", "LlamaDecoderLayer"]
    transformer_layer_config the layer's LlamaConfig (vocab_size: the target's)
    speculators_config       {algorithm, proposal_methods [{proposal_type: greedy, ...}],
                              default_proposal_method, verifier {name_or_path, architectures}}
    eagle3: draft_vocab_size, norm_before_residual, target_hidden_size, eagle_aux_hidden_state_layer_ids
    eagle:  layernorms, fusion_bias (+ ours: draft_vocab_size, for a reduced LM head)
  model.safetensors (no embeddings, no verifier LM head):
    eagle3: fc.weight [H, 3H_t], layers.0.{input_layernorm, hidden_norm, post_attention_layernorm}.weight,
            layers.0.self_attn.{q,k,v,o}_proj.weight, layers.0.mlp.{gate,up,down}_proj.weight,
            norm.weight, lm_head.weight [N, H], d2t [N] int64, t2d [V] bool
    eagle:  fusion_fc.{weight, bias}, transformer.self_attn.*, transformer.mlp.*,
            transformer.post_attention_layernorm.weight (with layernorms: transformer.input_layernorm,
            embedding_layernorm, pre_lm_head_layernorm); ours for a reduced vocabulary: lm_head (left out while
            it is the target's rows: `target_rows`), d2t, t2d

EAGLE authors (SafeAILab/EAGLE), a llama-like config.json and pytorch_model.bin or safetensors:
    EAGLE-1: fc.{weight, bias} [H, 2H], layers.0.self_attn.*, layers.0.mlp.*,
             layers.0.post_attention_layernorm.weight (no input norm), maybe embed_tokens.weight
    EAGLE-3: midlayer.* (as layers.0.* above), fc.weight [H, 3H], norm.weight, lm_head.weight, d2t,
             t2d; config.json has draft_vocab_size

`load_head(path, target)` tells them apart (config's speculators_model_type; else `midlayer.*`
keys: EAGLE-3, `fc.weight` with `layers.0.*`: EAGLE-1). Embeddings in a checkpoint are ignored:
the head uses the target's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from .head import EagleHead, HeadSpec, eagle3_layers

LAYER = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
         "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
         "down_proj": "mlp.down_proj", "post_norm": "post_attention_layernorm"}
SPECULATORS_VERSION = "0.9.0"


def _names(kind: str, layout: str) -> dict[str, str]:
    """Our module prefix -> the checkpoint's, for a head `kind` in `layout` (speculators | eagle)."""
    if kind == "eagle3":
        layer = "layers.0." if layout == "speculators" else "midlayer."
        out = {ours: layer + theirs for ours, theirs in LAYER.items()}
        out.update(fc="fc", input_norm=layer + "input_layernorm", hidden_norm=layer + "hidden_norm", norm="norm")
    else:
        layer = "transformer." if layout == "speculators" else "layers.0."
        out = {ours: layer + theirs for ours, theirs in LAYER.items()}
        out.update(fc="fusion_fc" if layout == "speculators" else "fc", input_norm=layer + "input_layernorm",
                   embed_norm="embedding_layernorm", norm="pre_lm_head_layernorm")
    out.update(lm_head="lm_head", d2t="d2t", t2d="t2d")
    return out


def _rename(state: dict, names: dict[str, str], forward: bool = True) -> dict:
    table = names if forward else {v: k for k, v in names.items()}
    out = {}
    for key, value in state.items():
        prefix, _, rest = key.rpartition(".") if key not in table else (key, "", "")
        if key in table:
            out[table[key]] = value
        elif prefix in table:
            out[f"{table[prefix]}.{rest}"] = value
    return out


def _layer_config(head: EagleHead) -> dict:
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
            "attention_bias", "hidden_act", "mlp_bias")
    config = head.config.to_dict()
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **{k: config[k] for k in keep if k in config}}


def target_rows(head: EagleHead) -> bool:
    """Whether an EAGLE-1 head's reduced LM head is still the target's rows (trained frozen): such a
    head is saved without it and `load_head` takes the rows from the target it is loaded onto."""
    if head.spec.kind != "eagle" or head.lm_head is None or head.target_head is None or head.d2t is None:
        return False
    rows = head.target_head[head.target_ids.to(head.target_head.device)]
    return torch.equal(head.lm_head.weight.detach(), rows.to(head.lm_head.weight.dtype))


def save_head(head: EagleHead, path: str | Path, target_name: str | None = None, layout: str = "speculators",
              speculative_tokens: int = 4, dtype: torch.dtype | None = None) -> Path:
    """Write `head` to folder `path` (config.json + model.safetensors) in speculators' layout, or
    (`layout="eagle"`) the EAGLE authors' (config.json + pytorch_model.bin). Floating weights are
    stored in `dtype` (default their own); a reduced LM head that is the target's rows is left out."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    spec = head.spec
    drop = {"lm_head.weight"} if target_rows(head) else set()
    state = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()
             if not k.startswith("rotary.") and k not in drop}
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    state = _rename(state, _names(spec.kind, layout))
    layer = _layer_config(head)
    if layout == "eagle":
        config = {**layer, "bias": spec.fc_bias}
        if spec.kind == "eagle3":
            config.update(draft_vocab_size=head.draft_vocab, target_hidden_size=spec.feature_size)
        (path / "config.json").write_text(json.dumps(config, indent=1))
        torch.save(state, path / "pytorch_model.bin")
        return path
    if layout != "speculators":
        raise ValueError(f"layout must be speculators or eagle, got {layout!r}")
    weights_dtype = next(v for v in state.values() if v.is_floating_point()).dtype
    config = {
        "speculators_model_type": spec.kind, "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer, "dtype": str(weights_dtype).removeprefix("torch."),
        "speculators_config": {
            "algorithm": spec.kind,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": target_name, "architectures": ["LlamaForCausalLM"]},
        },
        "batchspec": {"target_layers": list(spec.layers)},
    }
    if spec.kind == "eagle3":
        config.update(architectures=["Eagle3Speculator"], draft_vocab_size=head.draft_vocab,
                      norm_before_residual=spec.norm_before_residual, target_hidden_size=spec.feature_size,
                      eagle_aux_hidden_state_layer_ids=list(spec.layers))
    else:
        config.update(architectures=["EagleSpeculator", "LlamaDecoderLayer"],
                      transformer_layer_architecture="LlamaDecoderLayer", layernorms=spec.layernorms,
                      fusion_bias=spec.fc_bias, draft_vocab_size=head.draft_vocab)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _weights(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if files:
        state = {}
        for f in files:
            state.update(load_file(str(f)))
        return state
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not bins:
        raise ValueError(f"{path} holds no *.safetensors or pytorch_model*.bin weights")
    state = {}
    for f in bins:
        state.update(torch.load(f, map_location="cpu", weights_only=True))
    return state


def load_head(path: str | Path, target) -> EagleHead:
    """The head saved in folder `path` (any layout the module docstring lists), attached to
    `target` and on its device and dtype. ValueError saying what does not fit."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} is not a head folder (no config.json)")
    config = json.loads((path / "config.json").read_text())
    state = {k: v for k, v in _weights(path).items() if "embed_tokens" not in k and "verifier_" not in k}
    text = target.config.get_text_config()
    num_layers = text.num_hidden_layers
    if "speculators_model_type" in config:
        kind, layout = config["speculators_model_type"], "speculators"
        if kind not in ("eagle", "eagle3"):
            raise ValueError(f"{path}: speculators model type {kind!r} is not an EAGLE head (eagle, eagle3)")
        layer = dict(config["transformer_layer_config"])
        draft_vocab = config.get("draft_vocab_size")
    elif any(k.startswith("midlayer.") for k in state):
        kind, layout, layer, draft_vocab = "eagle3", "eagle", dict(config), config.get("draft_vocab_size")
    elif "fc.weight" in state and any(k.startswith("layers.0.") for k in state):
        kind, layout, layer, draft_vocab = "eagle", "eagle", dict(config), None
    else:
        raise ValueError(f"{path}: not a layout batchspec knows (speculators, or EAGLE-1/3 by their authors)")
    if kind == "eagle3":
        layers = tuple(config.get("eagle_aux_hidden_state_layer_ids") or eagle3_layers(num_layers))
    else:
        layers = tuple(config.get("batchspec", {}).get("target_layers") or (num_layers,))
    fc_bias = "fusion_fc.bias" in state or ("fc.bias" in state and kind == "eagle")
    spec = HeadSpec(kind=kind, layers=layers, feature_size=text.hidden_size, fc_bias=fc_bias,
                    layernorms=bool(config.get("layernorms", False)),
                    norm_before_residual=bool(config.get("norm_before_residual", False)))
    layer = {k: v for k, v in layer.items() if k not in ("architectures", "model_type", "bias", "draft_vocab_size",
                                                          "target_hidden_size", "transformers_version")}
    layer_config = LlamaConfig(**layer)
    if layer_config.vocab_size != text.vocab_size or layer_config.hidden_size != text.hidden_size:
        raise ValueError(f"{path}: the head is for a vocabulary of {layer_config.vocab_size} and width "
                         f"{layer_config.hidden_size}; the target has {text.vocab_size} and {text.hidden_size}")
    if "lm_head.weight" in state:
        draft_vocab = state["lm_head.weight"].shape[0]
    head = EagleHead(layer_config, spec, draft_vocab if draft_vocab and draft_vocab != text.vocab_size else None)
    ours = _rename(state, _names(kind, layout), forward=False)
    if "d2t" in ours and head.d2t is None:  # a full-size mapping: the identity
        ours.pop("d2t"), ours.pop("t2d", None)
    missing, unexpected = head.load_state_dict(ours, strict=False)
    missing = [k for k in missing if not k.startswith("rotary.")]
    if kind == "eagle" and head.lm_head is not None and "lm_head.weight" in missing:
        missing.remove("lm_head.weight")  # (filled from the target below)
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not fit a {kind} head: missing {missing[:4]}, unexpected "
                         f"{unexpected[:4]}")
    head = head.to(dtype=target.dtype, device=target.device).attach(target)
    if head.d2t is not None and int(head.t2d.sum()) != head.draft_vocab:
        raise ValueError(f"{path}: t2d marks {int(head.t2d.sum())} target ids, the head drafts {head.draft_vocab}")
    if "lm_head.weight" not in state and head.lm_head is not None:  # saved as the target's rows
        with torch.no_grad():
            head.lm_head.weight.copy_(head.target_head[head.target_ids.to(head.target_head.device)])
    return head.eval()
