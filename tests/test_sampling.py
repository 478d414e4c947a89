"""Sampling is lossless: speculative sampling draws from exactly the target's distribution.

The exact distribution of the first tokens is computed by enumeration on a tiny-vocabulary
model with transformers' own logits warpers (independent of batchspec's sampling code), and many seeded
samples from the engine are compared with it by a chi-square test at a fixed seed. Three
deliberately broken verifiers are kept as negative controls: each must fail the same test.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
from scipy.stats import chisquare
from tiny import perturbed
from transformers import LlamaConfig, LlamaForCausalLM

import batchspec.decode.round as round_module
from batchspec import EngineConfig, ModelPair, SamplingParams, SpecEngine
from batchspec.harness import warped_probs  # transformers' warpers, not batchspec's sampling code
from batchspec.sampling import request_seed, sample
from batchspec.verify.rejection import VerifyResult, rejection_verify

V = 8
PROMPT = [3, 1, 4, 1, 5]
N = 6000
ALPHA = 1e-4  # the fixed-seed tests pass far above this; broken variants land far below


@functools.cache
def models():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.08)
    target = LlamaForCausalLM(cfg).eval()
    return target, perturbed(target, 0.6, seed=5)


@torch.no_grad()
def exact_joint(sp: SamplingParams, prompt: list[int] = PROMPT) -> torch.Tensor:
    """P(t1, t2) under the target alone: [V, V]."""
    target, _ = models()
    p1 = warped_probs(target(torch.tensor([prompt])).logits[:, -1], sp)[0]
    prefixes = torch.tensor([prompt + [t] for t in range(V)])
    p2 = warped_probs(target(prefixes).logits[:, -1], sp)
    return p1[:, None] * p2


def samples(sp: SamplingParams, method: str, batch_size: int, gamma: int, seed: int = 0, **config) -> torch.Tensor:
    return sampled(sp, method, batch_size, gamma, seed, **config)[0]


def sampled(sp: SamplingParams, method: str, batch_size: int, gamma: int, seed: int = 0, seeded: bool = True,
            prompt: list[int] = PROMPT, **config) -> tuple[torch.Tensor, SpecEngine]:
    """N samples of (t1, t2) from the engine, [N, 2], and the engine. Each request generates 2 + γ tokens so that
    its first round drafts the full γ (a row drafts no more than it can still emit). seeded=False:
    requests without a seed (a policy plans their draft lengths; a seeded row is held at fixed γ),
    made repeatable by seeding Python's generator, which draws their generators' seeds."""
    target, draft = models()
    config.setdefault("adaptive", False)  # fixed γ unless a test asks for the policy
    config.setdefault("drafter", "draft_model")
    engine = SpecEngine(ModelPair(target, draft, None, V, ()),
                        EngineConfig(method=method, batch_size=batch_size, gamma=gamma, **config))
    params = [SamplingParams(temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, max_new_tokens=2 + gamma,
                             seed=request_seed(seed, i) if seeded else None) for i in range(N)]
    random.seed(seed)
    outs = engine.generate([prompt] * N, params)
    return torch.tensor([o.token_ids[:2] for o in outs]), engine


def chi_square(observed: torch.Tensor, expected_p: torch.Tensor) -> float:
    """p-value of a chi-square goodness-of-fit test; bins expected below 5 are pooled."""
    counts = torch.bincount(observed[:, 0] * V + observed[:, 1], minlength=V * V).double()
    expected = expected_p.flatten().double() * len(observed)
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


CASES = [
    pytest.param(SamplingParams(temperature=1.0), "eqspec", 16, 3, marks=pytest.mark.slow),
    pytest.param(SamplingParams(temperature=0.7, top_k=4), "exspec", 8, 2, marks=pytest.mark.slow),
    (SamplingParams(temperature=1.3, top_p=0.8), "eqspec", 32, 1),
    pytest.param(SamplingParams(temperature=1.0, top_k=5, top_p=0.9), "exspec", 16, 4, marks=pytest.mark.slow),
    pytest.param(SamplingParams(temperature=1.0), "autoregressive", 16, 1, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("sp, method, bs, gamma", CASES)
def test_speculative_sampling_matches_the_target(sp, method, bs, gamma):
    draws = samples(sp, method, bs, gamma)
    assert chi_square(draws, exact_joint(sp)) > ALPHA


@pytest.mark.slow
def test_an_eagle_head_samples_the_target(tmp_path):
    """A random EAGLE-3 head drafting over 5 of the 8 ids (q = 0 for the other 3) from the target's
    own features: rejection sampling with its q still draws the target's distribution."""
    from batchspec.eagle.formats import save_head
    from batchspec.eagle.head import new_head

    target, _ = models()
    head = new_head(target, "eagle3", draft_vocab=5, seed=2, vocab_ids=torch.tensor([0, 2, 3, 5, 7]))
    save_head(head, tmp_path)
    sp = SamplingParams(temperature=1.0)
    draws, engine = sampled(sp, "eqspec", 16, 2, drafter=f"eagle:{tmp_path}")
    assert engine.stats.drafted > 0 and 0 < engine.stats.accepted < engine.stats.drafted
    assert chi_square(draws, exact_joint(sp)) > ALPHA


@pytest.mark.slow
def test_tetris_budget_sampling_matches_the_target():
    """A TETRIS budget of 20 verified drafts over 16 rows drafting 3 each: rows verify 0..3 (the
    requests carry no seed, so the budget is theirs to cut)."""
    draws, engine = sampled(SamplingParams(temperature=1.0), "eqspec", 16, 3, seeded=False, budget=20)
    stats = engine.stats
    assert stats.drafted <= 20 * stats.rounds and stats.gamma_hist[1] + stats.gamma_hist[2] > 0
    assert chi_square(draws, exact_joint(SamplingParams(temperature=1.0))) > ALPHA


@pytest.mark.slow
def test_a_windowed_draft_model_samples_the_target():
    """A 12-token prompt and a draft window of 1: the draft model drafts from the prompt's first 4
    tokens and its last (drafters/model.py), a q of its own, and rejection sampling still draws
    the target's distribution."""
    prompt = [3, 1, 4, 1, 5, 0, 2, 6, 5, 3, 5, 7]
    sp = SamplingParams(temperature=1.0)
    draws, engine = sampled(sp, "eqspec", 16, 3, prompt=prompt, draft_window=1)
    assert 0 < engine.stats.accepted < engine.stats.drafted
    assert chi_square(draws, exact_joint(sp, prompt)) > ALPHA


def test_acceptance_is_ragged_in_the_sampling_tests():
    target, draft = models()
    engine = SpecEngine(ModelPair(target, draft, None, V, ()), EngineConfig(drafter="draft_model",
                                                                            method="eqspec", batch_size=16, gamma=3))
    engine.generate([PROMPT] * 256, [SamplingParams(temperature=1.0, max_new_tokens=5, seed=i) for i in range(256)])
    hist = engine.stats.accept_hist
    assert hist[0] > 0 and hist[1] > 0 and 0.2 < engine.stats.accepted / engine.stats.drafted < 0.9


# ---------------------------------------------------------------------------- negative controls
def bonus_from_draft(p, q, drafts, u_accept, u_final, lengths=None):
    """The bug of several public implementations: the final token comes from the draft's q."""
    res = rejection_verify(p, q, drafts, u_accept, u_final, lengths)
    if q is None:  # a round without drafts (rows about to finish): nothing to get wrong
        return res
    rows = torch.arange(len(drafts))
    j = res.accepted.clamp(max=drafts.shape[1] - 1)
    tokens = res.tokens.clone()
    tokens[rows, res.accepted] = sample(q[rows, j], u_final)
    return VerifyResult(res.accepted, tokens)


def _redraw_recovered(p, q, drafts, u_accept, u_final, lengths, draw):
    """The correct verifier, except that each recovered token is `draw(p - q, u)` instead."""
    res = rejection_verify(p, q, drafts, u_accept, u_final, lengths)
    if q is None:
        return res
    rows = torch.arange(len(drafts))
    gamma = drafts.shape[1]
    j = res.accepted.clamp(max=gamma - 1)
    wrong = draw(p[rows, j] - q[rows, j], u_final)
    tokens = res.tokens.clone()
    rejected = res.accepted < (lengths if lengths is not None else gamma)
    tokens[rows[rejected], res.accepted[rejected]] = wrong[rejected]
    return VerifyResult(res.accepted, tokens)


def residual_unclamped(p, q, drafts, u_accept, u_final, lengths=None):
    """Recovered token drawn from p - q without max(0, .)."""
    return _redraw_recovered(p, q, drafts, u_accept, u_final, lengths, sample)


def residual_unnormalised(p, q, drafts, u_accept, u_final, lengths=None):
    """Recovered token drawn by inverse CDF from the residual as if it summed to 1."""
    def draw(residual, u):
        cdf = residual.clamp(min=0).cumsum(-1).contiguous()
        return torch.searchsorted(cdf, u.unsqueeze(-1).contiguous(), right=True).squeeze(-1).clamp(max=V - 1)
    return _redraw_recovered(p, q, drafts, u_accept, u_final, lengths, draw)


@pytest.mark.slow  # (the statistical test itself, sp2 above, is in the fast tier)
@pytest.mark.parametrize("broken", [bonus_from_draft, residual_unclamped, residual_unnormalised])
def test_broken_verifiers_fail_the_same_test(monkeypatch, broken):
    monkeypatch.setattr(round_module, "rejection_verify", broken)
    sp = SamplingParams(temperature=1.0)
    assert chi_square(samples(sp, "eqspec", 16, 3), exact_joint(sp)) < 1e-6


# ---------------------------------------------------------------------------- seeds and greedy
@pytest.mark.parametrize("policy", [{}, *(pytest.param(p, marks=pytest.mark.slow) for p in
                                         (dict(adaptive=True), dict(budget=4), dict(adaptive=True, budget=6)))])
def test_seeded_output_does_not_depend_on_the_batch(policy):
    """With a policy (adaptive lengths, a TETRIS budget) seeded sampled rows are held at fixed γ,
    so they give what they give alone; the greedy and unseeded rows beside them are planned."""
    target, draft = models()
    pair = ModelPair(target, draft, None, V, ())
    mine = [SamplingParams(temperature=1.0, top_k=6, max_new_tokens=12, seed=100 + i) for i in range(6)]
    prompts = [PROMPT[: 1 + i % 5] for i in range(6)]
    alone = [SpecEngine(pair, EngineConfig(drafter="draft_model", method="eqspec", batch_size=1, gamma=3, **policy)
                        ).generate([p], [sp])[0].token_ids for p, sp in zip(prompts, mine)]
    others = [SamplingParams(temperature=0.8, max_new_tokens=20, seed=7 + i) for i in range(4)]
    others += [SamplingParams(max_new_tokens=20)] * 3 + [SamplingParams(temperature=0.9, max_new_tokens=20)] * 3
    for method, bs in (("eqspec", 8), ("exspec", 4), ("exspec", 16)):
        engine = SpecEngine(pair, EngineConfig(drafter="draft_model", method=method, batch_size=bs, gamma=3, **policy))
        outs = engine.generate(prompts + [[2, 2, 2]] * 10, mine + others)
        assert [o.token_ids for o in outs[:6]] == alone, (method, bs)
        if "budget" in policy:  # the planned rows were cut to the budget, so the hold was needed
            assert engine.stats.gamma_hist[1] + engine.stats.gamma_hist[2] > 0
    assert len({tuple(a) for a in alone}) > 1  # requests are not identical copies


def test_greedy_rows_stay_exact_next_to_sampled_rows():
    target, draft = models()
    pair = ModelPair(target, draft, None, V, ())
    greedy = SamplingParams(max_new_tokens=10)
    ref = SpecEngine(pair, EngineConfig(drafter="draft_model",
                                        method="autoregressive", batch_size=1)).generate([PROMPT], greedy)[0]
    mixed = [greedy if i % 2 == 0 else SamplingParams(temperature=1.0, max_new_tokens=10, seed=i) for i in range(8)]
    outs = SpecEngine(pair, EngineConfig(drafter="draft_model",
                                         method="eqspec", batch_size=8, gamma=3)).generate([PROMPT] * 8, mixed)
    assert all(o.token_ids == ref.token_ids for o in outs[::2])
