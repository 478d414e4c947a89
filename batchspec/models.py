"""Loading a target/draft pair and checking that they can speculate together."""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
PAD_TOKEN = "<|batchspec_pad|>"


def default_pair_dir() -> Path:
    return Path(str(resources.files("batchspec") / "assets" / "default_pair"))


def default_target() -> str:
    return str(default_pair_dir() / "target")


def default_draft() -> str:
    return str(default_pair_dir() / "draft")


@dataclass
class ModelPair:
    target: torch.nn.Module
    draft: torch.nn.Module | None
    tokenizer: object | None
    vocab_size: int  # ids the tokenizer can produce; logits are compared over these only
    eos_token_ids: tuple[int, ...]
    target_name: str = "target"
    draft_name: str | None = None

    @property
    def head(self) -> str | None:
        """The EAGLE head batchspec ships for this target (catalog.known_head), or None."""
        from .catalog import known_head

        path = known_head(self.target_name)
        return str(path) if path is not None else None


def resolve_device(device: str | None) -> str:
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available on this machine")
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}")
    return device


def resolve_dtype(dtype: str | None, device: str) -> torch.dtype:
    if dtype in (None, "auto"):
        return torch.float32 if device == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def output_vocab(model) -> int:
    return model.get_output_embeddings().weight.shape[0]


def context_length(model) -> int | None:
    config = model.config.get_text_config()
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_tokenizers(target_tok, draft_tok) -> None:
    """Raise ValueError naming the first difference if the two tokenizers' vocabularies differ."""
    t_vocab, d_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if t_vocab == d_vocab:
        return
    for token, tid in sorted(t_vocab.items(), key=lambda kv: kv[1]):
        did = d_vocab.get(token)
        if did != tid:
            where = f"id {did} in the draft's" if did is not None else "missing from the draft's"
            raise ValueError(
                f"target and draft tokenizers differ: token {token!r} is id {tid} in the target's vocabulary "
                f"but {where} ({len(t_vocab)} vs {len(d_vocab)} tokens); speculative decoding needs one tokenizer"
            )
    extra = sorted(set(d_vocab) - set(t_vocab))[:3]
    raise ValueError(f"target and draft tokenizers differ: the draft has tokens the target lacks, e.g. {extra}")


def ensure_pad_token(tokenizer) -> None:
    """Give a tokenizer without a pad token a new one that is neither EOS nor any content token.

    The engine never feeds pad ids to a model (padding is known from lengths and masks); the
    pad token only serves tokenizer APIs."""
    if tokenizer.pad_token_id is not None and tokenizer.pad_token_id != tokenizer.eos_token_id:
        return
    tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})


def eos_ids(model, tokenizer) -> tuple[int, ...]:
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return ()
    return tuple(ids) if isinstance(ids, (list, tuple)) else (int(ids),)


def check_models(target, draft, vocab_size: int) -> None:
    for role, model in (("target", target), ("draft", draft)):
        if model is None:
            continue
        if output_vocab(model) < vocab_size:
            raise ValueError(f"the {role} model has {output_vocab(model)} output logits but the tokenizer has "
                             f"{vocab_size} tokens; they do not belong together")
    if draft is not None and (draft.device != target.device or draft.dtype != target.dtype):
        raise ValueError("target and draft must be on the same device with the same dtype")


def load_pair(target: str | None = None, draft: str | None = None, *, dtype: str | None = None,
              device: str | None = None, need_draft: bool = True) -> ModelPair:
    """Load a target and, if asked, a draft (see `resolve_source` for what a model spec may be).

    With neither given, the bundled pair (its draft only when `need_draft`: the run's drafter would
    use one). A target given alone loads no draft model: a drafter that requires one then fails in
    SpecEngine, naming the choices, and the default drafter (hybrid) runs its lookup alone. A draft
    given alone pairs with the bundled target. "random:<spec>" builds a model with random weights
    from that spec's config (and takes its tokenizer): for overhead studies of large architectures
    where no trained weights exist.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .gguf import first_line

    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    if target is None:
        draft = draft or (default_draft() if need_draft else None)
        target = default_target()
    sources = {"target": resolve_source(target, torch_dtype), "draft": resolve_source(draft, torch_dtype)}
    tokenizer = _tokenizer(AutoTokenizer, sources["target"], target, "target")
    vocab_size = len(tokenizer)
    if draft is not None:
        check_tokenizers(tokenizer, _tokenizer(AutoTokenizer, sources["draft"], draft, "draft"))
    ensure_pad_token(tokenizer)

    def load(spec: str, role: str):
        source = sources[role]
        try:
            if spec.startswith("random:"):
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source), dtype=torch_dtype)
            else:
                model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype)
        except OSError as exc:
            raise ValueError(f"cannot load the {role} model {spec!r}: {first_line(exc)}") from None
        return model.to(device).eval()

    target_model = load(target, "target")
    draft_model = load(draft, "draft") if draft is not None else None
    check_models(target_model, draft_model, vocab_size)
    return ModelPair(target_model, draft_model, tokenizer, vocab_size, eos_ids(target_model, tokenizer),
                     target_name=str(target), draft_name=str(draft) if draft else None)


# A hub id: "name" or "org/name" (letters, digits, '-', '_', '.'), not starting with '.' or '-'.
HUB_ID = re.compile(r"[A-Za-z0-9_][\w.-]*(/[A-Za-z0-9_][\w.-]*)?")


def resolve_source(spec: str | None, dtype: torch.dtype = torch.float32) -> str | None:
    """What transformers loads for a model spec: a local checkpoint folder, a .gguf file or a folder
    holding only one (converted once, `gguf.py`), a catalog name such as smollm2-135m (fetched
    once, `catalog.py`), or a hub id; "random:<spec>" resolves <spec>. A local path that does not
    exist is a ValueError, not a hub lookup."""
    if spec is None:
        return None
    from . import catalog, gguf

    spec = spec.removeprefix("random:")
    if spec in catalog.MODELS:
        return str(catalog.fetch(spec))
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(gguf.checkpoint_for(path, dtype))
    if path.is_dir():
        inside = gguf.gguf_in_folder(path)
        return str(gguf.checkpoint_for(inside, dtype)) if inside is not None else str(path)
    if path.exists():
        raise ValueError(f"model {spec!r} is a file but not a .gguf one; give a checkpoint folder or a .gguf file")
    if spec.endswith(".gguf") or not HUB_ID.fullmatch(spec):
        raise ValueError(f"model {spec!r} does not exist: give a local checkpoint folder, a .gguf file, a hub id "
                         f"(org/name) or a known model ({', '.join(catalog.MODELS)}; see `batchspec models`)")
    return spec  # a hub id


def _tokenizer(auto, source: str, spec: str, role: str):
    from .gguf import first_line

    try:
        return auto.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load the {role} tokenizer of {spec!r}: {first_line(exc)}") from None
