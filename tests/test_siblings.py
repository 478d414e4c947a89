"""Siblings: runner-up drafts verified beside a greedy row's chain (sched/siblings.py,
decode/siblings.py). Greedy output stays the target's own, token for token, with siblings taken
in rejected drafts' places at every batch size, through both forwards; the choice is the cost
table's."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_equivalence import MAX_NEW as EQ_MAX_NEW
from test_equivalence import workload
from tiny import ARCH_PARAMS, oracle_engine, pair, prompts, references

from batchspec import EngineConfig, SamplingParams, SpecEngine
from batchspec.core.runner import row_inputs, tree_inputs
from batchspec.decode.siblings import Siblings
from batchspec.drafters.oracle import OracleDrafter
from batchspec.eagle.formats import save_head
from batchspec.eagle.head import new_head
from batchspec.sched.costs import CostTable
from batchspec.sched.policy import Decision, SpecPolicy
from batchspec.sched.siblings import SiblingRecord, choose

MAX_NEW = 16


# ----------------------------------------------------------------------------- the choice
def test_siblings_are_taken_while_they_raise_tokens_per_second():
    cost = lambda extra: 10.0 + 0.2 * sum(extra)  # noqa: E731
    q = [[[0.3, 0.1], [0.2]]]
    assert choose([[0.5, 0.5]], q, [2], cost) == [[(0, 0), (0, 1), (1, 0)]]  # (the module's example)
    dear = lambda extra: 10.0 + 5.0 * sum(extra)  # noqa: E731
    assert choose([[0.5, 0.5]], q, [2], dear) == [[]]
    # at 1 ms a token the first alone: 2.05 / 11 = 0.186 > 1.75 / 10, but 2.15 / 12 = 0.179
    assert choose([[0.5, 0.5]], q, [2], lambda extra: 10.0 + 1.0 * sum(extra)) == [[(0, 0)]]
    assert choose([[0.5]], [[[0.3]]], [0], cost) == [[]]  # (no chain: no siblings)


def test_the_factor_learns_what_siblings_hit():
    rec = SiblingRecord()
    assert rec.factor == 1.0
    rec.add(10.0, 3)
    assert rec.factor == pytest.approx(11 / 18)


def test_the_policy_prices_siblings_with_its_cost_table():
    def table(per_token: float) -> CostTable:
        cols = (1, 2, 3, 4, 5, 6, 7, 8, 9)
        return CostTable(rows=(1,), cols=cols, verify_s={(1, c): 0.010 + per_token * (c - 1) for c in cols},
                         draft_s={1: 0.001})
    q = [[[0.3, 0.1, 0.0], [0.2, 0.0, 0.0]]]
    confidence = [[0.5, 0.5]]
    decision = Decision(1, [2], [True], True)
    for per_token, expect in ((0.0001, [[(0, 0), (0, 1), (1, 0)]]), (0.01, [[]])):
        policy = SpecPolicy(gamma=2, table=table(per_token), confident=True, sibling_width=3)
        from batchspec.core.request import RequestStats
        assert policy.siblings(decision, [RequestStats()], [False], [2], confidence, q) == expect
    fixed = SpecPolicy(gamma=2, sibling_width=2)  # (no table: every runner-up offered)
    assert fixed.siblings(decision, [None], [False], [2], confidence, q) == [[(0, 0), (0, 1), (1, 0)]]
    assert SpecPolicy(gamma=2).siblings(decision, [None], [False], [2], confidence, q) == [[]]


# ----------------------------------------------------------------------------- the pass
def test_a_sibling_sees_its_ancestors_at_its_depth():
    positions, visible = row_inputs([4, 2], 4, 8, "cpu")
    tree_inputs(positions, visible, [4], [[-1, 0, 1, 0]], [0])
    assert positions[0].tolist() == [4, 5, 6, 5]
    assert visible[0, 0, 3].int().tolist() == [1, 1, 1, 1, 1, 0, 0, 1]
    assert visible[0, 0, 2].int().tolist() == [1, 1, 1, 1, 1, 1, 1, 0]
    assert positions[1].tolist() == [2, 3, 4, 5]  # (a chain row is untouched)
    with pytest.raises(ValueError, match="earlier column"):
        tree_inputs(positions, visible, [4], [[-1, 2, 1]], [0])


def test_a_sibling_is_taken_where_the_chain_broke():
    sibs = Siblings([[(0, 5), (1, 9), (1, 3)]])  # (decode/siblings.py's example)
    assert sibs.fed(0) == [5, 9, 3]
    assert sibs.parents([2], [0]) == [[-1, 0, 1, 0, 1, 1]]
    assert sibs.resolve([[7, 3, 8, 2, 6, 1]], [1], [2], [0]) == [(5, 2, 1)]
    assert sibs.resolve([[7, 4, 8, 2, 6, 1]], [2], [2], [0]) == [None]  # (all accepted)
    assert sibs.resolve([[6, 3, 8, 2, 6, 1]], [0], [2], [0]) == [None]  # (no sibling is 6)


# ----------------------------------------------------------------------------- exactness
class RunnerUps(OracleDrafter):
    """The oracle's drafts (wrong at ragged positions) and two runner-ups at each depth: a random
    token and, in some row-depths, the target's true token where the draft is wrong."""

    runner_ups = 2

    def propose(self, reqs, lengths, uniforms, sampling):
        out = super().propose(reqs, lengths, uniforms, sampling)
        b, g = out.tokens.shape
        gen = torch.Generator().manual_seed(sum(r.num_tokens for r in reqs))
        ups = torch.randint(0, self.vocab_size, (b, g, 2), generator=gen)
        for i, r in enumerate(reqs):
            ref, start = self.reference(r), r.num_generated
            for j in range(g):
                true = ref[start + j] if start + j < len(ref) else 0
                if int(out.tokens[i, j]) != true and (r.num_tokens + j) % 3:
                    ups[i, j, (r.num_tokens + i) % 2] = true
        return dataclasses.replace(out, runner_ups=ups, runner_up_q=torch.full((b, g, 2), 0.3))


@pytest.mark.parametrize("arch", ARCH_PARAMS)
@pytest.mark.parametrize("forward", ["lean", "hf"])
@pytest.mark.parametrize("method", ["eqspec", pytest.param("exspec", marks=pytest.mark.slow)])
def test_siblings_taken_keep_greedy_output_exact(arch, forward, method):
    """With an EOS that ends some outputs early (a sibling or its bonus may be it), prompts joining
    rounds (lean eqspec), and rows of every acceptance."""
    if forward == "lean" and arch != "llama":
        pytest.skip("the lean forward runs Llama-family models")
    p, ids, refs = workload(arch)
    ids, refs = ids[:12], refs[:12]
    ref_map = {tuple(i): r for i, r in zip(ids, refs)}
    for bs in (1, 3, 8):
        config = EngineConfig(drafter="draft_model", adaptive=False, method=method, batch_size=bs, gamma=3,
                              forward=forward, debug=True, siblings=2)
        engine = oracle_engine(p, ref_map, config)
        engine.drafter = RunnerUps(ref_map, engine.drafter.mismatch, p.vocab_size, engine.device)
        engine.policy.sibling_width = 2  # (the engine was built on the plain oracle, which has none)
        outs = engine.generate(ids, SamplingParams(max_new_tokens=EQ_MAX_NEW))
        assert [o.token_ids for o in outs] == refs, f"{arch} {forward} {method} bs={bs}"
        stats = engine.stats
        assert stats.sibling_hits > 0 and stats.siblings > stats.sibling_hits  # (taken, and not all)


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("head")
    save_head(new_head(pair("llama").target, "eagle", draft_vocab=200, seed=5), out)
    return out


@pytest.mark.parametrize("batch_size", [pytest.param(1, marks=pytest.mark.slow), 3, 8,
                                        pytest.param(32, marks=pytest.mark.slow)])  # (1: the oracle's test)
def test_a_head_verifying_its_runner_ups_is_exact(head_dir, batch_size):
    p, ids = pair("llama"), prompts(12)
    refs = references(p, ids, MAX_NEW)
    for adaptive in (False, True):
        engine = SpecEngine(p, EngineConfig(method="eqspec", batch_size=batch_size, gamma=3, adaptive=adaptive,
                                            drafter=f"eagle:{head_dir}", debug=True, siblings=3))
        assert [o.token_ids for o in engine.generate(ids, SamplingParams(max_new_tokens=MAX_NEW))] == refs
        if not adaptive:
            assert engine.stats.siblings > 0


def test_a_sampled_round_verifies_chains_alone(head_dir):
    """Even a drafter that offers runner-ups to sampled rows (the head gives none) gets none verified."""
    p, ids = pair("llama"), prompts(6)
    engine = SpecEngine(p, EngineConfig(batch_size=3, gamma=3, adaptive=False, drafter=f"eagle:{head_dir}",
                                        siblings=3))
    propose = engine.drafter.propose

    def offering(reqs, lengths, uniforms, sampling, **kw):
        out = propose(reqs, lengths, uniforms, sampling, **kw)
        b, g = out.tokens.shape
        return dataclasses.replace(out, runner_ups=torch.randint(0, p.vocab_size, (b, g, 2)),
                                   runner_up_q=torch.full((b, g, 2), 0.3))
    engine.drafter.propose = offering
    engine.generate(ids, SamplingParams(max_new_tokens=8, temperature=0.8, seed=1))
    assert engine.stats.drafted > 0 and engine.stats.siblings == 0
    engine.generate(ids, SamplingParams(max_new_tokens=8))  # (greedy: they are)
    assert engine.stats.siblings > 0


def test_the_cost_table_is_measured_as_wide_as_siblings_make_a_pass():
    from batchspec.sched.profile import profile_cols
    assert profile_cols(4) == (1, 2, 3, 4, 5)
    assert profile_cols(4, 3) == (1, 2, 3, 4, 5, 9, 17)
    assert profile_cols(2, 1) == (1, 2, 3, 5)


def test_siblings_must_be_a_count():
    with pytest.raises(ValueError, match="siblings"):
        EngineConfig(siblings=-1)
