"""Prompts prefilled inside a decoding round's pass (`SpecEngine._fusable`, decode/round.py): the
runner's per-row tail logits, exactness against prefilling apart, and what is not fused."""

from __future__ import annotations

import pytest
import torch
from test_equivalence import MAX_NEW, workload
from tiny import VOCAB, make_model, oracle_engine

from batchspec import EngineConfig, SamplingParams, SpecEngine
from batchspec.core import rows as rows_module
from batchspec.core.request import Request
from batchspec.core.runner import ModelRunner
from batchspec.sched.costs import CostTable

MODEL = make_model("llama", 32, 2, seed=3)


@pytest.mark.parametrize("forward,pack", [("lean", 1.0), ("lean", 0.0), ("hf", 1.0)])
def test_tail_logits_are_each_rows_last_fed_columns(forward, pack, monkeypatch):
    """logits=[tail_i]: row i's last tail_i fed columns, left-aligned, the same numbers as the
    full [b, n, V] output (packed or padded pass, either forward)."""
    monkeypatch.setattr(rows_module, "PACK_SHARE", pack)
    runner = ModelRunner(MODEL, "target", VOCAB, rows=3, capacity=32, forward=forward)
    reqs = [Request(i, [], SamplingParams(), frozenset()) for i in range(3)]
    for s, r in enumerate(reqs):
        r.slot = s
    runner.feed(reqs[:1], torch.tensor([[5, 6, 7, 8, 9]]), [5], logits="none")  # row 0 holds 5 tokens
    runner.commit(reqs[:1], [5])
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (3, 9), generator=gen)
    counts = [3, 9, 1]  # row 0 verifies 2 drafts, row 1 is a prompt, row 2 a plain step
    full = runner.feed(reqs, ids, counts, logits="all")
    runner.commit(reqs, [0, 0, 0])  # nothing kept: the same pass again
    tail = runner.feed(reqs, ids, counts, logits=[3, 1, 1])
    runner.commit(reqs, [0, 0, 0])
    assert tail.shape == (3, 3, VOCAB)
    torch.testing.assert_close(tail[0], full[0, :3])
    torch.testing.assert_close(tail[1, 0], full[1, 8])
    torch.testing.assert_close(tail[2, 0], full[2, 0])


@pytest.mark.parametrize("options", [dict(method="autoregressive"), dict(drafter="draft_model", adaptive=False),
                                     pytest.param(dict(drafter="draft_model", adaptive=True), marks=pytest.mark.slow),
                                     pytest.param(dict(drafter="ngram"), marks=pytest.mark.slow),
                                     pytest.param(dict(drafter="draft_model", adaptive=False, max_prefill_tokens=24),
                                                  marks=pytest.mark.slow)])
def test_fused_prefill_is_exact_and_saves_forwards(options):
    """Rows joining with their prompts (EOS ends rows at different rounds, so refills arrive while
    others decode) give the reference greedy output, as prefilling apart does, with fewer prefill
    forwards; a budget smaller than some prompts prefills those in chunks first, then joins."""
    p, ids, refs = workload("llama")
    counts = {}
    for fuse in (False, True):
        engine = SpecEngine(p, EngineConfig(batch_size=4, gamma=3, fuse_prefill=fuse, debug=True, **options))
        outs = engine.generate(ids, SamplingParams(max_new_tokens=MAX_NEW))
        assert [o.token_ids for o in outs] == refs, fuse
        counts[fuse] = (engine.stats.prefill_forwards, engine.stats.fused_prefills, engine.stats.prefill_tokens)
    (apart, none, tokens), (forwards, fused, fused_tokens) = counts[False], counts[True]
    assert none == 0 and fused > 0 and forwards < apart
    assert fused_tokens == tokens  # every prompt token prefilled once, either way
    if options.get("max_prefill_tokens"):
        assert forwards > 0  # the prompts longer than the budget took chunks of their own first


def test_ragged_acceptance_next_to_joining_rows_is_exact():
    """The oracle's injected mismatches (every acceptance length) in rounds that also prefill."""
    p, ids, refs = workload("llama")
    engine = oracle_engine(p, {tuple(i): r for i, r in zip(ids, refs)},
                           EngineConfig(drafter="draft_model", adaptive=False, batch_size=3, gamma=3, debug=True))
    outs = engine.generate(ids, SamplingParams(max_new_tokens=MAX_NEW))
    assert [o.token_ids for o in outs] == refs
    assert engine.stats.fused_prefills == sum(len(i) > 1 for i in ids)  # (a one-token prompt has nothing to prefill)
    assert engine.stats.prefill_forwards == 0
    assert len(engine.stats.accept_hist) == 4


def test_what_is_not_fused():
    """exspec chooses its batch among prefilled rows, and the transformers modules would compute
    logits for every prompt token: both prefill apart. A seeded sampled request is prefilled apart
    (it must draft in its first round as it would alone); an unseeded one joins."""
    p, ids, _ = workload("llama")
    for apart in (dict(method="exspec"), dict(forward="hf")):
        engine = SpecEngine(p, EngineConfig(drafter="draft_model", batch_size=2, **apart))
        engine.generate(ids[:6], SamplingParams(max_new_tokens=4))
        assert engine.stats.fused_prefills == 0 and engine.stats.prefill_forwards > 0, apart
    engine = SpecEngine(p, EngineConfig(drafter="draft_model", batch_size=4))
    seeded = [SamplingParams(temperature=1.0, max_new_tokens=4, seed=i) for i in range(3)]
    engine.generate(ids[1:4], seeded)
    assert engine.stats.fused_prefills == 0 and engine.stats.prefill_forwards > 0
    engine.generate(ids[1:4], SamplingParams(temperature=1.0, max_new_tokens=4))
    assert engine.stats.fused_prefills == 3


def test_a_round_that_prefills_keeps_no_plain_plan_for_the_next():
    """A joining row drafts nothing in its round, so that round's (plain) plan says nothing of the
    next: at batch 1 with drafts the target always accepts, the rounds after the first speculate."""
    p, ids, refs = workload("llama")
    engine = oracle_engine(p, {tuple(i): r for i, r in zip(ids, refs)},
                           EngineConfig(drafter="draft_model", adaptive=True, batch_size=1, gamma=3), with_cost=True)
    engine.drafter.mismatch = lambda req, round_, pos: False  # every draft right
    # priced by a table of its own, not by this machine's clock: how busy the machine is (another
    # test process beside this one) must not decide whether the rounds after the first speculate
    table = CostTable((1,), (1, 4), {(1, 1): 0.010, (1, 4): 0.011}, {1: 0.001})
    table.correct = lambda *args, **kwargs: None
    engine.policy.table = table
    outs = engine.generate(ids[:4], SamplingParams(max_new_tokens=MAX_NEW))
    assert [o.token_ids for o in outs] == refs[:4]
    assert engine.stats.fused_prefills == sum(len(i) > 1 for i in ids[:4])
    # (kept plain for the same request, the rounds after each first one ran plain but for the guard's
    # explorations: 57 rounds for 65 tokens; planned, 39)
    assert engine.stats.drafted > 0 and engine.stats.rounds < 0.75 * sum(len(r) for r in refs[:4])


def test_a_joining_row_is_neither_looked_up_nor_planned_drafts():
    """A row joining the round with its prompt drafts nothing there: its cap is 0 when the lookup
    is asked for an offer and when the policy plans, so no lookup runs for it and no draft is
    priced for it; the rows beside it are planned as usual."""
    p, ids, refs = workload("llama")
    engine = SpecEngine(p, EngineConfig(drafter="ngram", batch_size=2, gamma=3))
    offer, seen = engine.drafter.offer, []
    engine.policy.worth_offering = lambda *a: True  # (every round asks: whether it pays is the clock's call)

    def recording(reqs, caps):
        seen.extend((r.kv_len.get("target", 0) < r.num_tokens - 1, cap) for r, cap in zip(reqs, caps))
        return offer(reqs, caps)

    engine.drafter.offer = recording
    assert [o.token_ids for o in engine.generate(ids[:8], SamplingParams(max_new_tokens=MAX_NEW))] == refs[:8]
    joining = [cap for join, cap in seen if join]
    assert joining and all(cap == 0 for cap in joining)
    assert any(cap > 0 for join, cap in seen if not join)


def test_fuse_prefill_must_be_a_bool():
    with pytest.raises(ValueError, match="fuse_prefill"):
        EngineConfig(fuse_prefill="no")
