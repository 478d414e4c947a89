"""Adaptive speculation: the policy on hand-made numbers, and exactness with it on."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import pair, prompts, references

from batchspec import EngineConfig, SamplingParams, SpecEngine
from batchspec.core.request import RequestStats
from batchspec.drafters import model_drafter
from batchspec.sched.adaptive import AdaptivePolicy, Calibration
from batchspec.sched.cost_model import CostModel
from batchspec.sched.tetris import cumulative

SLOW = pytest.mark.slow


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens a round commits when every draft is accepted with probability alpha independently."""
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_tokens_runs(first: float, later: list[float], gamma: int) -> float:
    """Tokens a round commits when d_1 is accepted with probability `first` and d_j after it
    with later[j - 2]: 1 + the cumulative gains."""
    return 1 + sum(cumulative(([first] + later)[:gamma]))


def exact_policy(*args, **kwargs) -> AdaptivePolicy:
    """A policy without the optimism bonus: its rates are exactly the priors and records."""
    return AdaptivePolicy(*args, optimism=0.0, **kwargs)


def cost(draft=0.002, v1=0.020, v4=0.032) -> CostModel:
    return CostModel(rows=(1, 8), cols=(1, 4), verify_s={(1, 1): 0.01, (1, 4): 0.011, (8, 1): v1, (8, 4): v4},
                     draft_s={1: draft, 8: draft})


def test_docstring_example():
    policy = exact_policy(cost(), gamma_max=3, margin=1.0)
    assert expected_tokens(0.6, 3) == pytest.approx(2.176)
    assert policy.plan([0.6] * 8, [3] * 8) == [1] * 8
    assert exact_policy(cost(), gamma_max=3, prior=0.95, margin=1.0).plan([0.95] * 8, [3] * 8) == [3] * 8
    assert policy.plan([0.2] * 8, [3] * 8) == [0] * 8  # speculation does not pay: a plain decoding round
    assert policy.plan([0.95] * 8, [0] * 8) == [0] * 8  # no row may draft (all about to finish)
    mixed = policy.plan([0.95] * 4 + [0.1] * 4, [3] * 8)
    assert mixed == [2] * 4 + [0] * 4  # only the rows likely to accept draft


@settings(max_examples=200, deadline=None)
@given(b=st.integers(1, 40), packed=st.booleans(), data=st.data(),
       scales=st.tuples(*[st.floats(0.2, 5.0)] * 3), drafts=st.tuples(st.floats(0.0, 0.01), st.floats(0.0, 0.01)))
def test_round_seconds_is_draft_plus_verify(b, packed, data, scales, drafts):
    """The plan's fast cost of a round (`CostModel.round_seconds`) is the policy's draft_s + verify_s,
    for any rows, lengths (up to beyond the profiled columns), catch-up (0: a row no draft step
    feeds), online scales, and a draft profile that falls with rows (steps clamped at 0)."""
    c = CostModel(rows=(1, 8), cols=(1, 2, 4), verify_s={(1, 1): 0.01, (1, 2): 0.011, (1, 4): 0.013,
                                                         (8, 1): 0.02, (8, 2): 0.03, (8, 4): 0.04},
                  draft_s={1: drafts[0], 8: drafts[1]})
    c.verify_scale, c.plain_scale, c.draft_scale = scales
    policy = AdaptivePolicy(c, gamma_max=5, packed=packed)
    lengths = data.draw(st.lists(st.integers(0, 5), min_size=b, max_size=b))
    first_fed = data.draw(st.none() | st.lists(st.just(0.0) | st.floats(1.0, 30.0), min_size=b, max_size=b))
    fed = policy._fed(lengths, first_fed)
    total, deepest = sum(lengths), max(lengths)
    expected = policy.draft_s(b, fed) + policy.verify_s(b, total, deepest)
    assert c.round_seconds(b, packed)(total, fed) == pytest.approx(expected)
    charged = c.round_seconds(b, packed, spec_s=0.003)  # (replanning: only rounds that verify drafts)
    assert charged(total, fed) == pytest.approx(expected + (0.003 if total else 0.0))
    done = c.round_seconds(b, packed, drafted_s=0.5)
    assert done(total, fed) == pytest.approx(0.5 + policy.verify_s(b, total, deepest))


def ragged_cost(token_s: float | None) -> CostModel:
    """32 rows, 1 to 5 columns, as measured on the bundled target (`CostModel`'s docstring)."""
    return CostModel(rows=(1, 32), cols=(1, 5), verify_s={(1, 1): 0.005, (1, 5): 0.008, (32, 1): 0.0255,
                                                          (32, 5): 0.0666}, draft_s={1: 0.001, 32: 0.001},
                     token_s=token_s)


def test_a_packed_pass_costs_by_its_longest_row():
    """`CostModel.ragged`: one row fed 5 tokens next to 31 fed 1 costs the full pass less 0.26 ms
    per token not fed (34.4 ms; measured 34.6), far above its tokens' worth (26.8); the same 4
    drafts spread over 4 rows cost less; every row full is the profile; no drafts is a plain
    pass. Without token_s the profile's own slope per token is used: cost by tokens alone."""
    c = ragged_cost(0.26e-3)
    assert c.ragged(32, 4, 4) == pytest.approx(0.0666 - 0.26e-3 * (32 * 4 - 4))
    assert c.ragged(32, 4, 1) < c.ragged(32, 4, 4)
    assert c.ragged(32, 128, 4) == pytest.approx(0.0666) and c.ragged(32, 0, 0) == pytest.approx(0.0255)
    assert c.ragged(32, 1, 1) >= c.ragged(32, 0, 0)
    by_tokens = ragged_cost(None)
    for total in range(4, 129):
        assert by_tokens.ragged(32, total, 4) == pytest.approx(by_tokens.verify(32, 1 + total / 32))


def test_one_deep_row_does_not_pay_for_a_wide_pass():
    """32 rows, one whose lookup drafts for free at α 0.99, the others at 0.05: by tokens alone its
    4 drafts look worth a round (35.9 tokens in 26.8 ms against 32 in 25.5), but the pass they
    make 5 columns wide costs 34.4 ms: a plain round."""
    alphas, caps, free = [0.99] + [0.05] * 31, [4] * 32, [0.0] * 32
    by_tokens = exact_policy(ragged_cost(None), gamma_max=4, prior=0.99, margin=1.0)
    assert by_tokens.plan(alphas, caps, first_fed=free) == [4] + [0] * 31
    policy = exact_policy(ragged_cost(0.26e-3), gamma_max=4, prior=0.99, margin=1.0)
    assert policy.plan(alphas, caps, first_fed=free) == [0] * 32


def test_may_speculate_bounds_the_plan_with_free_drafting():
    """A hybrid's lookups are done only when the plan could speculate were drafting free."""
    policy = exact_policy(cost(draft=0.5), gamma_max=3, margin=1.0)
    assert policy.plan([0.6] * 8, [3] * 8) == [0] * 8  # draft steps cost too much...
    assert policy.may_speculate([0.6] * 8, [3] * 8)  # ... but free drafts would pay
    assert not policy.may_speculate([0.05] * 8, [3] * 8)  # nothing would: no lookups
    assert policy.may_speculate([0.05] * 8, [3] * 8, held=[1] + [0] * 7)  # a held row drafts anyway


def test_what_a_lookup_would_index_first_is_charged_to_a_speculative_round():
    """`index_s` (what a lookup drafter would index before drafting, at each row's share) is
    charged to a speculative round, in `may_speculate` (before a hybrid's lookups) and in `plan`."""
    cheap = exact_policy(cost(draft=0.0005), gamma_max=3, margin=1.0)
    assert any(cheap.plan([0.6] * 8, [3] * 8))
    assert cheap.may_speculate([0.6] * 8, [3] * 8, index_s=0.001)
    assert not cheap.may_speculate([0.6] * 8, [3] * 8, index_s=0.05)  # indexing costs more than a round
    assert cheap.plan([0.6] * 8, [3] * 8, index_s=0.05) == [0] * 8


def test_index_share_follows_the_rounds_left_that_draft():
    """A row is charged its lookup's indexing over the rounds it has left (at least 2 tokens a
    round) in which it is likely to draft: the share of rows that verified drafts in the rounds of
    its batch size, once enough of them ran (the docstring's example: 10 % -> 1 / 1.6)."""
    policy = exact_policy(cost(), gamma_max=3)
    fresh = SimpleNamespace(stats=SimpleNamespace(rounds=0), num_generated=0, remaining=32)
    assert policy.index_shares([fresh] * 8)[0] == pytest.approx(1 / 16)  # 2 tokens a round assumed
    going = SimpleNamespace(stats=SimpleNamespace(rounds=10), num_generated=40, remaining=40)
    assert policy.index_shares([going] * 8)[0] == pytest.approx(0.1)  # 4 a round: 10 rounds left
    ending = SimpleNamespace(stats=SimpleNamespace(rounds=10), num_generated=40, remaining=1)
    assert policy.index_shares([ending] * 8)[0] == 1.0
    for _ in range(policy.record_rounds):  # one row in ten verifies drafts at 8-15 rows (the bucket of 8)
        policy.observe([0] * 10, [1] + [0] * 9, None, 0.02, 0.0)
    assert policy.index_shares([fresh] * 8)[0] == pytest.approx(1 / 1.6)
    assert policy.index_shares([fresh] * 2)[0] == pytest.approx(1 / 16)  # (another batch size: nothing recorded)
    for _ in range(200):  # none does any more: the floor
        policy.observe([0] * 10, [0] * 10, None, 0.02, 0.0)
    long = SimpleNamespace(stats=SimpleNamespace(rounds=0), num_generated=0, remaining=400)
    assert policy.index_shares([long] * 8)[0] == pytest.approx(1 / (200 * policy.index_floor))


def test_a_row_that_would_leave_its_cohort_is_charged_a_share_of_a_prefill_forward():
    """While requests wait, rows with as many tokens left end together and share one refill; a
    row that gets ahead needs a forward of its own: V(1, 1) x (1 - 1/m) over its rounds left
    (2 tokens a round assumed). The charge can keep a round plain that would speculate."""
    def req(remaining):
        return SimpleNamespace(stats=SimpleNamespace(rounds=0), num_generated=0, remaining=remaining)

    policy = exact_policy(cost(), gamma_max=3, margin=1.0)
    reqs = [req(10), req(10), req(10), req(5)]
    one = policy.cost.verify(1, 1)
    assert policy.split_s(reqs, refilling=True) == pytest.approx([one * (2 / 3) / 5] * 3 + [0.0])
    assert policy.split_s(reqs, refilling=False) is None  # draining: no refill to share
    assert policy.split_s([req(10), req(9)], refilling=True) is None  # no cohort
    assert policy.plan([0.6] * 8, [3] * 8) == [1] * 8
    assert policy.plan([0.6] * 8, [3] * 8, split_s=[0.004] * 8) == [0] * 8
    assert policy.may_speculate([0.6] * 8, [3] * 8) and not policy.may_speculate([0.6] * 8, [3] * 8,
                                                                                split_s=[0.004] * 8)


def test_gain_scale_corrects_the_estimates_by_what_was_accepted():
    """Accepted over expected drafts, averaged over speculative rounds, scales every estimated gain
    (within [0.5, 2], n rounds weighed against 8 at 1): estimates that fall short of what is
    accepted draft deeper, estimates that promise more than is accepted fall back to plain rounds."""
    def rounds(policy, accept_all: bool, n: int = 60):
        for _ in range(n):
            lengths = policy.prune([0.6] * 8, policy.plan([0.6] * 8, [3] * 8), None, 0.002)
            accepted = lengths if accept_all else [0] * 8
            policy.observe(accepted, lengths, None, policy.last["verify_s"], policy.last["draft_s"])

    high = exact_policy(cost(), gamma_max=3, margin=1.0)
    assert high.gain_scale() == 1.0 and high.plan([0.6] * 8, [3] * 8) == [1] * 8  # the docstring's example
    rounds(high, accept_all=True)
    assert 1.3 < high.gain_scale() <= 2.0
    assert sum(high.plan([0.6] * 8, [3] * 8)) > 8  # deeper than γ_i = 1
    low = exact_policy(cost(), gamma_max=3)  # (speculates only when 5 % faster)
    assert low.plan([0.6] * 8, [3] * 8) == [1] * 8
    rounds(low, accept_all=False, n=2)  # a warm-up's few rounds count little against the prior of 1
    assert low.gain_scale() == pytest.approx(8 / 10) and low.plan([0.6] * 8, [3] * 8) == [1] * 8
    rounds(low, accept_all=False, n=10)  # (plain rounds once the scale is low: no more is measured)
    assert low.gain_scale() < 0.7 and low.plan([0.6] * 8, [3] * 8) == [0] * 8


def test_a_short_stretch_that_accepts_little_does_not_set_the_gain_scale():
    """`gain_scale` averages about the last 100 speculative rounds (`realised_weight` 0.01): after
    500 rounds that accepted what was expected, 20 that accepted half of it leave it near 0.9; at a
    weight of 0.05 they set it near 0.68, low enough to keep later rounds plain (seen at batch 2),
    and plain rounds do not measure it again."""
    def scale(**weight) -> float:
        policy = AdaptivePolicy(None, gamma_max=3, **weight)
        for accepted in [[1] * 4 + [0] * 4] * 500 + [[1] * 2 + [0] * 6] * 20:
            policy.last = {"rows": 8, "expected": 4.0}
            policy.observe(accepted, [3] * 8, None, 0.02, 0.002)
        return policy.gain_scale()

    assert scale() == pytest.approx(1 - 0.5 * (1 - 0.99 ** 20), rel=0.01)  # 0.91 (the default weight)
    assert scale(realised_weight=0.05) < 0.7


def test_intake_is_what_a_batch_brings_a_shared_index_per_round():
    """`intake`: each row's tokens at its end over the rounds of its life (the docstring's example)."""
    row = SimpleNamespace(stats=SimpleNamespace(rounds=10), num_generated=8, num_tokens=68, remaining=24)
    policy = AdaptivePolicy(None, gamma_max=3)
    assert policy.intake([row] * 4) == pytest.approx(4 * 92 / 22)


def test_plan_is_the_best_of_uniform_lengths():
    """The per-row plan is at least as good (by the model) as every fixed γ."""
    c = cost(draft=0.004, v1=0.020, v4=0.050)
    policy = exact_policy(c, gamma_max=3, prior=0.8, margin=1.0)
    later = policy.later_rates()
    alphas, caps = [0.9, 0.8, 0.5, 0.2, 0.7, 0.6, 0.9, 0.95], [3, 3, 3, 3, 1, 3, 2, 3]

    def rate(lengths):
        tokens = sum(expected_tokens_runs(a, later, n) for a, n in zip(alphas, lengths))
        depths = [sum(1 for n in lengths if n > j) for j in range(max(lengths))]
        return tokens / (policy.draft_s(8, depths) + policy.verify_s(8, sum(lengths), max(lengths)))

    plan = policy.plan(alphas, caps)
    assert all(n <= k for n, k in zip(plan, caps))
    assert rate(plan) >= max(rate([min(g, k) for k in caps]) for g in range(4)) - 1e-9


def test_prune_verifies_what_the_draft_was_sure_of():
    """After drafting, TETRIS keeps the drafts with the best estimated cumulative acceptance; with
    a calibration learned from the draft's probabilities, a doubted draft is dropped."""
    policy = exact_policy(None, gamma_max=3, budget=4)
    for _ in range(400):  # the draft's confident tokens are accepted, its unsure ones are not
        policy.observe([1, 0], [1, 1], [[0.95, 0.0, 0.0], [0.15, 0.0, 0.0]], 0.0, 0.0)
    confidence = [[0.95, 0.95, 0.95], [0.15, 0.95, 0.95], [0.95, 0.15, 0.95]]
    assert policy.prune([0.6] * 3, [3, 3, 3], confidence, 0.0) == [3, 0, 1]
    assert policy.prune([0.6] * 3, [3, 3, 3], None, 0.0) in ([2, 1, 1], [1, 2, 1], [1, 1, 2])  # no confidence


def test_runs_of_acceptance_are_learned_per_position():
    policy = exact_policy(cost(), gamma_max=3, prior=0.5)
    for _ in range(200):  # d_1 accepted half the time; once it is, d_2 and d_3 always are
        policy.observe([0, 3], [3, 3], None, 0.0, 0.0)
    assert policy.alpha(0, 0) == pytest.approx(0.5, abs=0.02)
    assert all(r > 0.95 for r in policy.later_rates())
    assert expected_tokens_runs(0.5, policy.later_rates(), 3) > expected_tokens(0.5, 3) + 0.4


def test_margin_keeps_plain_decoding_when_the_gain_is_within_it():
    c = cost(draft=0.0, v1=0.020, v4=0.020 * 1.6)
    # γ = 1 for all 8 rows gives 8 x 1.24 / 24 ms = 413 tok/s against 8 / 20 ms = 400: 3 % better
    assert exact_policy(c, gamma_max=1, prior=0.24, margin=1.0, packed=False).plan([0.24] * 8, [3] * 8) == [1] * 8
    assert exact_policy(c, gamma_max=1, prior=0.24, margin=1.05, packed=False).plan([0.24] * 8, [3] * 8) == [0] * 8


def test_costs_interpolate_and_follow_measurements():
    c = cost()
    assert c.verify(8, 1) == pytest.approx(0.020) and c.verify(8, 4) == pytest.approx(0.032)
    assert c.verify(8, 2) == pytest.approx(0.024) and c.verify(4, 1) == pytest.approx(0.01 + 3 / 7 * 0.01)
    for _ in range(100):
        c.correct(c.verify(8, 4), 2 * 0.032, 0.006, 0.006)
    assert c.verify(8, 4) == pytest.approx(0.064, rel=0.01)  # a machine twice as slow as profiled


def test_plain_and_speculative_rounds_are_corrected_apart():
    """Plain rounds measured as profiled leave the speculative rounds' scale where their own
    measurements put it: 30 % dearer than profiled (overheads a plain round does not have)."""
    c = cost()
    for _ in range(200):
        c.correct(c.verify(8, 1), 0.020, 0.0, 0.0, plain=True)
        c.correct(c.verify(8, 2), 1.3 * 0.024, 0.0, 0.0)
    assert c.verify(8, 1) == pytest.approx(0.020, rel=0.01)
    assert c.verify(8, 2) == pytest.approx(1.3 * 0.024, rel=0.01)


def test_each_depth_learns_its_own_cost():
    """A profile that read every depth alike at batch 1 (10 ms), on a machine where a pass with a
    4th draft costs 14 ms and shorter ones 10; draft steps 2 ms. Requests alternate between
    acceptance 0.9 (by the profile worth 4 drafts: 4.1 tokens in 18 ms against 3.4 in 16) and
    0.3 (3 drafts). Once the rounds have measured each depth, the 0.9 rows verify 3 as well (4
    drafts: 4.1 tokens in 22 ms). One scale for all depths, learnt from the mix of both, prices
    them alike (~12 ms) and keeps verifying 4."""
    c = CostModel(rows=(1, 2), cols=(1, 5), verify_s={(1, 1): 0.010, (1, 5): 0.010, (2, 1): 0.015, (2, 5): 0.015},
                  draft_s={1: 0.002, 2: 0.003})
    policy = exact_policy(c, gamma_max=4, prior=0.9, margin=1.0)
    policy.later_rates = lambda looked=False: [0.9, 0.9, 0.9]  # (d_2..d_4 given the ones before: pair-wide)
    chosen = {0.9: [], 0.3: []}
    for i in range(80):
        alpha = (0.9, 0.3)[i % 2]
        lengths = policy.plan([alpha], [4])
        chosen[alpha].append(lengths[0])
        measured = 0.014 if lengths[0] == 4 else 0.010
        policy.observe([0], lengths, None, measured, 0.002 * lengths[0])
    assert chosen[0.9][0] == 4 and chosen[0.3][0] == 3
    assert [n for n in chosen[0.9][-10:] if n] == [3] * len([n for n in chosen[0.9][-10:] if n]) != []
    # (depth 4's scale stops where 4 drafts stopped paying: it moves only when they are verified)
    assert c.ragged(1, 3, 3) == pytest.approx(0.010, rel=0.05) and c.ragged(1, 4, 4) > 0.011


def test_a_depth_not_run_lately_follows_the_shared_scale():
    """A profile that reads every pass twice what it costs. One round verifies 4 drafts early, at
    the profile's price (a busy moment); then only 2-draft rounds run, at half the profile. The
    4-draft pass is then priced from the shared scale times what it measured relative to it, near
    half the profile too: kept absolute, its one early round would price it at the profile's
    20 ms for good, and the plan would never verify 4 again to learn otherwise."""
    c = CostModel(rows=(1, 2), cols=(1, 5), verify_s={(1, 1): 0.020, (1, 5): 0.020, (2, 1): 0.020, (2, 5): 0.020},
                  draft_s={1: 0.002, 2: 0.002})
    c.correct(c.ragged(1, 4, 4), 0.020, 0.0, 0.0, rows=1, deepest=4)
    for _ in range(100):
        c.correct(c.ragged(1, 2, 2), 0.010, 0.0, 0.0, rows=1, deepest=2)
    assert c.ragged(1, 2, 2) == pytest.approx(0.010, rel=0.02)
    assert c.ragged(1, 4, 4) < 0.012

def test_acceptance_estimate_moves_from_the_prior_to_the_record():
    policy = exact_policy(cost(), gamma_max=3, prior=0.6)
    assert policy.alpha(0, 0) == pytest.approx(0.6)
    assert policy.alpha(0, 40) < 0.1 and policy.alpha(40, 40) > 0.9


@pytest.mark.parametrize("method", ["eqspec", pytest.param("exspec", marks=SLOW)])
@pytest.mark.parametrize("options", [dict(adaptive=True), pytest.param(dict(adaptive=False, budget=5), marks=SLOW),
                                     pytest.param(dict(adaptive=True, budget=3), marks=SLOW)])
def test_adaptive_and_budgets_keep_greedy_exact(method, options):
    p = pair("llama", "perturbed")
    ids = prompts(16, seed=7)
    refs = references(p, ids, 20)
    for bs in (1, 4, 16):
        engine = SpecEngine(p, EngineConfig(drafter="draft_model", method=method, batch_size=bs, gamma=4, **options))
        assert [o.token_ids for o in engine.generate(ids, SamplingParams(max_new_tokens=20))] == refs
        decided = engine.stats.summary()["adaptive"]
        assert decided is not None and sum(decided["gamma_hist"].values()) == engine.stats.row_rounds
        if "budget" in options:
            assert decided["verified_per_round"] <= options["budget"]  # (up to 4 x 16 drafted per round)
            if "adaptive" not in options:  # (the adaptive plan may keep tiny models plain)
                assert sum(reached for _, reached in engine.policy.calibration.counts) > 0  # the draft's q was used


def test_optimism_tries_drafting_under_a_pessimistic_prior_then_follows_the_record():
    c = cost(draft=0.002, v1=0.020, v4=0.032)
    assert exact_policy(c, gamma_max=3, prior=0.3).plan([0.3] * 8, [3] * 8) == [0] * 8  # never tries
    policy = AdaptivePolicy(c, gamma_max=3, prior=0.3)
    assert any(policy.plan([policy.alpha(0, 0)] * 8, [3] * 8))  # the bonus makes it try
    for _ in range(100):  # ... and the record it gets (every first draft rejected) ends that
        policy.observe([0] * 8, [1] * 8, None, 0.0, 0.0)
    assert policy.plan([policy.alpha(0, 0)] * 8, [3] * 8) == [0] * 8


def test_a_request_whose_later_drafts_fail_is_priced_by_its_own_record():
    """The pair accepted 300 of 400 drafts after the first (0.75); a request 2 of 12: its own rate
    shrunk toward the pair's, (2 + 8 x 0.75) / 20 = 0.4, over 0.75 = 0.53 (the docstring's example).
    Rows with the same first-draft rate then plan apart: at 8 rows, the four whose later drafts
    fail draft 2 tokens, the others 3; without the factors all 8 draft 3. With no record of its own
    a request counts as the pair."""
    policy = exact_policy(cost(draft=0.001, v1=0.020, v4=0.032), gamma_max=3, prior=0.75, margin=1.0)
    policy._positions[False] = [[400.0, 400.0], [300.0, 400.0], [0.0, 0.0]]
    weak = RequestStats(later_reached=12, later_accepted=2)
    assert policy.later_factors([weak, RequestStats()]) == [pytest.approx(0.4 / 0.75), 1.0]
    factors = policy.later_factors([weak] * 4 + [RequestStats()] * 4)
    assert policy.plan([0.95] * 8, [3] * 8, factors=factors) == [2] * 4 + [3] * 4
    assert policy.plan([0.95] * 8, [3] * 8) == [3] * 8


def test_later_drafts_are_counted_per_request():
    """A round that verifies n drafts of a row and accepts a reached d_2..d_min(a+1, n), a - 1 of
    them accepted (n 4: a 2 -> 2 reached, 1 accepted; a 4 -> 3, 3; a 0 -> 0, 0), so over an engine
    run every accepted draft is a first or a later one, and a later draft reached is one drafted."""
    p = pair("llama", "perturbed")
    engine = SpecEngine(p, EngineConfig(drafter="draft_model", batch_size=4, gamma=4, adaptive=False))
    stats = [o.stats for o in engine.generate(prompts(8, seed=3), SamplingParams(max_new_tokens=24))]
    assert sum(s.later_reached for s in stats) > sum(s.later_accepted for s in stats) > 0  # (ragged)
    for s in stats:
        assert s.accepted == s.first_accepted + s.later_accepted
        assert s.later_accepted <= s.later_reached <= s.drafted - s.first_drafted


def test_a_round_counts_into_the_request_record():
    """`RequestStats.count_drafts`, the examples above (n 4: a 2 -> 2 later drafts reached, 1
    accepted; a 4 -> 3, 3; a 0 -> 0, 0), the lookup's part counted apart too."""
    s = RequestStats()
    for a, looked in ((2, False), (4, True), (0, True)):
        s.count_drafts(a, 4, looked)
    assert (s.drafted, s.accepted, s.first_drafted, s.first_accepted) == (12, 6, 3, 2)
    assert (s.later_reached, s.later_accepted) == (2 + 3 + 0, 1 + 3 + 0)
    assert (s.looked_up, s.looked_accepted, s.looked_later_reached, s.looked_later_accepted) == (2, 1, 3, 3)


def test_rows_with_more_work_left_come_first_when_nothing_waits():
    """Draining, a row's tokens are worth its remaining work: the long row drafts, the nearly
    finished one need not (equal rates, so unweighted they would be treated alike)."""
    policy = exact_policy(cost(draft=0.002, v1=0.020, v4=0.032), gamma_max=3, prior=0.8, margin=1.0)
    plain = policy.plan([0.8, 0.8], [3, 3])
    assert plain[0] == plain[1]
    weighted = policy.plan([0.8, 0.8], [3, 3], weights=[1.0, 0.05])
    assert weighted[0] > weighted[1]


def test_a_drafter_far_behind_on_a_row_is_priced():
    """A row whose draft model must first catch up on 400 tokens is not drafted for one round's gain."""
    c = CostModel(rows=(1, 8), cols=(1, 4), verify_s={(1, 1): 0.01, (1, 4): 0.011, (8, 1): 0.020, (8, 4): 0.032},
                  draft_s={1: 0.0005, 8: 0.002})  # a draft step costs by the tokens it feeds
    policy = exact_policy(c, gamma_max=3, prior=0.8, margin=1.0)
    assert all(policy.plan([0.8] * 8, [3] * 8))
    behind = policy.plan([0.8] * 8, [3] * 8, first_fed=[400] + [1] * 7)
    assert behind[0] == 0 and all(behind[1:])


def test_guard_penalises_speculation_that_takes_longer_than_predicted():
    """The plan predicts that drafting pays (1.4x plain decoding); at 8 rows speculative rounds
    took twice their predicted time, plain rounds 1.2x theirs (overheads the profile lacks):
    penalty 2 / 1.2, so the policy turns plain, explores after 16 rounds the penalty kept plain,
    then waits twice as long. Other batch sizes are judged apart."""
    c = cost(draft=0.002, v1=0.020, v4=0.032)
    policy = exact_policy(c, gamma_max=3, prior=0.8, margin=1.0)
    alphas, caps = [0.8] * 8, [3] * 8
    assert any(policy.plan(alphas, caps))  # nothing measured: the plan is trusted
    for _ in range(40):
        policy.guard.record(8, 2.0, speculative=True)
        policy.guard.record(8, 1.2, speculative=False)
    assert policy.guard.penalty(8) == pytest.approx(2 / 1.2, rel=0.02)
    assert policy.plan(alphas, caps) == [0] * 8
    assert any(policy.plan([0.8] * 2, [3] * 2))  # 2 rows: nothing measured there
    for _ in range(15):
        assert policy.plan(alphas, caps) == [0] * 8
    assert any(policy.plan(alphas, caps))  # one speculative round after 16 the penalty kept plain
    policy.guard.record(8, 2.0, speculative=True)  # still slow
    assert policy.guard.wait[policy.guard.bucket(8)] == 32 and policy.plan(alphas, caps) == [0] * 8


def test_one_slow_round_does_not_lock_the_guard():
    """A single round measured 1.6x slow (a warm-up's first, a hiccup) moves the penalty a fifth
    of the way (1.6^0.2 = 1.10), so a round predicted 1.4x faster than plain still speculates;
    taken whole it kept a batch-1 engine plain for 931 rounds. An exploration that finds
    speculation on time brings the next one back to `explore_every` rounds instead of doubling the
    wait, and one that confirms the penalty doubles it."""
    c = cost(draft=0.002, v1=0.020, v4=0.032)
    policy = exact_policy(c, gamma_max=3, prior=0.8, margin=1.0)
    guard, alphas, caps = policy.guard, [0.8] * 8, [3] * 8
    guard.record(8, 1.6, speculative=True)
    guard.record(8, 1.0, speculative=False)
    assert guard.penalty(8) == pytest.approx(1.6 ** 0.2) and any(policy.plan(alphas, caps))
    for _ in range(12):  # speculation measured 2x slow, steadily: the penalty keeps rounds plain
        guard.record(8, 2.0, speculative=True)
    assert guard.penalty(8) > 1.5
    k = guard.bucket(8)
    for wait, slow in ((16, 2.0), (32, 0.9), (16, 2.0)):  # confirmed, on time, confirmed
        for _ in range(wait):
            assert policy.plan(alphas, caps) == [0] * 8
        assert any(policy.plan(alphas, caps))  # the exploration
        guard.record(8, slow, speculative=True)
        assert guard.wait[k] == (2 * wait if slow > 1.0 else guard.explore_every)


def test_guard_ignores_what_rounds_commit():
    """A request that accepts nothing makes its speculative rounds deliver less than plain ones,
    but on time: the penalty stays 1, and the next request, with its own acceptance record,
    speculates (a guard that compared tokens per second turned it off for everyone)."""
    c = cost(draft=0.002, v1=0.020, v4=0.032)
    policy = exact_policy(c, gamma_max=3, prior=0.8, margin=1.0)
    for _ in range(20):
        lengths = policy.plan([0.8], [3])
        policy.observe([0] * len(lengths), lengths, None, policy.last["verify_s"], policy.last["draft_s"])
    assert policy.guard.penalty(1) == pytest.approx(1.0)
    assert any(policy.plan([0.8], [3]))


def test_guard_measures_plain_rounds_when_the_plan_never_runs_one():
    """Speculation that wins (1.5 tokens a row for 1.2 plain rounds' time) is checked against a
    forced plain round after 16 speculative rounds, then after 32: the plain side gets measured
    even in batches where some row always has a draft worth verifying."""
    c = cost(draft=0.002, v1=0.020, v4=0.032)
    policy = exact_policy(c, gamma_max=3, prior=0.8, margin=1.0)
    alphas, caps = [0.8] * 8, [3] * 8
    plain_s = c.verify(8, 1)
    forced = []
    for i in range(60):
        lengths = policy.plan(alphas, caps)
        if any(lengths):
            policy.observe([1] * 4 + [0] * 4, lengths, None, 1.2 * plain_s, 0.0)
        else:
            forced.append(i)
            policy.observe([0] * 8, lengths, None, plain_s, 0.0)
    assert forced == [16, 16 + 32 + 1]


def test_a_catch_up_round_does_not_speak_for_speculation():
    """A draft model that missed 16 plain rounds first feeds those tokens: that round is slow for
    a reason that serves later rounds, so it moves neither the draft scale nor the guard, and the
    next round, with 1 or 2 tokens unseen, is measured as usual."""
    c = cost(draft=0.002, v1=0.020, v4=0.032)
    policy = exact_policy(c, gamma_max=3, prior=0.8, margin=1.0)
    alphas, caps = [0.8] * 8, [3] * 8
    lengths = policy.plan(alphas, caps)
    assert any(lengths)
    policy.observe([2] * 8, lengths, None, c.verify(8, 4), 10 * policy.last["draft_s"], caught_up=True)
    assert c.draft_scale == 1.0 and not policy.guard.spec  # unheard
    lengths = policy.plan(alphas, caps)
    policy.observe([2] * 8, lengths, None, c.verify(8, 4), 10 * policy.last["draft_s"])
    assert c.draft_scale > 1.0 and policy.guard.bucket(8) in policy.guard.spec  # measured



def test_a_plain_plan_stands_for_the_same_requests_a_few_rounds():
    """Where drafting does not pay, the same batch's next rounds are plain without replanning,
    up to `replan_every` rounds; other requests are planned. α 0.15 at 2 rows: a free draft
    would pay (1.15 tokens a row for 12.3 ms against 1 for 11.4), one that costs a 2 ms step not."""
    c = cost(draft=0.002, v1=0.020, v4=0.032)
    policy = exact_policy(c, gamma_max=3, prior=0.8, margin=1.0)
    key = ("a", "b")
    assert policy.may_speculate([0.15] * 2, [3] * 2) and policy.plan([0.15] * 2, [3] * 2, key=key) == [0, 0]
    assert [policy.plain_now(key) for _ in range(policy.replan_every + 1)] == [True] * policy.replan_every + [False]
    best, calls = policy._best_lengths, []
    policy._best_lengths = lambda *args: calls.append(args) or best(*args)
    assert policy.plan([0.15] * 2, [3] * 2, key=key) == [0, 0] and len(calls) == 1  # (not settled: known)
    policy._best_lengths = best
    assert not policy.plain_now(("a", "c"))
    assert any(policy.plan([0.8] * 2, [3] * 2, key=key)) and not policy.plain_now(key)


def test_nothing_to_draft_is_a_plain_round_without_a_plan():
    """Caps all 0 (a lookup found nothing and the draft model is off): plain, with nothing priced,
    and a plain plan kept for the same requests is dropped (the next lookups may find something)."""
    policy = exact_policy(cost(), gamma_max=3, prior=0.8, margin=1.0)
    key = ("a", "b")
    policy._memo = [key, 0, False, False]
    best = policy._best_lengths
    policy._best_lengths = lambda *args: pytest.fail("priced a round with nothing to draft")
    assert policy.plan([0.9] * 2, [0, 0], key=key) == [0, 0]
    assert policy.last["draft_s"] == 0.0 and not policy.plain_now(key)
    policy._best_lengths = best
    assert policy.plan([0.9] * 2, [3, 0], key=key) != [0, 0]


def test_a_round_prefilling_a_prompt_follows_the_last_timed_round_without_a_plan():
    """A round that prefills a joining request (`decode/round.py`) is plain without planning where
    the last round that prefilled nothing was plain; after a speculative one it is planned. Its
    own drafts (none for the joining row) do not decide the next such round."""
    policy = exact_policy(cost(), gamma_max=3)
    policy.plan([0.8] * 2, [3] * 2)
    policy.observe([0, 0], [0, 0], None, 0.02, 0.0)  # a plain round, timed
    assert policy.plain_now(None, 2, joining=True) and not policy.plain_now(None, 2)
    policy.plan([0.8] * 2, [3] * 2)
    policy.observe([2, 1], [3, 2], None, 0.03, 0.004)  # a speculative round
    assert not policy.plain_now(None, 2, joining=True)
    drafting = {k: list(v) for k, v in policy._drafting.items()}
    costs = (policy.cost.plain_scale, policy.cost.verify_scale, policy.cost.draft_scale, dict(policy.guard.counts))
    policy.plan([0.8] * 2, [0] * 2)
    policy.observe([0, 0], [0, 0], None, 0.05, 0.0, timed=False)  # a plain round that prefilled, 2.5x as long
    assert (policy.cost.plain_scale, policy.cost.verify_scale, policy.cost.draft_scale,
            dict(policy.guard.counts)) == costs  # its seconds correct no cost and no guard
    assert not policy.plain_now(None, 2, joining=True)
    # nor whether fresh requests draft (`speculates`): kept plain, such rounds would pull the record
    # down and keep the draft model's prefill off (seen at batch 8: every later round plain)
    assert policy._drafting == drafting


def test_a_plan_plain_even_with_free_drafts_stands_longer():
    """A plain plan that free drafts would not turn (α 0.05) is settled: it stands
    `settled_rounds` rounds for the same requests, whether `plan` found it (a draft model) or
    `may_speculate` did given the key (a hybrid's bound before its lookups), then it is made again.
    Made with lookups' lengths as caps (`settle=False`) it is not: those change every round."""
    c = cost(draft=0.002, v1=0.020, v4=0.032)
    key = ("a", "b")
    for decide in (lambda p: p.plan([0.05] * 2, [3] * 2, key=key) == [0, 0],
                   lambda p: not p.may_speculate([0.05] * 2, [3] * 2, key=key)):
        policy = exact_policy(c, gamma_max=3, prior=0.8, margin=1.0)
        assert decide(policy) and policy.last["draft_s"] == 0.0
        n = policy.settled_rounds
        assert n > policy.replan_every and [policy.plain_now(key) for _ in range(n + 1)] == [True] * n + [False]
        assert not policy.plain_now(("a", "c"))
    policy = exact_policy(c, gamma_max=3, prior=0.8, margin=1.0)
    assert policy.plan([0.05] * 2, [1] * 2, key=key, settle=False) == [0, 0]
    kept = [policy.plain_now(key) for _ in range(policy.replan_every + 1)]
    assert kept == [True] * policy.replan_every + [False]
    policy = exact_policy(c, gamma_max=3, prior=0.8, margin=1.0)
    assert not policy.may_speculate([0.05] * 2, [3] * 2) and not policy.plain_now(key)  # (no key: a question only)


def test_a_plain_plan_stands_only_as_long_as_planning_costs():
    """How long a plain plan stands follows what planning measured: replanning every round costs
    at most `replan_share` (2 %) of the rounds. A plan (lookups included) of 0.1 ms next to a
    20 ms plain round: replanned every round; of 1 ms: kept for 2 rounds; of 5 ms: for the most,
    `replan_every`."""
    c = cost(draft=0.002, v1=0.020, v4=0.032)
    key = tuple("abcdefgh")
    for planning_s, kept in ((0.0001, 0), (0.001, 2), (0.005, 8)):
        policy = exact_policy(c, gamma_max=3, prior=0.8, margin=1.0)
        policy.planned(8, planning_s)
        assert policy.keep_rounds(8) == kept and policy.keep_rounds(2) == policy.replan_every  # (not timed)
        assert policy.plan([0.05] * 8, [3] * 8, key=key, settle=False) == [0] * 8  # (not settled: see below)
        assert [policy.plain_now(key) for _ in range(kept + 1)] == [True] * kept + [False]


def test_a_speculative_round_is_charged_the_plan_a_plain_one_would_keep():
    """`replan_s`: the round after a speculative one is planned again, while a plain plan stands
    `keep_rounds`. Plans of 5 ms next to 20 ms plain rounds (kept 8 rounds): a speculative round
    is charged 5 x 7/8 ms more, which turns a marginal gain (α 0.4) into a plain
    round and leaves a clear one (α 0.7) speculating; plans too cheap to keep cost nothing."""
    c = cost(draft=0.002, v1=0.020, v4=0.032)
    for planning_s, charged in ((None, 0.0), (0.0001, 0.0), (0.005, 0.005 * 7 / 8)):
        policy = exact_policy(c, gamma_max=3, prior=0.8, margin=1.0)
        if planning_s is not None:
            policy.planned(8, planning_s)
        assert policy.replan_s(8) == pytest.approx(charged)
        assert any(policy.plan([0.4] * 8, [3] * 8)) == (charged == 0.0)
        assert any(policy.plan([0.7] * 8, [3] * 8))


def test_whether_fresh_requests_draft_follows_what_the_rounds_at_that_batch_size_did():
    """`speculates` (whether the draft model prefills new requests): the prediction for fresh
    requests, and once `record_rounds` rounds of that batch size ran, their record too: plain
    rounds turn it off (there, not at other batch sizes), rounds that verify drafts on again, as
    long as a fresh plan would draft."""
    policy = exact_policy(cost(), gamma_max=3, prior=0.8)
    assert policy.speculates(8) and policy.speculates(1)  # predicted: a fresh plan drafts
    for _ in range(policy.record_rounds - 1):
        policy.observe([0] * 8, [0] * 8, None, 0.02, 0.0)
    assert policy.speculates(8)  # (not enough rounds yet)
    policy.observe([0] * 8, [0] * 8, None, 0.02, 0.0)
    assert not policy.speculates(8) and not policy.speculates(12) and policy.speculates(4)  # (8-15 rows alike)
    for _ in range(10):  # a round in which one row of 8 explores a draft, now and then
        policy.observe([0] * 8, [1] + [0] * 7, None, 0.02, 0.0)
        policy.observe([0] * 8, [0] * 8, None, 0.02, 0.0)
    assert not policy.speculates(8)  # (a share of the rows, not of rounds: 1 in 16)
    rounds = 0
    while not policy.speculates(8):
        policy.observe([1] * 8, [2] * 8, None, 0.02, 0.0)
        rounds += 1
    assert rounds == 2  # every row drafting, at a weight of 0.05: from ~0.06 (the explorations) to 0.11
    # a record of drafting is not enough once a fresh plan would no longer draft (costs measured
    # since: here every verified draft got dearer); the prediction alone is not either (above)
    policy.cost = cost(v4=0.2)
    assert not policy.speculates(8) and not any(policy.plan([0.8] * 8, [3] * 8))


def test_a_catch_up_is_priced_per_token_fed():
    """A drafter's catch-up costs `catch_up_s` a token, not a row's share of a draft step each
    (the docstring's example: 20 tokens -> 6 rows' worth), so a row whose round is charged 100
    tokens of catch-up is still worth drafting at batch 1 where, priced as 100 rows, it was not."""
    c = CostModel(rows=(1, 2), cols=(1, 5), verify_s={(1, 1): 0.006, (1, 5): 0.0065, (2, 1): 0.0066,
                                                      (2, 5): 0.0073}, draft_s={1: 0.0011, 2: 0.00119},
                  catch_up_s=0.000027)
    assert c.catch_up(1, 20) == pytest.approx(20 * 0.027 / 0.09)
    assert CostModel(c.rows, c.cols, c.verify_s, c.draft_s).catch_up(1, 20) == 20  # unprofiled: a row each
    policy = exact_policy(c, gamma_max=4, prior=0.7, margin=1.0)
    assert any(policy.plan([0.7], [4], first_fed=[1 + policy.catch_up(1, 100)]))  # per token: 13.6 ms
    assert not any(policy.plan([0.7], [4], first_fed=[1 + 100]))  # as a row a token: 19.9 ms, plain


def test_a_catch_up_is_shared_by_the_rounds_the_model_will_draft():
    """`catch_up_share`, its docstring's example: 60 tokens left at 3 a round, 9 of 10 speculative
    rounds drafted by a lookup -> 1/3.6 of the catch-up; a request that has not drafted yet, or
    whose rounds the model drafted, shares it over its remaining tokens at 2 a round (or more)."""
    def req(remaining, generated, rounds, drafted=0, looked_up=0):
        stats = SimpleNamespace(rounds=rounds, first_drafted=drafted, looked_up=looked_up)
        return SimpleNamespace(remaining=remaining, num_generated=generated, stats=stats)

    share = AdaptivePolicy.catch_up_share
    assert share(req(60, 30, 10, drafted=10, looked_up=9)) == pytest.approx(3 / (60 * 2 / 11))
    assert share(req(60, 0, 0)) == pytest.approx(2 / 60)  # nothing measured: 2 tokens a round
    assert share(req(60, 10, 10, drafted=4)) == pytest.approx(2 / 60)  # plain rounds do not slow it below 2
    assert share(req(60, 30, 10, drafted=10)) == pytest.approx(3 / 60)  # the model drafted all its rounds
    assert share(req(3, 30, 10, drafted=10, looked_up=10)) == 1.0  # never more than the whole catch-up
    # a hybrid's prior (`HybridDrafter.model_share`): its lookup finds nothing for 1 row in 10
    assert share(req(60, 30, 10), 0.1) == pytest.approx(1 / 2)  # 20 rounds left, ~2 of them the model's
    assert share(req(60, 30, 10, drafted=10, looked_up=9), 0.1) == pytest.approx(1 / (20 * 1.1 / 11))


def test_drafting_stops_where_the_next_draft_is_not_worth_a_step():
    """`AdaptivePolicy.cut`, its docstring's example: at batch 1 a draft step (1.1 ms) is worth 0.18
    tokens of a plain round (6.1 ms). Calibrated, q = 0.2 is accepted 30 % of the time and q = 0.95
    90 %: after one doubtful draft the next is worth 0.3 x 0.8 = 0.24 tokens (go on), after two
    0.09 x 0.8 = 0.07 (stop there); confident rows go on, and each row of a batch is cut apart."""
    c = CostModel(rows=(1, 2), cols=(1, 5), verify_s={(1, 1): 0.0061, (1, 5): 0.0065, (2, 1): 0.0066,
                                                      (2, 5): 0.0073}, draft_s={1: 0.0011, 2: 0.0012}, token_s=1e-5)
    policy = exact_policy(c, gamma_max=4, prior=0.8, margin=1.0)
    for q, rate in ((0.25, 3), (0.95, 9)):
        for k in range(1000):
            policy.calibration.add(q, k % 10 < rate)
    fresh = SimpleNamespace(stats=RequestStats())
    policy.last = {"rows": 1}
    assert policy.cut([fresh], 1, [[0.2]], [4]) == [4]
    assert policy.cut([fresh], 2, [[0.2, 0.2]], [4]) == [2]
    assert policy.cut([fresh], 2, [[0.95, 0.95]], [4]) == [4]
    assert policy.cut([fresh], 2, [[0.2, 0.2]], [2]) == [2]  # (at its planned length already)
    policy.last = {"rows": 2}
    assert policy.cut([fresh, fresh], 2, [[0.2, 0.2], [0.95, 0.95]], [4, 4]) == [2, 4]


@pytest.mark.parametrize("drafter", ["draft_model", "hybrid:suffix:20,2"])
def test_rows_cut_short_between_draft_steps_stay_exact(drafter):
    """Rows the policy stops between draft steps (`DraftModelDrafter.stop`; here forced: even rows
    after one draft, the others after two) verify only what was drafted, and the draft model
    commits only what it was fed (a commit beyond that raises): greedy output stays exact. (The
    hybrid's lookup proposes at most 2 tokens here, as the cut model rows draft.)"""
    p = pair("llama", "perturbed")
    ids = prompts(12, seed=3)
    refs = references(p, ids, 16)
    engine = SpecEngine(p, EngineConfig(drafter=drafter, batch_size=4, gamma=4, debug=True))
    policy, plan, cuts = engine.policy, engine.policy.plan, []

    def planning(alphas, caps, *args, **kwargs):  # every row drafts its cap (the plan is timed)
        plan(alphas, caps, *args, **kwargs)
        return list(caps)

    def stop(reqs, depth, confidence, lengths):
        out = [depth if i % 2 == 0 or depth >= 2 else n for i, n in enumerate(lengths)]
        cuts.append(out != lengths)
        return out

    policy.plan, model_drafter(engine.drafter).stop = planning, stop
    assert [o.token_ids for o in engine.generate(ids, SamplingParams(max_new_tokens=16))] == refs
    verified = engine.stats.gamma_hist
    assert any(cuts) and max(verified) == 2 and verified[1] > 0


def test_held_rows_draft_whatever_the_plan_and_the_others_are_planned_around_them():
    """Rows at α = 0.2 are kept plain (see the docstring). One held row drafts its cap anyway, even
    when the guard has a plain round due; the round then drafts in any case, so the draft steps
    are paid for and a draft at 0.2 (0.5 ms of verify) is worth adding to the others. prune keeps
    the held drafts whatever the budget."""
    policy = exact_policy(cost(), gamma_max=3, margin=1.0)
    assert policy.plan([0.2] * 8, [3] * 8) == [0] * 8
    assert policy.plan([0.2] * 8, [3] * 8, held=[3] + [0] * 7) == [3] + [1] * 7
    assert policy.plan([0.2] * 8, [2] * 8, held=[0] * 8) == [0] * 8  # nothing held: as without
    for _ in range(policy.guard.explore_every):
        policy.guard.record(8, 1.0, speculative=True)
    assert policy.guard.plain_due(8) and policy.plan([0.2] * 8, [3] * 8) == [0] * 8
    assert policy.plan([0.2] * 8, [3] * 8, held=[3] + [0] * 7)[0] == 3
    budgeted = AdaptivePolicy(None, gamma_max=3, budget=2)
    assert budgeted.prune([0.9] * 3, [3, 3, 3], None, 0.0, held=[0, 0, 3]) == [0, 0, 3]
    assert budgeted.prune([0.9] * 3, [3, 3, 3], None, 0.0, held=[0, 0, 1]) in ([1, 0, 1], [0, 1, 1])


def test_a_profile_times_its_points_in_sweeps():
    """`fastest`: every runner once per sweep, two warm-up sweeps, the fastest of the rest. A slow
    spell of the machine (here the 5th to 8th runs, the first two timed sweeps) costs each point
    two of its five timed runs, where timed one point at a time a spell as long as one point's
    runs takes all of them."""
    from batchspec.bench import costs

    clock, order = iter([1, 1, 1, 1, 9, 9, 9, 9, 2, 3, 2, 3, 5, 5]), []

    def runner(name):
        return lambda: order.append(name) or next(clock)

    best = costs.fastest({"a": runner("a"), "b": runner("b")}, repeats=5)
    assert order == ["a", "b"] * 7 and best == {"a": 2, "b": 3}


def test_a_profile_stops_sweeping_once_its_budget_is_spent(monkeypatch):
    """`fastest` with a budget: a model whose passes take 2 s each (by an injected clock) gets one
    warm-up sweep (it took more than a quarter of the 3 s budget) and one timed sweep, then stops at
    4 s, not after 7 sweeps; passes of 0.5 s get both warm-ups and as many timed sweeps as fit."""
    from batchspec.bench import costs

    class Clock:
        now = 0.0

        @classmethod
        def perf_counter(cls):
            return cls.now

    def runner():
        Clock.now += 2.0
        return 2.0

    monkeypatch.setattr(costs, "time", Clock)
    best = costs.fastest({"a": runner}, repeats=5, budget_s=3.0)
    assert best == {"a": 2.0} and Clock.now == 4.0
    Clock.now = 0.0
    costs.fastest({"a": runner}, repeats=5)
    assert Clock.now == 14.0  # no budget: every sweep
    Clock.now, seen = 0.0, []
    costs.fastest({"a": lambda: seen.append(Clock.now) or setattr(Clock, "now", Clock.now + 0.5) or 0.5},
                  repeats=5, budget_s=3.0)
    assert len(seen) == 7 and Clock.now == 3.5  # 2 warm-ups, then sweeps while under 3 s: 5 timed


def test_a_profile_holds_one_kv_buffer_per_model_and_row_count(monkeypatch):
    """The passes a profile times in sweeps are all set up at once, so each model's passes of one
    row count share one KV buffer, as wide as the widest (a buffer per pass would hold the grid's
    columns times a batch's KV: 9 of 64 rows for gamma 8). Rows (1, 2) x columns (1, 2) with a draft
    model: 2 buffers of the target, 2 of the draft (its catch-up pass the widest at 1 row)."""
    from batchspec.bench import costs

    p = pair("llama", "perturbed")
    made, kv_buffer = [], costs.kv_buffer
    monkeypatch.setattr(costs, "kv_buffer", lambda m, b, c: made.append((m is p.target, b, c)) or kv_buffer(m, b, c))
    monkeypatch.setattr(costs, "_PROFILES", {})
    monkeypatch.setenv("BATCHSPEC_CACHE", "off")
    costs.profile_costs(p.target, p.draft, (1, 2), (1, 2), context=16, repeats=1)
    assert sorted(made) == [(False, 1, 16 + 1 + costs.CATCH_UP), (False, 2, 17), (True, 1, 18), (True, 2, 18)]


def test_step_cost_profiles_are_kept_on_disk(tmp_path, monkeypatch):
    """A profile is measured once per machine (`batchspec/cache.py`): with the in-memory cache
    emptied (a new process), it is read back from `BATCHSPEC_CACHE`, the same numbers, after one
    pass per row count is timed to check it; one that says passes cost far more than they do
    (taken at a busy moment) is measured again, as is an unreadable file; `off` writes nothing."""
    from batchspec.bench import costs

    p = pair("llama", "perturbed")
    calls, fastest = [], costs.fastest  # one call per profile measured, and per pass the check times
    monkeypatch.setattr(costs, "fastest", lambda *a, **k: calls.append(1) or fastest(*a, **k))
    monkeypatch.setattr(costs, "_PROFILES", {})
    monkeypatch.setenv("BATCHSPEC_CACHE", str(tmp_path))

    def profile():
        costs._PROFILES.clear()
        return costs.profile_costs(p.target, p.draft, (1, 2), (1, 2), repeats=1)

    first = profile()
    measured = len(calls)
    files = list((tmp_path / "profiles").iterdir())
    assert measured > 0 and len(files) == 1 and first["token_s"] is not None
    monkeypatch.setattr(costs, "STALE", 0.0)  # (a one-sample profile of a tiny model is noise itself)
    assert profile() == first and len(calls) == measured + 2  # read back: only the check ran
    monkeypatch.setattr(costs, "STALE", 0.7)
    busy = json.loads(files[0].read_text())
    busy["verify_s"] = [[b, n, 1000 * s] for b, n, s in busy["verify_s"]]
    files[0].write_text(json.dumps(busy))
    again = profile()
    # (the check stops at the first pass found faster)
    assert len(calls) == 2 * measured + 3 and again["verify_s"][(1, 1)] < 10 * first["verify_s"][(1, 1)]
    assert json.loads(files[0].read_text())["verify_s"] != busy["verify_s"]  # the new one is kept
    files[0].write_text("{not json")
    profile()
    assert len(calls) == 3 * measured + 3
    files[0].unlink()
    monkeypatch.setenv("BATCHSPEC_CACHE", "off")
    profile()
    assert len(calls) == 4 * measured + 3 and not list((tmp_path / "profiles").iterdir())


def test_a_lookups_drafts_are_judged_by_its_own_record():
    """A hybrid's lookup and its draft model accept very differently (the suffix lookup's first
    drafts ~0.6 of the time at batch 1 on the bundled prompts, with runs after them; the model's
    ~0.7, then less). Each keeps its own record, per request and pair-wide (`estimates`,
    `observe(looked=...)`): a request whose model drafts fail but whose lookups pass is priced
    high where its lookup drafts, low where its model does. One record for both would price both
    at the mix."""
    policy = exact_policy(cost(), gamma_max=3, prior=0.5)
    for _ in range(100):  # row 0 drafted by the lookup, all accepted; row 1 by the model, none
        policy.observe([3, 0], [3, 3], None, 0.0, 0.0, looked=[True, False])
    assert policy.later_rates(True) == [pytest.approx(1.0, abs=0.03)] * 2
    assert policy.alpha(0, 0, looked=True) > 0.95 and policy.alpha(0, 0) < 0.05
    mixed = RequestStats(first_drafted=20, first_accepted=10, looked_up=10, looked_accepted=10)
    (by_model, by_lookup), _ = policy.estimates([mixed, mixed], [False, True])
    assert by_model < 0.05 and by_lookup > 0.95  # its 10 model drafts failed, its 10 lookups passed
    assert policy.plan([by_model, by_lookup], [3, 3], looked=[False, True]) == [0, 3]
    assert len(set(policy.plan([0.5, 0.5], [3, 3]))) == 1  # (one record for both, mixed: priced alike)


def test_the_plan_prices_what_a_lookup_found_by_its_confidence():
    """The lookup's proposals are known before the plan (a hybrid's `lookahead`), with each token's
    confidence (`match_confidence`: how long the match, how often what followed it did), which the
    policy calibrates on its own (`lookup_calibration`, apart from the model's q): a copy after a
    long match is verified, one after a two-token match seen once is not."""
    policy = exact_policy(cost(), gamma_max=3, margin=1.0)
    for _ in range(300):  # confident copies are accepted, doubtful ones rejected
        policy.observe([3, 0], [3, 1], [[0.95] * 3, [0.35, 0.0, 0.0]], 0.0, 0.0, looked=[True, True])
    assert policy.calibration.counts == Calibration().counts  # the model's calibration heard nothing
    alphas, factors = policy.estimates([RequestStats()] * 8, [True] * 8)
    sure, doubtful = [0.95] * 3, [0.35] * 3
    confidence = [sure] * 4 + [doubtful] * 4
    lengths = policy.plan(alphas, [3] * 8, factors=factors, looked=[True] * 8, confidence=confidence)
    assert lengths[:4] == [3] * 4 and lengths[4:] == [0] * 4
    assert len(set(policy.plan(alphas, [3] * 8, factors=factors, looked=[True] * 8))) == 1  # blind: all alike



def test_what_a_plan_reads_several_times_a_round_follows_every_observation():
    """`later_rates` and the scales `round_seconds` reads are computed once per observation (a plan,
    TETRIS pruning and `cut` read them in one round), and what the next round reads has moved."""
    policy = exact_policy(cost(), gamma_max=3, prior=0.5)
    before = list(policy.later_rates())
    assert policy.later_rates() is policy.later_rates()  # (once per observation)
    policy.observe([3], [3], None, 0.0, 0.0)
    assert policy.later_rates() != before and policy.later_rates()[0] > before[0]
    c = policy.cost
    seconds = c.round_seconds(8)(8, [8.0])
    c.correct(c.verify(8, 2), 2 * c.verify(8, 2), 0.0, 0.0, rows=8, deepest=1)  # a pass took twice its price
    assert c.round_seconds(8)(8, [8.0]) > seconds
    plain = c.round_seconds(8)(0, [])
    c.correct(c.verify(8, 1), 2 * c.verify(8, 1), 0.0, 0.0, plain=True)
    assert c.round_seconds(8)(0, []) == pytest.approx(plain * 2 ** 0.1)
