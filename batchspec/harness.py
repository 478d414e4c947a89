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


def reference_outputs(pair: ModelPair, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Target-only greedy output of every prompt, run alone (batch size 1)."""
    engine = SpecEngine(pair, EngineConfig(method="autoregressive", batch_size=1))
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
    references: list[list[int]] | None = None,
    on_result: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Compare every method x batch size with the reference; one result dict per cell."""
    if not params.greedy:
        raise ValueError("output equivalence is defined for greedy decoding (temperature 0)")
    references = references if references is not None else reference_outputs(pair, prompts, params)
    ref_map = {tuple(p): r for p, r in zip(prompts, references)}
    results = []
    for method in methods:
        for bs in batch_sizes:
            config = EngineConfig(method=method, batch_size=bs, gamma=gamma, drafter=drafter,
                                  window=window if method == "exspec" else None)
            engine = SpecEngine(pair, config)
            outs = engine.generate(prompts, params, references=ref_map)
            exact, partial = match_scores([o.token_ids for o in outs], references)
            summary = engine.stats.summary()
            row = {
                "method": method, "batch_size": bs, "num_prompts": len(prompts), "exact_match": exact,
                "partial_match": partial, "gamma": gamma if config.speculative else None,
                "drafter": engine.drafter.label if engine.drafter is not None else None,
                "acceptance_rate": summary["acceptance_rate"],
            }
            results.append(row)
            if on_result is not None:
                on_result(row)
    return results
