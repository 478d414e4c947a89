"""Greedy output of every method equals target-only greedy decoding at batch size 1, token for token.

Acceptance is forced to be ragged by an oracle drafter that proposes the reference continuation
with mismatches injected at positions that differ per row and per round; a second stop token
placed mid-sequence makes rows finish at different rounds, often inside an accepted draft.
Fixed γ throughout (adaptive=False): every row drafts what the oracle proposes; the adaptive
policy, which may run rounds plain, is checked for exactness in test_policy.py.
"""

from __future__ import annotations

import functools

import pytest
import torch
from tiny import ARCH_PARAMS, oracle_engine, pair, prompts, references

from batchspec import EngineConfig, ModelPair, SamplingParams, SpecEngine

MAX_NEW = 20
BATCH_SIZES = (1, 2, 3, 8, 32)
GAMMAS = (pytest.param(1, marks=pytest.mark.slow), 3, pytest.param(5, marks=pytest.mark.slow))


@functools.cache
def workload(arch: str, dtype=torch.float32):
    """Pair, prompts, and references with an EOS token that occurs mid-output for some prompts."""
    base = pair(arch, "small", dtype)
    ids = prompts(32)
    free = references(base, ids, MAX_NEW)
    counts: dict[int, int] = {}
    for out in free:
        for tok in set(out[3:15]):
            counts[tok] = counts.get(tok, 0) + 1
    eos = max(counts, key=lambda t: (counts[t] if counts[t] < len(ids) // 2 else 0, -t))
    p = pair(arch, "small", dtype, (eos,))
    refs = references(p, ids, MAX_NEW)
    assert any(len(r) < MAX_NEW and r[-1] == eos for r in refs), "EOS must end some references early"
    assert any(len(r) == MAX_NEW for r in refs), "some references must run to max_new_tokens"
    return p, ids, refs


def run(engine: SpecEngine, ids, max_new=MAX_NEW):
    return engine.generate(ids, SamplingParams(max_new_tokens=max_new))


@pytest.mark.parametrize("arch", ARCH_PARAMS)
@pytest.mark.parametrize("method", ["eqspec", "exspec"])
@pytest.mark.parametrize("gamma", GAMMAS)
def test_oracle_ragged_acceptance_is_exact(arch, method, gamma):
    p, ids, refs = workload(arch)
    ref_map = {tuple(i): r for i, r in zip(ids, refs)}
    for bs in BATCH_SIZES:
        engine = oracle_engine(p, ref_map, EngineConfig(drafter="draft_model", adaptive=False,
                                                        method=method, batch_size=bs, gamma=gamma, debug=True))
        outs = run(engine, ids)
        assert [o.token_ids for o in outs] == refs, f"{arch} {method} bs={bs} gamma={gamma}"
        hist = engine.stats.accept_hist
        assert hist[0] > 0 and hist[gamma] > 0 and len(hist) == gamma + 1, hist  # every acceptance length
        assert {o.finish_reason for o in outs} == {"stop", "length"}
        for o, r in zip(outs, refs):
            assert o.finish_reason == ("stop" if r[-1] in p.eos_token_ids else "length")


@pytest.mark.parametrize("arch", ARCH_PARAMS)
def test_eos_inside_an_accepted_draft(arch):
    """A row whose EOS arrives as an accepted draft token (not the bonus) stops right there."""
    p, ids, refs = workload(arch)
    ref_map = {tuple(i): r for i, r in zip(ids, refs)}
    engine = oracle_engine(p, ref_map, EngineConfig(drafter="draft_model", adaptive=False, method="eqspec",
                                                    batch_size=8, gamma=5))
    engine.drafter.mismatch = lambda req, round_, pos: False  # accept everything: EOS lands mid-draft
    outs = run(engine, ids)
    assert [o.token_ids for o in outs] == refs
    stopped_mid_draft = [o for o in outs if o.finish_reason == "stop" and len(o.token_ids) % 6 != 0]
    assert stopped_mid_draft


@pytest.mark.parametrize("arch", ARCH_PARAMS)
@pytest.mark.slow  # (exactness with ragged acceptance: the oracle tests above, in the fast tier)
@pytest.mark.parametrize("draft_kind", ["perturbed", "small"])
def test_real_draft_model_is_exact(arch, draft_kind):
    """A draft model of its own shapes ("small": another width and depth, whose drafts are nearly
    always rejected, so γ = 5 alone; the oracle tests cover every γ) or the target perturbed.
    A batch runs the first 4 prompts a slot, at least 8 (batches 1 and 2: 8 of the 32, a quarter
    of the rounds; 8 rows and more: all 32), so every batch is still refilled."""
    base, ids, refs = workload(arch)
    p = ModelPair(base.target, pair(arch, draft_kind).draft, None, base.vocab_size, base.eos_token_ids)
    for method in ("eqspec", "exspec"):
        for bs in BATCH_SIZES:
            n = max(8, 4 * bs)
            for gamma in (1, 5) if draft_kind == "perturbed" else (5,):
                engine = SpecEngine(p, EngineConfig(drafter="draft_model", adaptive=False, method=method,
                                                    batch_size=bs, gamma=gamma))
                outs = run(engine, ids[:n])
                assert [o.token_ids for o in outs] == refs[:n], f"{arch} {draft_kind} {method} bs={bs} gamma={gamma}"
        if draft_kind == "perturbed":  # a useful draft: acceptance is ragged, not all or nothing
            hist = engine.stats.accept_hist
            assert 0.2 < engine.stats.accepted / engine.stats.drafted < 0.95 and hist[0] and hist[gamma]


@pytest.mark.parametrize("arch", ARCH_PARAMS)
def test_oracle_with_draft_model_cost_keeps_draft_kv_consistent(arch):
    """The synthetic drafter run through the real draft model (its cost) stays exact."""
    base, ids, refs = workload(arch)
    ref_map = {tuple(i): r for i, r in zip(ids, refs)}
    engine = oracle_engine(base, ref_map, EngineConfig(drafter="draft_model", adaptive=False,
                                                       method="exspec", batch_size=8, gamma=3, debug=True),
                           with_cost=True)
    assert [o.token_ids for o in run(engine, ids)] == refs


@pytest.mark.parametrize("arch", ARCH_PARAMS)
def test_autoregressive_batches_match_batch_one(arch):
    p, ids, refs = workload(arch)
    for bs in BATCH_SIZES:
        engine = SpecEngine(p, EngineConfig(drafter="draft_model", method="autoregressive", batch_size=bs, debug=True))
        assert [o.token_ids for o in run(engine, ids)] == refs, f"{arch} bs={bs}"


def test_float64_rerun_agrees():
    """The fp32 results are not an accident of rounding: fp64 gives the same references."""
    p32, ids, refs32 = workload("llama")
    p64 = pair("llama", "small", torch.float64, p32.eos_token_ids)
    assert references(p64, ids, MAX_NEW) == refs32
    engine = SpecEngine(p64, EngineConfig(drafter="draft_model", adaptive=False, method="eqspec", batch_size=8,
                                          gamma=3))
    assert [o.token_ids for o in run(engine, ids)] == refs32


def test_divergence_note_tells_rounding_from_a_suspect():
    """`verify`'s reading of a divergence: none, a bug in float64, the dtype's rounding where plain
    decoding diverges at the same batch sizes, a suspect where it does not, a hint without it."""
    import doctest

    from batchspec import harness
    from batchspec.harness import divergence_note

    def cell(method, bs, exact):
        return {"method": method, "batch_size": bs, "exact_match": exact}

    exact = [cell("autoregressive", 8, 1.0), cell("eqspec", 8, 1.0)]
    assert divergence_note(exact, torch.bfloat16) is None
    assert "a bug" in divergence_note([cell("eqspec", 8, 0.9)], torch.float64)
    rounding = [cell("autoregressive", 1, 1.0), cell("autoregressive", 32, 0.94), cell("eqspec", 32, 0.94),
                cell("exspec", 32, 0.97)]
    assert "rounding at those batch sizes accounts for it" in divergence_note(rounding, torch.bfloat16)
    suspect = [cell("autoregressive", 8, 1.0), cell("autoregressive", 32, 0.94), cell("eqspec", 8, 0.9),
               cell("eqspec", 32, 0.94)]
    assert "speculation may be at fault" in divergence_note(suspect, torch.bfloat16)
    assert "add autoregressive to --methods" in divergence_note([cell("eqspec", 32, 0.94)], torch.float32)
    plain_only = [cell("autoregressive", 32, 0.94), cell("eqspec", 32, 1.0)]
    assert "only plain decoding (autoregressive) diverges" in divergence_note(plain_only, torch.float32)
    assert doctest.testmod(harness).failed == 0


def test_outputs_return_in_input_order_with_sorting():
    p, ids, refs = workload("llama")
    for method in ("eqspec", "exspec"):
        engine = SpecEngine(p, EngineConfig(drafter="draft_model", adaptive=False,
                                            method=method, batch_size=4, gamma=3, sort_by_length=True))
        outs = run(engine, ids)
        assert [o.token_ids for o in outs] == refs
        assert [o.prompt_token_ids for o in outs] == ids
