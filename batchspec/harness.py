"""The correctness harness behind `batchspec verify`: greedy output must equal the reference.

The reference is target-only greedy decoding at batch size 1, prompt by prompt. Each method
at each batch size is compared with it token id by token id:

    exact_match    share of prompts whose whole output is identical
    partial_match  mean share of reference tokens matched before the first divergence
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .config import EngineConfig
from .engine import SpecEngine
from .models import ModelPair
from .sampling import SamplingParams


def reference_outputs(pair: ModelPair, prompts: list[list[int]], params: SamplingParams,
                      forward: str = "auto") -> list[list[int]]:
    """Target-only greedy output of every prompt, run alone (batch size 1)."""
    engine = SpecEngine(pair, EngineConfig(method="autoregressive", batch_size=1, forward=forward))
    return [engine.generate([ids], params)[0].token_ids for ids in prompts]


def match_scores(outputs: list[list[int]], references: list[list[int]]) -> tuple[float, float]:
    """(exact-match rate, partial-match rate) of outputs against references."""
    exact, partial = 0, 0.0
    for out, ref in zip(outputs, references):
        exact += out == ref
        common = 0
        for a, b in zip(out, ref):
            if a != b:
                break
            common += 1
        partial += common / len(ref) if ref else float(out == ref)
    n = max(1, len(references))
    return exact / n, partial / n


def hf_generate_greedy(model, ids: list[int], params: SamplingParams, eos: tuple[int, ...], pad_id: int) -> list[int]:
    """transformers' own greedy `generate` on one prompt (plain config: no penalties, no filters)."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=params.max_new_tokens,
                              eos_token_id=list(eos) or None, pad_token_id=pad_id)
    input_ids = torch.tensor([ids], device=model.device)
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                             generation_config=config)
    return out[0, len(ids):].tolist()


def check_reference_against_hf(pair: ModelPair, prompts: list[list[int]], references: list[list[int]],
                               params: SamplingParams) -> dict:
    """Does our reference equal transformers' `generate(do_sample=False)` token for token?"""
    pad = pair.tokenizer.pad_token_id if pair.tokenizer is not None else None
    if pad is None or pad >= pair.vocab_size:
        pad = pair.eos_token_ids[0] if pair.eos_token_ids else 0
    hf = [hf_generate_greedy(pair.target, ids, params, pair.eos_token_ids, pad) for ids in prompts]
    exact, partial = match_scores(references, hf)
    return {"prompts": len(prompts), "exact_match": exact, "partial_match": partial, "identical": exact == 1.0}


def run_equivalence(
    pair: ModelPair,
    prompts: list[list[int]],
    methods: list[str],
    batch_sizes: list[int],
    gamma: int,
    params: SamplingParams,
    *,
    drafter: str = "draft_model",
    window: int | None = None,
    forward: str = "auto",
    references: list[list[int]] | None = None,
    on_result: Callable[[dict], None] | None = None,
    engine_options: dict | None = None,
) -> list[dict]:
    """Compare every method x batch size with the reference; one result dict per cell, with the
    draft tokens the cell verified (drafted) and accepted. `engine_options` (the other EngineConfig
    fields: refill, max_kv_tokens, ...) go to every EngineConfig."""
    if not params.greedy:
        raise ValueError("output equivalence is defined for greedy decoding (temperature 0)")
    references = references if references is not None else reference_outputs(pair, prompts, params, forward)
    ref_map = {tuple(p): r for p, r in zip(prompts, references)}
    results = []
    for method in methods:
        for bs in batch_sizes:
            config = EngineConfig(method=method, batch_size=bs, gamma=gamma, drafter=drafter,
                                  window=window if method == "exspec" else None, forward=forward,
                                  **(engine_options or {}))
            engine = SpecEngine(pair, config)
            outs = engine.generate(prompts, params, references=ref_map)
            exact, partial = match_scores([o.token_ids for o in outs], references)
            summary = engine.last_run.summary()
            row = {
                "method": method, "batch_size": bs, "num_prompts": len(prompts), "exact_match": exact,
                "partial_match": partial, "gamma": gamma if config.speculative else None,
                "drafter": engine.drafter.label if engine.drafter is not None else None,
                "acceptance_rate": summary["acceptance_rate"], "drafted": summary["drafted"],
                "accepted": summary["accepted"],
            }
            results.append(row)
            if on_result is not None:
                on_result(row)
    return results


def divergence_note(results: list[dict], dtype: torch.dtype) -> str | None:
    """What a greedy divergence from the batch-1 reference means, given the dtype (None: none).

    In float64 it is a bug. Below it, a batched pass may round differently from a pass of one row
    (other matrix kernels, tilings, reduction orders), so plain decoding at that batch size may
    diverge too: where `autoregressive` ran at the diverging batch sizes its result tells, and
    float64 settles it either way. On an H200 in bfloat16, plain decoding at batch 32 diverged on
    1 prompt of 16, and eqspec on as many; in float32 neither did.

    >>> r = [{"method": "autoregressive", "batch_size": 8, "exact_match": 0.9},
    ...      {"method": "eqspec", "batch_size": 8, "exact_match": 0.9}]
    >>> print(divergence_note(r, torch.bfloat16))  # doctest: +ELLIPSIS
    divergence in bfloat16 at batch sizes 8: autoregressive (plain decoding, no speculation) diverges at 8 too, ...
    """
    off = [r for r in results if r["exact_match"] < 1.0]
    if not off:
        return None
    sizes = sorted({r["batch_size"] for r in off})
    if dtype == torch.float64:
        return f"divergence in float64 at batch sizes {', '.join(map(str, sizes))}: a bug, not rounding"
    plain = {r["batch_size"]: r["exact_match"] for r in results if r["method"] == "autoregressive"}
    head = f"divergence in {str(dtype).removeprefix('torch.')} at batch sizes {', '.join(map(str, sizes))}: "
    spec_sizes = sorted({r["batch_size"] for r in off if r["method"] != "autoregressive"})
    if not spec_sizes:
        return head + ("only plain decoding (autoregressive) diverges, no speculative method does: the batched "
                       "pass's rounding in this dtype, or a bug in batched plain decoding; --dtype float64 tells.")
    if not all(bs in plain for bs in spec_sizes):
        return head + ("add autoregressive to --methods to see whether plain decoding diverges there too "
                       "(the dtype's rounding), or rerun with --dtype float64 (a divergence there is a bug).")
    plain_off = [bs for bs in spec_sizes if plain[bs] < 1.0]
    if plain_off == spec_sizes:
        return head + (f"autoregressive (plain decoding, no speculation) diverges at {', '.join(map(str, plain_off))} "
                       "too, so the dtype's rounding at those batch sizes accounts for it. Rerun with --dtype "
                       "float64 to be sure.")
    return head + ("plain decoding does not diverge at every one of them, so speculation may be at fault: rerun "
                   "with --dtype float64 (a divergence there is a bug).")


# ---------------------------------------------------------------------------------------- sampling
def warped_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Target probabilities under transformers' own warpers (independent of batchspec's sampling code)."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = logits.float()
    warpers = [TemperatureLogitsWarper(params.temperature)]
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1:
        warpers.append(TopPLogitsWarper(params.top_p))
    for w in warpers:
        scores = w(None, scores)
    return torch.softmax(scores, -1)


@torch.no_grad()
def exact_first_two(pair: ModelPair, prompt: list[int], params: SamplingParams, top: int) -> dict:
    """Exact P(t1, t2) of target-only sampling on the `top` most likely t1 and, for each, the `top`
    most likely t2; everything else is one "other" bin. Returns {(t1, t2) or "other": p}."""
    model, vocab = pair.target, pair.vocab_size
    p1 = warped_probs(model(torch.tensor([prompt], device=model.device)).logits[0, -1, :vocab], params)
    firsts = p1.topk(min(top, vocab)).indices.tolist()
    prefixes = torch.tensor([prompt + [t] for t in firsts], device=model.device)
    p2 = warped_probs(model(prefixes).logits[:, -1, :vocab], params)
    bins = {}
    for row, t1 in enumerate(firsts):
        for t2 in p2[row].topk(min(top, vocab)).indices.tolist():
            bins[(t1, t2)] = float(p1[t1] * p2[row, t2])
    bins["other"] = max(0.0, 1.0 - sum(bins.values()))
    return bins


def distribution_check(pair: ModelPair, prompts: list[list[int]], params: SamplingParams, *, method: str,
                       batch_size: int, gamma: int, samples: int = 2000, top: int = 6, delta: float = 1e-3,
                       seed: int = 0, engine_options: dict | None = None) -> list[dict]:
    """Sample the first two tokens `samples` times per prompt with a speculative method and compare
    their empirical distribution with the target's exact one.

    distance: total variation over the bins of `exact_first_two`; bound: with probability 1 - delta
    an exact sampler stays below sqrt((K ln 2 + ln(1/delta)) / (2 N)) for K bins and N samples
    (Bretagnolle-Huber-Carol); p_value: chi-square goodness of fit.
    """
    import math

    from scipy.stats import chisquare

    from .sampling import request_seed

    if params.greedy:
        raise ValueError("the distribution check needs --temperature > 0")
    engine = SpecEngine(pair, EngineConfig(method=method, batch_size=batch_size, gamma=gamma, **(engine_options or {})))
    rows = []
    for k, prompt in enumerate(prompts):
        exact = exact_first_two(pair, prompt, params, top)
        sp = [SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                             max_new_tokens=2 + gamma, ignore_eos=True, seed=request_seed(seed, k * samples + i))
              for i in range(samples)]  # 2 + γ tokens: the first round drafts the full γ
        counts = dict.fromkeys(exact, 0)
        for out in engine.generate([prompt] * samples, sp):
            key = tuple(out.token_ids[:2])
            counts[key if key in counts else "other"] += 1
        keys = list(exact)
        distance = 0.5 * sum(abs(counts[b] / samples - exact[b]) for b in keys)
        bound = math.sqrt((len(keys) * math.log(2) + math.log(1 / delta)) / (2 * samples))
        big = [b for b in keys if exact[b] * samples >= 5]
        small = [b for b in keys if b not in big]
        obs = [counts[b] for b in big] + ([sum(counts[b] for b in small)] if small else [])
        exp = [exact[b] * samples for b in big] + ([sum(exact[b] for b in small) * samples] if small else [])
        scale = sum(obs) / sum(exp)
        p_value = float(chisquare(obs, [e * scale for e in exp]).pvalue) if len(obs) > 1 else 1.0
        rows.append({"prompt": k, "samples": samples, "bins": len(keys), "distance": distance, "bound": bound,
                     "p_value": p_value, "passed": distance <= bound,
                     **{k: engine.last_run.summary()[k] for k in ("acceptance_rate", "drafted", "accepted")}})
    return rows
