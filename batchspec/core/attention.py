"""What attention a model's layers do, and how the row layout serves it exactly.

Sliding windows. A layer of type "sliding_attention" (Gemma 2/3, Qwen2 with use_sliding_window,
every layer of Mistral and others with `sliding_window` set and no layer types) lets query
position q see key positions k with q - W < k <= q. The row layout keeps every row's whole KV;
the window is one more condition in that layer type's mask. Models that mix the two kinds take
one mask per layer type (transformers' `causal_mask_mapping`, for the families whose modules
accept it); a model with sliding layers that does not is refused.

Length-dependent RoPE. transformers' LongRoPE module (Phi-3) picks the short or long factor per
forward pass from the largest position in it, so in a padded batch the longest row decides for
all. Alone, a sequence is rotated short while its length is at most L0 =
`original_max_position_embeddings`; the step at which it grows past L0, transformers' generate
drops the cache and recomputes the whole sequence with the long factor (Phi3ForCausalLM's
`prepare_inputs_for_generation`). batchspec reproduces exactly that per row: each row has its own
regime (long iff its length exceeds L0), a row crossing L0 has its KV recomputed in the long
regime (the engine re-prefills it), and a row still at or below L0 drafts no further than L0, so
that a verify pass never mixes the two regimes. Dynamic NTK scaling, whose frequencies depend on
the longest sequence the module has seen so far, is refused.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class AttentionLayout:
    kinds: frozenset[str]  # layer types present: FULL and/or SLIDING
    window: int | None  # W of the sliding layers
    per_type_masks: bool  # the model takes {layer type: mask} (mixes both kinds)


def attention_layout(model) -> AttentionLayout:
    """The layer types of `model` and its window; ValueError for what cannot be served exactly."""
    config = model.config.get_text_config()
    if getattr(config, "alibi", False) or config.model_type in ("bloom", "mpt"):
        raise ValueError(f"{type(model).__name__} uses ALiBi position biases, which its transformers modules build "
                         "from a 2-D padding mask; batchspec's row layout passes per-row 4-D masks, so ALiBi models "
                         "are not supported yet")
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if types:
        kinds = frozenset(types)
        unknown = sorted(kinds - {FULL, SLIDING})
        if unknown:
            raise ValueError(f"{type(model).__name__} has {', '.join(unknown)} layers; batchspec serves layers of "
                             "full or sliding-window attention with a KV cache")
    else:
        kinds = frozenset({SLIDING if window is not None else FULL})
    if SLIDING not in kinds:
        return AttentionLayout(kinds, None, False)
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"{type(model).__name__} has sliding-window layers but no usable sliding_window ({window!r})")
    per_type = len(kinds) > 1
    if per_type and "causal_mask_mapping := attention_mask" not in inspect.getsource(type(_body(model)).forward):
        raise ValueError(f"{type(model).__name__} mixes sliding-window and full attention layers, and its transformers "
                         "modules do not take a mask per layer type; batchspec cannot serve it exactly")
    return AttentionLayout(kinds, window, per_type)


def layer_masks(visible: torch.Tensor, positions: torch.Tensor, layout: AttentionLayout):
    """visible [b, 1, n, T] (causal, per row) -> the mask(s) the model takes: one tensor, or
    {layer type: tensor} when it mixes kinds. Sliding layers also hide keys at or before q - W."""
    if SLIDING not in layout.kinds:
        return visible
    cols = torch.arange(visible.shape[-1], device=visible.device)
    window = visible & (cols[None, None, :] > positions[:, :, None] - layout.window)[:, None]
    return {FULL: visible, SLIDING: window} if layout.per_type_masks else window


def _body(model):
    return getattr(model, "model", model)



# ---------------------------------------------------------------------------------------- RoPE
def rotary_modules(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "rope_type") and hasattr(m, "original_inv_freq")]


def rope_limit(model) -> int | None:
    """L0 of a LongRoPE model (its original_max_position_embeddings), None for every other RoPE;
    ValueError for RoPE that cannot be served exactly."""
    limit = None
    for module in rotary_modules(model):
        types = module.rope_type.values() if isinstance(module.rope_type, dict) else [module.rope_type]
        if "dynamic" in types:
            raise ValueError("dynamic NTK RoPE scaling is not supported: its frequencies depend on the longest "
                             "sequence the model has seen so far, so no row could be computed as it is alone")
        if isinstance(module.rope_type, dict) and "longrope" in types:
            raise ValueError("LongRoPE configured per layer type is not supported yet")
        if module.rope_type == "longrope":
            params = getattr(module.config, "rope_parameters", None) or {}
            limit = int(params.get("original_max_position_embeddings")
                        or module.config.original_max_position_embeddings)
            _install(module, limit)
    return limit


def _install(module, limit: int) -> None:
    """Let the runner choose the regime per row: while `module.batchspec_long` holds a bool [b]
    (set only around batchspec's own forwards), row i is rotated with the long factor at every
    position if it is True, else with the short one. Unset, the module behaves as transformers made it."""
    if hasattr(module, "batchspec_long"):
        return
    original = module.forward
    module.batchspec_long = None

    def forward(x, position_ids, *args, **kwargs):
        rows_long = module.batchspec_long
        if rows_long is None:
            return original(x, position_ids, *args, **kwargs)
        n = position_ids.shape[1]
        # One pass of the module's own forward per regime: positions clamped below L0 keep it short;
        # an extra column at L0 makes it long for every position (the extra column is dropped).
        short = original(x, position_ids.clamp(max=limit - 1), *args, **kwargs)
        forced = torch.cat([position_ids, torch.full_like(position_ids[:, :1], limit)], dim=1)
        long = original(x, forced, *args, **kwargs)
        pick = rows_long.view(-1, 1, 1)
        return tuple(torch.where(pick, lo[:, :n], sh) for sh, lo in zip(short, long))

    module.forward = forward


@contextlib.contextmanager
def rope_rows(model, rows_long: list[bool] | None):
    """Within the block, the model's LongRoPE modules rotate row i long iff rows_long[i]."""
    modules = [m for m in rotary_modules(model) if hasattr(m, "batchspec_long")] if rows_long is not None else []
    flags = torch.tensor(rows_long, dtype=torch.bool, device=model.device) if modules else None
    for m in modules:
        m.batchspec_long = flags
    try:
        yield
    finally:
        for m in modules:
            m.batchspec_long = None
