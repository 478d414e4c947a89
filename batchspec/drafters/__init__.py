"""Drafters behind one protocol (base.py), built from a spec string "name[:args]" by a registry.

The registry is data: one `DrafterSpec` per name says how to read its arguments, how to build
it, whether it needs the draft model, and whether it is synthetic. The CLI help, the errors and
the engine's "load a draft model?" question all read it.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from . import hybrid, ngram, suffix
from .base import Drafter, DraftProposal, RoundOutcome
from .hybrid import HybridDrafter
from .model import DraftModelDrafter
from .ngram import NgramDrafter
from .oracle import OracleDrafter, bernoulli_mismatch
from .suffix import SuffixDrafter


@dataclass(frozen=True)
class BuildContext:
    """What the engine hands a drafter's builder."""

    draft_runner: Any  # ModelRunner of the draft model, or None
    device: Any
    vocab_size: int
    references: MutableMapping[tuple[int, ...], list[int]] | None = None
    seed: int = 0
    compute_reference: Callable | None = None
    draft_window: int | None = None  # the draft model's window (drafters/model.py)
    forward: str = "auto"  # how the models run (EngineConfig.forward), for the drafter's step probe
    target: Any = None  # the target model (an EAGLE head borrows its embeddings and LM head)
    head: str | None = None  # the head batchspec ships for this target (catalog.known_head), if any

    def draft_model(self) -> DraftModelDrafter:
        return DraftModelDrafter(self.draft_runner, self.draft_window, self.forward)


@dataclass(frozen=True)
class DrafterSpec:
    usage: str  # how the CLI writes it
    help: str
    parse: Callable[[str, str], Any]  # (argument text after ':', whole spec) -> options; raises ValueError
    build: Callable[[Any, BuildContext], Drafter]
    # "required"; "wanted" (loaded for it with the bundled pair; without one it runs a model-free part alone);
    # "optional" (used for its cost when present); or "unused"
    draft_model: str
    synthetic: bool = False  # knows the answer: reports must say so


def _numbers(arg: str, spec: str, usage: str, defaults: tuple, check: Callable[[tuple], bool], rule: str) -> tuple:
    """'2,4' with defaults (1, 3, 10) -> (2, 4, 10): a prefix of comma-separated numbers, each of
    its default's type."""
    parts = arg.split(",") if arg else []
    try:
        if len(parts) > len(defaults):
            raise ValueError
        values = tuple(type(d)(p) for d, p in zip(defaults, parts)) + defaults[len(parts):]
    except ValueError:
        values = None
    if values is None or not check(values):
        raise ValueError(f"drafter {spec!r}: expected {usage} with {rule}; e.g. {usage.split('[')[0]}:"
                         f"{','.join(f'{d:g}' if isinstance(d, float) else str(d) for d in defaults)}")
    return values


def _no_args(name: str) -> Callable[[str, str], None]:
    def parse(arg: str, spec: str) -> None:
        if arg:
            raise ValueError(f"drafter {name!r} takes no arguments; got {spec!r}")
    return parse


def _oracle_prob(arg: str, spec: str) -> float:
    try:
        prob = float(arg)
    except ValueError:
        prob = -1.0
    if not 0.0 <= prob <= 1.0:
        raise ValueError(f"oracle drafter needs an acceptance probability in [0, 1], e.g. oracle:0.7; got {spec!r}")
    return prob


def _ngram_args(defaults: tuple[int, int, int], usage: str) -> Callable[[str, str], tuple]:
    return lambda arg, spec: _numbers(arg, spec, usage, defaults, lambda v: 1 <= v[0] <= v[1] and v[2] >= 1,
                                      "1 <= min_n <= max_n and k >= 1")


def _suffix_args(arg: str, spec: str) -> tuple:
    usage = "suffix[:depth,k,min_prob,max_tokens]"
    return _numbers(arg, spec, usage, (suffix.DEPTH, suffix.K, suffix.MIN_PROB, suffix.MAX_TOKENS),
                    lambda v: v[1] >= 1 and v[0] > v[1] and 0.0 <= v[2] <= 1.0 and v[3] >= 0,
                    "depth > k >= 1, min_prob in [0, 1] and max_tokens >= 0")


def missing_draft(drafter: str) -> str:
    """The error for a drafter that requires a draft model when none is loaded."""
    return (f"drafter {drafter!r} needs a draft model and none is loaded: give one (--draft, a model sharing the "
            "target's tokenizer), or use a model-free drafter (--drafter ngram or --drafter suffix), or decode "
            "without speculation (--method autoregressive)")


def _build_draft_model(_, ctx: BuildContext) -> Drafter:
    if ctx.draft_runner is None:
        raise ValueError(missing_draft("draft_model"))
    return ctx.draft_model()


def _build_oracle(prob: float, ctx: BuildContext) -> Drafter:
    if ctx.references is None and ctx.compute_reference is None:
        raise ValueError("the oracle drafter needs the target's reference outputs or a way to compute them")
    cost = ctx.draft_model() if ctx.draft_runner is not None else None
    label = f"oracle:{prob:g} (synthetic{', draft-model cost' if cost else ', zero draft cost'})"
    return OracleDrafter(ctx.references if ctx.references is not None else {}, bernoulli_mismatch(prob, ctx.seed),
                         ctx.vocab_size, ctx.device, cost, label, ctx.compute_reference)


def _head_path(arg: str, spec: str) -> str:
    return arg  # '' : the head batchspec ships for the target


def _build_eagle(path: str, ctx: BuildContext) -> Drafter:
    from ..eagle.formats import load_head
    from .eagle import EagleDrafter, auto_dtype

    if ctx.target is None:
        raise ValueError("an EAGLE head needs the target model it drafts for")
    path = path or ctx.head
    if not path:
        raise ValueError("drafter 'eagle' needs a head: eagle:<dir>, a folder in the speculators, EAGLE-1 or EAGLE-3 "
                         "layout (`batchspec train-draft --target T --out DIR` makes one); batchspec ships one "
                         "only for smollm2-135m")
    head = load_head(path, ctx.target)
    return EagleDrafter(head, ctx.vocab_size, auto_dtype(head))


LOOKUPS = ("ngram", "suffix")  # the model-free drafters a hybrid can be built on


def _hybrid_args(arg: str, spec: str) -> tuple[str, Any, str | None]:
    """(lookup, its options, the model part's spec or None). '' -> the default lookup;
    'suffix:16' or 'ngram:2,4' -> that lookup; '2,4,10' -> ngram with those numbers (the older
    form); '<lookup>+eagle[:<dir>]' or 'eagle[:<dir>]' -> that lookup (or the default) and a head."""
    lookup, plus, model = arg.partition("+")
    if not plus and arg.partition(":")[0] == "eagle":
        lookup, model = "", arg
    if plus and model.partition(":")[0] != "eagle":
        raise ValueError(f"drafter {spec!r}: the part after '+' must be an EAGLE head, eagle[:<dir>]")
    if not lookup:
        lookup = hybrid.LOOKUP
    elif lookup[0].isdigit():
        lookup = f"ngram:{lookup}"
    name = lookup.partition(":")[0]
    if name not in LOOKUPS:
        raise ValueError(f"drafter {spec!r}: a hybrid is built on one of {', '.join(LOOKUPS)}, e.g. "
                         f"hybrid:ngram:2,4,10, hybrid:suffix or hybrid:suffix+eagle:<dir>")
    return name, parse_drafter(lookup)[1], (model or None)


def _build_hybrid(args: tuple[str, Any, str | None], ctx: BuildContext) -> Drafter:
    """The lookup and a model part: the head it names, else the draft model, else the head batchspec
    ships for the target (catalog.known_head); with none of them (a target given alone), the lookup
    alone: what the hybrid does on every row the lookup matches, and plain decoding elsewhere."""
    name, options, model = args
    lookup = REGISTRY[name].build(options, ctx)
    if model is not None:
        return HybridDrafter(REGISTRY["eagle"].build(model.partition(":")[2], ctx), lookup)
    if ctx.draft_runner is not None:
        return HybridDrafter(ctx.draft_model(), lookup)
    if ctx.head is not None and ctx.target is not None:
        return HybridDrafter(REGISTRY["eagle"].build(ctx.head, ctx), lookup)
    return lookup


REGISTRY: dict[str, DrafterSpec] = {
    "draft_model": DrafterSpec("draft_model", "the draft model (default)", _no_args("draft_model"),
                               _build_draft_model, "required"),
    "ngram": DrafterSpec("ngram[:min_n,max_n,k]",
                         f"prompt lookup, no model: copy what followed the newest n-gram's last occurrence "
                         f"(default {ngram.MIN_N},{ngram.MAX_N},{ngram.K})",
                         _ngram_args((ngram.MIN_N, ngram.MAX_N, ngram.K), "ngram[:min_n,max_n,k]"),
                         lambda args, ctx: NgramDrafter(ctx.device, *args), "unused"),
    "suffix": DrafterSpec("suffix[:depth,k,min_prob,max_tokens]",
                          "suffix decoding, no model: most frequent continuation over this and earlier requests",
                          _suffix_args, lambda args, ctx: SuffixDrafter(ctx.device, *args), "unused"),
    "hybrid": DrafterSpec("hybrid[:suffix[:...]|ngram[:...]][+eagle[:<dir>]]",
                          f"{hybrid.LOOKUP} where it has a match, a model for the other rows where it pays: the "
                          "head named after '+', else the draft model, else the head batchspec ships for the "
                          f"target (default hybrid:{hybrid.LOOKUP}); the lookup alone without any",
                          _hybrid_args, _build_hybrid, "wanted"),
    "eagle": DrafterSpec("eagle[:<dir>]", "an EAGLE draft head over the target's own hidden states (speculators, "
                         "EAGLE-1 or EAGLE-3 layout; `batchspec train-draft` trains one; without a folder, the one "
                         "batchspec ships for the target)", _head_path, _build_eagle,
                         "unused"),
    "oracle": DrafterSpec("oracle:<p>", "synthetic, knows the target's output: for overhead studies",
                          _oracle_prob, _build_oracle, "optional", synthetic=True),
}
DRAFTERS = tuple(s.usage for s in REGISTRY.values())


def drafter_spec(spec: str) -> DrafterSpec:
    name = spec.partition(":")[0]
    if name not in REGISTRY:
        raise ValueError(f"unknown drafter {spec!r}; choose one of {', '.join(DRAFTERS)}")
    return REGISTRY[name]


def parse_drafter(spec: str) -> tuple[str, Any]:
    """'draft_model' -> ('draft_model', None); 'oracle:0.7' -> ('oracle', 0.7);
    'ngram:2,4' -> ('ngram', (2, 4, 16)). Raises ValueError saying what is accepted."""
    name, _, arg = spec.partition(":")
    return name, drafter_spec(spec).parse(arg, spec)


def drafter_needs_model(spec: str) -> bool:
    """Should a draft model be loaded for this drafter (the bundled draft with the bundled target)?
    Raises ValueError for a bad spec."""
    parse_drafter(spec)
    return drafter_spec(spec).draft_model in ("required", "wanted")


def drafter_requires_model(spec: str) -> bool:
    """Can this drafter not run at all without a draft model?"""
    parse_drafter(spec)
    return drafter_spec(spec).draft_model == "required"


def drafter_uses_model(spec: str) -> bool:
    """Does this drafter use the draft model when one is loaded?"""
    parse_drafter(spec)
    return drafter_spec(spec).draft_model != "unused"


def split_drafters(text: str) -> list[str]:
    """A comma-separated list of specs whose arguments may hold commas too: a piece that names no
    drafter continues the previous spec. 'draft_model,ngram:2,4,10,suffix' ->
    ['draft_model', 'ngram:2,4,10', 'suffix']."""
    specs: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if specs and ":" in specs[-1] and piece.partition(":")[0] not in REGISTRY:
            specs[-1] += "," + piece
        elif piece:
            specs.append(piece)
    return specs


def make_drafter(spec: str, *, draft_runner, device, vocab_size: int,
                 references: MutableMapping[tuple[int, ...], list[int]] | None = None, seed: int = 0,
                 compute_reference: Callable | None = None, draft_window: int | None = None,
                 forward: str = "auto", target=None, head: str | None = None) -> Drafter:
    _, args = parse_drafter(spec)
    ctx = BuildContext(draft_runner, device, vocab_size, references, seed, compute_reference, draft_window, forward,
                       target, head)
    return drafter_spec(spec).build(args, ctx)


__all__ = ["DRAFTERS", "REGISTRY", "DraftModelDrafter", "DraftProposal", "Drafter", "DrafterSpec", "HybridDrafter",
           "RoundOutcome",
           "NgramDrafter", "OracleDrafter", "SuffixDrafter", "drafter_needs_model", "drafter_requires_model",
           "drafter_spec", "drafter_uses_model", "make_drafter", "missing_draft", "parse_drafter",
           "split_drafters"]
