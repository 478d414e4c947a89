"""Hugging Face transformers as the peer: what users run today, on the same models and prompts.

hf_generate   plain batched `model.generate` on left-padded batches of B prompts
hf_assisted   assisted generation (`generate(assistant_model=draft)`) with a constant γ;
              transformers allows it at batch size 1 only
Tokens are counted as for our methods: up to and including the first EOS, capped.
"""

from __future__ import annotations

import copy
import time

import torch

PEERS = ("hf_generate", "hf_assisted")


def count_tokens(generated: list[int], eos: tuple[int, ...], cap: int) -> list[int]:
    """The part of a peer's output our methods would have produced: up to the first EOS, capped."""
    out = []
    for tok in generated[:cap]:
        out.append(tok)
        if tok in eos:
            break
    return out


def _config(params, eos, pad, **extra):
    from transformers import GenerationConfig

    sample = not params.greedy
    kwargs = dict(do_sample=sample, max_new_tokens=params.max_new_tokens, eos_token_id=list(eos) or None,
                  pad_token_id=pad, **extra)
    if sample:
        kwargs.update(temperature=params.temperature, top_k=params.top_k or None, top_p=params.top_p)
    return GenerationConfig(**kwargs)


def pad_id(pair) -> int:
    """A pad id the model can embed (transformers feeds pad ids to finished rows)."""
    pad = pair.tokenizer.pad_token_id if pair.tokenizer is not None else None
    if pad is None or pad >= pair.vocab_size:
        pad = pair.eos_token_ids[0] if pair.eos_token_ids else 0
    return pad


def hf_generate(pair, prompts: list[list[int]], params, batch_size: int) -> tuple[list[list[int]], float]:
    """Plain greedy/sampled generate over left-padded batches; returns (outputs, seconds)."""
    pad = pad_id(pair)
    config = _config(params, pair.eos_token_ids, pad)
    device = pair.target.device
    batches = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        batches.append((ids, mask))
    outputs: list[list[int]] = []
    start = time.perf_counter()
    with torch.no_grad():
        for ids, mask in batches:
            out = pair.target.generate(input_ids=ids, attention_mask=mask, generation_config=config)
            outputs.extend(row[ids.shape[1]:].tolist() for row in out)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    return [count_tokens(o, pair.eos_token_ids, params.max_new_tokens) for o in outputs], seconds


def hf_assisted(pair, prompts: list[list[int]], params, gamma: int) -> tuple[list[list[int]], float]:
    """Assisted generation, one prompt at a time, with exactly `gamma` draft tokens per round."""
    if pair.draft is None:
        raise ValueError("hf_assisted needs a draft model")
    pad = pad_id(pair)
    config = _config(params, pair.eos_token_ids, pad)
    draft = pair.draft
    saved = copy.deepcopy(draft.generation_config)
    draft.generation_config.num_assistant_tokens = gamma
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0  # no early stop: a fixed γ, like ours
    device = pair.target.device
    outputs = []
    try:
        start = time.perf_counter()
        with torch.no_grad():
            for p in prompts:
                ids = torch.tensor([p], device=device)
                out = pair.target.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                           generation_config=config, assistant_model=draft)
                outputs.append(out[0, len(p):].tolist())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
    finally:
        draft.generation_config = saved
    return [count_tokens(o, pair.eos_token_ids, params.max_new_tokens) for o in outputs], seconds
