"""The scheduling policy (sched/policy.py) on hand-made cost tables (sched/costs.py) and acceptance
records (core/request.py), the cost table's measurement (sched/profile.py, core/timing.py), and
exactness with the policy on."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import pair, prompts, references

from batchspec import EngineConfig, SamplingParams, SpecEngine
from batchspec.core import timing
from batchspec.core.request import AcceptanceRecord, RequestStats
from batchspec.sched import profile
from batchspec.sched.costs import CostTable
from batchspec.sched.policy import SHRINK, Decision, SpecPolicy

SLOW = pytest.mark.slow
MS = 1e-3

def table(draft=2 * MS, token_s=0.5 * MS, per_column=4 * MS) -> CostTable:
    """The policy docstring's table: b = 8, D = 2 ms, V(8, n) = 20 + 4 (n - 1) ms, s = 0.5 ms."""
    return CostTable((8,), (1, 2, 3, 4), {(8, n): 20 * MS + per_column * (n - 1) for n in (1, 2, 3, 4)},
                     {8: draft} if draft is not None else {}, token_s)


def pair_at(rate: float, gamma: int = 3) -> dict[bool, AcceptanceRecord]:
    """A pair record, for both sources, of so many drafts that every position's rate is `rate`
    (to within a few 1e-4, whatever the prior's constants)."""
    out = {}
    for looked in (False, True):
        rec = out[looked] = AcceptanceRecord()
        rec.reached, rec.accepted = [10 ** 6] * gamma, [round(rate * 10 ** 6)] * gamma
    return out


def policy_at(rate: float, gamma: int = 3, **kwargs) -> SpecPolicy:
    return SpecPolicy(gamma, pair=pair_at(rate, gamma), **kwargs)


def fresh(n: int) -> list[RequestStats]:
    return [RequestStats() for _ in range(n)]


def rates(policy: SpecPolicy, stats: RequestStats | None = None, looked: bool = False) -> list[float]:
    """r_1 .. r_γ of a row, read off its gains G_j = r_1 ... r_j."""
    g = policy.gains([stats or RequestStats()], [looked], [policy.gamma])[0]
    return [g[0]] + [b / a for a, b in zip(g, g[1:])]


def record(reached: list[int], accepted: list[int], looked: bool = False) -> RequestStats:
    """A request whose record (of a lookup's drafts, or a model's) reads so."""
    s = RequestStats()
    s.record(looked).reached, s.record(looked).accepted = list(reached), list(accepted)
    return s


# ----------------------------------------------------------------------------- acceptance records
def test_acceptance_record_docstring_example():
    rec = AcceptanceRecord()
    rec.add(2, 4)
    assert (rec.reached, rec.accepted) == ([1, 1, 1, 0], [1, 1, 0, 0])


rounds = st.lists(st.integers(1, 6).flatmap(lambda n: st.tuples(st.integers(0, n), st.just(n))), max_size=30)


@settings(max_examples=200, deadline=None)
@given(rounds)
def test_acceptance_record_counts_reached_and_accepted_per_position(played):
    """Position j is reached in a round that verified more than j drafts with d_1..d_j accepted,
    and accepted there when a > j: so every accepted draft is counted once, every round reaches
    position 0, and a rate accepted[j] / reached[j] is a probability."""
    rec = AcceptanceRecord()
    for a, n in played:
        rec.add(a, n)
    width = max((n for _, n in played), default=0)
    assert len(rec.reached) == len(rec.accepted) == width
    assert rec.reached == [sum(1 for a, n in played if j < n and j <= a) for j in range(width)]
    assert rec.accepted == [sum(1 for a, _ in played if j < a) for j in range(width)]
    assert sum(rec.accepted) == sum(a for a, _ in played) and (rec.reached[:1] or [0])[0] == len(played)
    assert all(acc <= rch for acc, rch in zip(rec.accepted, rec.reached))
    assert all(x >= y for x, y in zip(rec.reached, rec.reached[1:]))


def test_a_round_counts_into_the_request_record_by_source():
    """`RequestStats.count_drafts`: totals, and the lookup's drafts in a record apart from the model's."""
    s = RequestStats()
    for a, looked in ((2, False), (4, True), (0, True)):
        s.count_drafts(a, 4, looked)
    assert (s.drafted, s.accepted, s.looked_up) == (12, 6, 2)
    assert (s.records[False].reached, s.records[False].accepted) == ([1, 1, 1, 0], [1, 1, 0, 0])
    assert (s.records[True].reached, s.records[True].accepted) == ([2, 1, 1, 1], [1, 1, 1, 1])


def test_an_engine_run_keeps_each_request_record_consistent():
    """Over a run with ragged acceptance, each request's records add up to its totals: every
    accepted draft is in one record, every round that verified drafts reached position 0."""
    p = pair("llama", "perturbed")
    engine = SpecEngine(p, EngineConfig(drafter="draft_model", batch_size=4, gamma=4, adaptive=False))
    stats = [o.stats for o in engine.generate(prompts(4, seed=3), SamplingParams(max_new_tokens=16))]
    assert 0 < sum(s.accepted for s in stats) < sum(s.drafted for s in stats)  # (ragged)
    for s in stats:
        recs = list(s.records.values())
        assert s.accepted == sum(sum(r.accepted) for r in recs)
        assert sum(r.reached[0] for r in recs) <= s.rounds and sum(sum(r.reached) for r in recs) <= s.drafted


# ----------------------------------------------------------------------------- rates
def test_a_rate_moves_from_the_pairs_to_the_rows_own_record():
    """r = (a + K p) / (n + K): a row with no record is priced as the pair; 9 K drafts of its own
    put it within 0.1 of its own rate, whatever the pair (K = SHRINK)."""
    assert rates(policy_at(0.6)) == pytest.approx([0.6] * 3, abs=1e-3)
    n = round(9 * SHRINK)
    for policy in (SpecPolicy(3), policy_at(0.6), policy_at(0.02)):
        assert rates(policy, record([n], [0]))[0] <= 0.1 + 1e-9
        assert rates(policy, record([n], [n]))[0] >= 0.9 - 1e-9


def test_a_lookups_drafts_are_judged_by_its_own_record():
    """A lookup's drafts and a model's accept differently: the pair keeps a record per source, so
    a round's lookup rows (all accepted) and model rows (none) price the next round's rows of each
    source apart, and the plan drafts the lookup row, not the model row."""
    policy = SpecPolicy(3, table())
    decision = Decision(2, [3, 3], [False, True], True)
    for _ in range(100):
        policy.observe(decision, [3, 3], [3, 0], [True, False], 0.0, 0.0)
    assert min(rates(policy, looked=True)) > 0.95 and rates(policy)[0] < 0.05
    lengths = policy.plan(fresh(8), [3] * 8, [None] * 4 + [3] * 4, [False] * 8).lengths
    assert lengths == [0] * 4 + [3] * 4


# ----------------------------------------------------------------------------- plans
def test_docstring_example():
    """b = 8, every rate 0.6: 1 draft a row (492 tok/s against 490 for 2 and 400 plain); 0.2: plain."""
    t = table()
    assert t.verify(8, 1, 8) + t.draft(8) == pytest.approx(26 * MS)
    assert t.verify(8, 2, 16) + 2 * t.draft(8) == pytest.approx(32 * MS)
    assert policy_at(0.6, table=t).plan(fresh(8), [3] * 8, [None] * 8, [False] * 8).lengths == [1] * 8
    assert policy_at(0.2, table=t).plan(fresh(8), [3] * 8, [None] * 8, [False] * 8).lengths == [0] * 8


def test_nothing_to_draft_is_a_plain_round():
    policy = policy_at(0.6, table=table())
    assert policy.plan(fresh(2), [0, 0], [None, None], [False, False]).lengths == [0, 0]
    assert policy.worth_offering(("a", "b"), fresh(2), [0, 0], [False, False])  # (nothing to ask: no memo)


def test_a_lookups_offer_caps_its_rows_and_costs_no_step():
    """Lookup rows verify at most what the lookup found, and are free: with a verify column of
    1 ms and a draft step of 50 ms, no model row drafts (rate 0.6), and a lookup row whose record
    says ~0.9 drafts all 2 it found, not the 3 of its cap."""
    policy = policy_at(0.6, table=table(draft=50 * MS, per_column=1 * MS))
    stats = fresh(4)
    stats[2] = record([100, 100], [95, 90], looked=True)
    decision = policy.plan(stats, [3] * 4, [None, None, 2, 0], [False] * 4)
    assert decision.lengths == [0, 0, 2, 0] and decision.model_rows == [False] * 4


def test_a_free_draft_is_not_held_back_by_a_dear_one_of_equal_gain():
    """As above with every rate 0.6: the lookup row's 2nd draft (0.36) ranks after the model rows'
    1st (0.6, a 50 ms step), so no prefix of the ranking holds it without them (the best prefix
    stops at 1 draft: 4.6 tokens in 19.5 ms); the plan also prices the lookup rows alone at 2
    (4.96 in 19) and takes that."""
    policy = policy_at(0.6, table=table(draft=50 * MS, per_column=1 * MS))
    assert policy.plan(fresh(4), [3] * 4, [None, None, 2, 0], [False] * 4).lengths == [0, 0, 2, 0]


def test_worth_offering_asks_whether_free_drafts_would_pay():
    """Lookups are made only when the plan of an optimistic offer (every row its cap, free) drafts:
    a draft step too dear for the model (0.5 s) does not keep them off, low rates do; a held row
    always asks. A 'no' is remembered for the same rows until a round verifies drafts (or the
    rounds asked about double: 64 asked before, these stay below 128)."""
    dear = policy_at(0.6, table=table(draft=0.5))
    assert dear.plan(fresh(8), [3] * 8, [None] * 8, [False] * 8).lengths == [0] * 8
    assert dear.worth_offering("k", fresh(8), [3] * 8, [False] * 8)
    low = policy_at(0.2, table=table(draft=0.5))
    low._rounds = 64
    low.pair = pair_at(0.02)
    assert not low.worth_offering("k", fresh(8), [3] * 8, [False] * 8)
    assert low.worth_offering("k", fresh(8), [3] * 8, [True] + [False] * 7)
    low.pair = pair_at(0.6)
    assert not low.worth_offering("k", fresh(8), [3] * 8, [False] * 8)  # (remembered)
    assert low.worth_offering("other", fresh(8), [3] * 8, [False] * 8)
    low.observe(Decision(8, [1] * 8, [False] * 8, True), [1] * 8, [1] * 8, [True] * 8, 0.0, 0.0)
    assert low.worth_offering("k", fresh(8), [3] * 8, [False] * 8)  # records changed: asked again


def model_only(rate: float, drafts: int) -> dict[bool, AcceptanceRecord]:
    """A pair record of a model's drafts alone: `drafts` first drafts, accepted at `rate`."""
    rec = AcceptanceRecord()
    rec.reached, rec.accepted = [drafts], [round(rate * drafts)]
    return {False: rec}


def test_worth_offering_prices_a_source_never_verified_at_its_prior():
    """A hybrid whose first round offered no lookup (a prompt's end matches nothing) and whose model
    drafts were rejected: its lookup has no record yet, yet is worth asking, at its prior's rate
    (0.5 and up); a drafter whose only source is the model is not."""
    hybrid = SpecPolicy(3, table(), pair=model_only(0.02, 1000), sources=(False, True))
    assert hybrid.worth_offering("k", fresh(8), [3] * 8, [False] * 8)
    model = SpecPolicy(3, table(), pair=model_only(0.02, 1000), sources=(False,))
    assert not model.worth_offering("k", fresh(8), [3] * 8, [False] * 8)


def test_a_source_that_looked_bad_early_is_asked_again_later():
    """The spread grows as sqrt(ln t): 8 first drafts all rejected (priced 0.1 + 0.5 x 0.095 at
    t = 1) are not worth asking about at b = 8 (free drafts pay from 0.2: 8 x 1.2 / 24 ms against
    8 / 20 ms); once t passes ~80 (1.05 standard errors) the same record is worth a try, looked
    at again when t reaches 128; once tried often (10,000 drafts rejected) it never is."""
    policy = SpecPolicy(3, table(), pair=model_only(0.0, 8))
    asked = [policy.worth_offering("k", fresh(8), [3] * 8, [False] * 8) for _ in range(2000)]
    assert asked.index(True) == 127  # (the 128th round)
    settled = SpecPolicy(3, table(), pair=model_only(0.0, 10_000))
    assert not any(settled.worth_offering("k", fresh(8), [3] * 8, [False] * 8) for _ in range(2000))


def test_the_exploration_bonus_lifts_the_first_draft_alone():
    """The policy docstring's example: the pair at 8 of 20 first drafts accepted, 3 of 8 second and
    1 of 3 third, at t = 200 (1.15 standard errors): p_1 = 0.53 carries the bonus and the later
    positions shrink toward it, 0.48, 0.46, 0.46, so that 4 drafts are priced at 0.95 tokens. A
    bonus at every position compounded (0.53, 0.66, 0.86, 1.0: 1.49 tokens, where the pair's
    means make 0.66), and a source seen failing past its first draft was priced as if it improved."""
    pair = AcceptanceRecord()
    pair.reached, pair.accepted = [20, 8, 3], [8, 3, 1]
    policy = SpecPolicy(4, pair={True: pair})
    policy._rounds = 200
    assert policy.prior(True) == pytest.approx([0.530, 0.478, 0.455, 0.455], abs=1e-3)
    assert sum(policy.gains(fresh(1), [True], [4])[0]) == pytest.approx(0.951, abs=1e-3)
    policy._rounds = 1  # (t = 1: one standard error, the bonus on p_1 still)
    p1 = 9 / 22 + (9 / 22 * 13 / 22 / 22) ** 0.5 * 0.5
    assert policy.prior(True)[0] == pytest.approx(p1)


def test_held_rows_draft_their_cap_and_the_others_are_planned_around_them():
    """At rate 0.2 every row is plain; one held row (a seeded sampled request) verifies its cap
    whatever it is worth, and with its draft steps paid for, one draft each for the others pays."""
    policy = policy_at(0.2, table=table())
    assert policy.plan(fresh(8), [3] * 8, [None] * 8, [False] * 8).lengths == [0] * 8
    held = policy.plan(fresh(8), [3] * 8, [None] * 8, [True] + [False] * 7)
    assert held.lengths == [3] + [1] * 7
    assert policy.plan(fresh(8), [2] * 8, [None] * 8, [False] * 8).lengths == [0] * 8  # nothing held: as before


def test_a_budget_verifies_the_likeliest_drafts_tetris():
    """TETRIS through the policy (tetris.py's worked example): rows accepting (about) 0.9, 0.8, 0.5
    and 0.5, 0.5, 0.5 by their own records; budget 3 verifies [2, 1], budget 4 [3, 1]; without a
    cost table every row otherwise verifies its cap. Held drafts count against the budget first."""
    strong = record([10 ** 4] * 3, [9000, 8000, 5000])
    weak = record([10 ** 4] * 3, [5000] * 3)
    for budget, expected in ((3, [2, 1]), (4, [3, 1]), (9, [3, 3])):
        policy = SpecPolicy(3, budget=budget)
        assert policy.plan([strong, weak], [3, 3], [None, None], [False, False]).lengths == expected
    assert SpecPolicy(3).plan([strong, weak], [3, 2], [None, None], [False, False]).lengths == [3, 2]
    policy = SpecPolicy(3, budget=2)
    assert policy.plan([strong] * 3, [3] * 3, [None] * 3, [False, False, True]).lengths == [0, 0, 3]
    assert policy.plan([strong, weak, weak], [3, 3, 1], [None] * 3, [False, False, True]).lengths == [1, 0, 1]


@pytest.mark.parametrize("v4", [0.050, 0.032, 0.026])
def test_the_plan_is_at_least_as_good_as_every_fixed_gamma_by_its_own_prices(v4):
    """Rows with different records and caps: the plan's predicted tokens per second is at least
    that of every fixed γ (each row min(γ, cap)), priced by the same table (the old policy's
    `test_plan_is_the_best_of_uniform_lengths`, same numbers; issue 70: never below the best fixed
    γ by more than 2 %)."""
    t = CostTable((1, 8), (1, 4), {(1, 1): 0.01, (1, 4): 0.011, (8, 1): 0.020, (8, 4): v4}, {1: 0.004, 8: 0.004})
    policy = policy_at(0.7, table=t)
    stats = [record([20], [round(20 * a)]) for a in (0.9, 0.8, 0.5, 0.2, 0.7, 0.6, 0.9, 0.95)]
    caps = [3, 3, 3, 3, 1, 3, 2, 3]
    gains = policy.gains(stats, [False] * 8, caps)

    def rate(lengths):
        fed = [sum(1 for n in lengths if n > j) for j in range(max(lengths))]
        return (8 + sum(sum(g[:n]) for g, n in zip(gains, lengths))) / t.round_s(8)(sum(lengths), fed)

    plan = policy.plan(stats, caps, [None] * 8, [False] * 8).lengths
    assert all(n <= k for n, k in zip(plan, caps))
    assert rate(plan) >= max(rate([min(g, k) for k in caps]) for g in range(4)) - 1e-9


# ----------------------------------------------------------------------------- the cost table
def test_a_packed_pass_costs_by_its_longest_row():
    """32 rows, 1 to 5 columns, as measured on the bundled target: one row fed 5 tokens next to 31
    fed 1 costs the full pass less s per token not fed; the same 4 drafts over 4 rows cost less;
    every row full is the table; no drafts is a plain pass."""
    t = CostTable((1, 32), (1, 5), {(1, 1): 0.005, (1, 5): 0.008, (32, 1): 0.0255, (32, 5): 0.0666},
                  {1: 0.001, 32: 0.001}, 0.26e-3)
    assert t.verify(32, 4, 4) == pytest.approx(0.0666 - 0.26e-3 * (32 * 4 - 4))
    assert t.verify(32, 1, 4) < t.verify(32, 4, 4)
    assert t.verify(32, 4, 128) == pytest.approx(0.0666) and t.verify(32, 0, 0) == pytest.approx(0.0255)
    assert t.verify(32, 1, 1) >= t.verify(32, 0, 0)


def test_the_first_draft_of_a_pass_costs_its_measured_jump():
    """costs.py's example: V(8, 1) = 20 ms, V(8, 5) = 36 ms, s = 0.5 ms, J(8) = 5 ms: two rows
    of 4 drafts 25 ms (not 24); one row of 1 draft 25 ms (not 20.5); none 20 ms; one row alone
    pays no jump (V(1, n) was measured with it). J is interpolated over rows from 0 at one row."""
    t = CostTable((1, 8), (1, 5), {(1, 1): 0.010, (1, 5): 0.014, (8, 1): 0.020, (8, 5): 0.036}, {8: 0.002},
                  0.5e-3, {8: 0.005})
    assert t.verify(8, 4, 8) == pytest.approx(0.025) and t.verify(8, 1, 1) == pytest.approx(0.025)
    assert t.verify(8, 0, 0) == pytest.approx(0.020) and t.verify(1, 1, 1) == pytest.approx(0.011)
    assert t.first(1) == 0 and t.first(8) == pytest.approx(0.005) and t.first(4) == pytest.approx(0.005 * 3 / 7)
    seconds = t.round_s(8)
    assert seconds(1, [0]) == pytest.approx(0.025) and seconds(0, []) == pytest.approx(0.020)
    assert CostTable.from_json(json.loads(json.dumps(t.to_json()))) == t


def test_one_deep_row_does_not_pay_for_a_wide_pass():
    """32 rows, one whose lookup drafts 4 for free, accepted ~0.99 by its record, the others at
    ~0.05 (model rows): by tokens alone its drafts look worth a round, but the pass they make 5
    columns wide costs 34.4 ms against 25.5: a plain round. Priced by tokens (s at the profile's
    own slope per token) it drafts."""
    verify = {(1, 1): 0.005, (1, 5): 0.008, (32, 1): 0.0255, (32, 5): 0.0666}
    stats = [record([400] * 4, [396] * 4, looked=True)] + [record([400], [20]) for _ in range(31)]
    by_width = SpecPolicy(4, CostTable((1, 32), (1, 5), verify, {1: 0.001, 32: 0.001}, 0.26e-3))
    offer = [4] + [None] * 31
    assert by_width.plan(stats, [4] * 32, offer, [False] * 32).lengths == [0] * 32
    slope = (0.0666 - 0.0255) / (32 * 4)
    by_tokens = SpecPolicy(4, CostTable((1, 32), (1, 5), verify, {1: 0.001, 32: 0.001}, slope))
    assert by_tokens.plan(stats, [4] * 32, offer, [False] * 32).lengths == [4] + [0] * 31


def test_costs_interpolate_and_follow_measurements():
    t = CostTable((1, 8), (1, 4), {(1, 1): 0.01, (1, 4): 0.011, (8, 1): 0.020, (8, 4): 0.032}, {1: 0.002, 8: 0.002})
    assert t.verify(8, 0, 0) == pytest.approx(0.020) and t.verify(8, 3, 24) == pytest.approx(0.032)
    assert t.verify(8, 1, 8) == pytest.approx(0.024) and t.verify(4, 0, 0) == pytest.approx(0.01 + 3 / 7 * 0.01)
    for _ in range(200):  # a machine twice as slow as profiled in verify passes
        t.correct("verify", t.verify(8, 3, 24), 2 * 0.032)
        t.correct("draft", t.draft(8), 0.002)
    assert t.verify(8, 3, 24) == pytest.approx(0.064, rel=0.01) and t.draft(8) == pytest.approx(0.002)


def test_costs_learn_the_shape_of_drafted_passes():
    """`CostTable.correct`'s example: plain passes measure 1.6x the table's price and drafted ones
    1.2x -> F = 0.75, a drafted pass priced at 1.2x the table's; 100 drafted passes and no plain
    one -> F back toward 1 (0.90); F stays within SHAPE_LIMITS."""
    t = CostTable((1, 8), (1, 4), {(1, 1): 0.01, (1, 4): 0.011, (8, 1): 0.020, (8, 4): 0.032}, {1: 0.002, 8: 0.002})
    plain, drafted = t.verify(8, 0, 0), t.verify(8, 3, 24)
    for _ in range(300):
        t.correct("verify", t.verify(8, 0, 0), 1.6 * plain)
        t.correct("verify", t.verify(8, 3, 24), 1.2 * drafted, drafted=True)
    assert t.scale["drafted"] == pytest.approx(0.75, rel=1e-3)
    assert t.verify(8, 3, 24) == pytest.approx(1.2 * drafted, rel=0.01)
    assert t.verify(8, 0, 0) == pytest.approx(1.6 * plain, rel=0.01)
    assert t.round_s(8)(24, [8, 8, 8]) - 3 * t.draft(8) == pytest.approx(t.verify(8, 3, 24))
    for _ in range(100):
        t.correct("verify", t.verify(8, 3, 24), 1.2 * drafted, drafted=True)
    assert t.scale["drafted"] == pytest.approx(0.75 ** (0.98 ** 51), rel=1e-3)  # (the last plain pass + 50: fresh)
    for _ in range(300):
        t.correct("verify", t.verify(8, 0, 0), 10 * plain)
        t.correct("verify", t.verify(8, 3, 24), 1.0 * drafted, drafted=True)
    assert t.scale["drafted"] == pytest.approx(0.5)


def test_a_policy_that_drafts_every_round_makes_one_plain_to_measure_the_shape():
    """F rests on plain and drafted passes both: after 8 drafted passes and no plain one, and then
    whenever none was seen for 50 passes (`CostTable.plain_due`), the plan is a plain round; held
    (seeded sampled) rows keep their caps. Never before a drafted pass was seen."""
    policy = policy_at(0.9, table=table())
    plans = []
    for _ in range(120):
        assert not policy.table.plain_due() or policy.table._seen.get(True)
        decision = policy.plan(fresh(8), [3] * 8, [None] * 8, [False] * 8)
        plans.append(any(decision.lengths))
        draft, verify = policy.predicted(decision, decision.lengths)
        policy.observe(decision, decision.lengths, [3] * 8, [False] * 8, draft, verify)
    assert [i for i, drafted in enumerate(plans) if not drafted] == [8, 59, 110]
    due = copy.deepcopy(policy)
    for _ in range(50):
        due.table.correct("verify", 0.03, 0.03, drafted=True)
    assert due.table.plain_due() and due.plan(fresh(8), [3] * 8, [None] * 8, [True] * 8).lengths == [3] * 8


def test_the_policy_corrects_each_stage_by_what_it_took():
    """`observe` corrects the table's draft and verify stages apart, from the round's plan: rounds
    whose verify passes take 1.3x the table's price and whose draft steps take what it says."""
    policy = policy_at(0.6, table=table())
    for _ in range(300):
        decision = policy.plan(fresh(8), [3] * 8, [None] * 8, [False] * 8)
        draft, verify = policy.predicted(decision, decision.lengths)
        base = draft / policy.table.scale["draft"], verify / policy.table.scale["verify"]
        policy.observe(decision, decision.lengths, [0] * 8, [False] * 8, base[0], 1.3 * base[1])
    assert policy.table.scale["verify"] == pytest.approx(1.3, rel=0.01)
    assert policy.table.scale["draft"] == pytest.approx(1.0)


@st.composite
def tables(draw):
    """Tables as `profile.measure` makes them: rows from 1, more rows or tokens never cheaper."""
    rows = tuple(sorted({1} | draw(st.sets(st.integers(2, 64), max_size=2))))
    cols = tuple(range(1, draw(st.integers(2, 6)) + 1))
    verify: dict[tuple[int, int], float] = {}
    for i, r in enumerate(rows):
        for j, c in enumerate(cols):
            below = [1e-3] + ([verify[(rows[i - 1], c)]] if i else []) + ([verify[(r, cols[j - 1])]] if j else [])
            verify[(r, c)] = max(below) + draw(st.floats(0.0, 0.01))
    steps = sorted(draw(st.lists(st.floats(0.0, 0.01), min_size=len(rows), max_size=len(rows))))
    first = {r: (verify[(r, 2)] - verify[(r, 1)]) * draw(st.floats(0.0, 1.0)) for r in rows[1:]}
    return CostTable(rows, cols, verify, dict(zip(rows, steps)), draw(st.floats(0.0, 1e-4)), first)


@settings(max_examples=150, deadline=None)
@given(tables(), st.data())
def test_a_cost_table_hits_its_grid_and_grows_with_tokens(t, data):
    """At the profiled points a table is what was measured (every row fed the same number of
    tokens); between and beyond them it never prices more tokens below fewer: more drafts in the
    same pass, a deeper pass with every row full, more rows, or a draft step over more rows."""
    for (r, c), s in t.verify_s.items():
        assert t.verify(r, c - 1, r * (c - 1)) == pytest.approx(s)
    for r, s in t.draft_s.items():
        assert t.draft(r) == pytest.approx(s)
    b = data.draw(st.integers(1, t.rows[-1]))  # (rows beyond the batch size are never asked for)
    deep = data.draw(st.integers(0, t.cols[-1] + 2))
    totals = [t.verify(b, deep, n) for n in range(deep, b * deep + 1)]
    assert all(x <= y + 1e-12 for x, y in zip(totals, totals[1:]))
    full = [t.verify(b, d, b * d) for d in range(t.cols[-1] + 3)]
    assert all(x <= y + 1e-12 for x, y in zip(full, full[1:]))
    if b < t.rows[-1]:
        assert t.verify(b, 0, 0) <= t.verify(b + 1, 0, 0) + 1e-12 and t.draft(b) <= t.draft(b + 1) + 1e-12


def test_a_cost_table_round_trips_through_json():
    t = table()
    assert CostTable.from_json(json.loads(json.dumps(t.to_json()))) == t


# ----------------------------------------------------------------------------- measuring it
def test_a_profile_times_its_points_in_sweeps():
    """`fastest`: every runner once per sweep, two warm-up sweeps, the fastest of the rest. A slow
    spell of the machine (here the 5th to 8th runs, the first two timed sweeps) costs each point
    two of its five timed runs, where timed one point at a time a spell as long as one point's
    runs takes all of them."""
    clock, order = iter([1, 1, 1, 1, 9, 9, 9, 9, 2, 3, 2, 3, 5, 5]), []

    def runner(name):
        return lambda: order.append(name) or next(clock)

    best = timing.fastest({"a": runner("a"), "b": runner("b")}, repeats=5)
    assert order == ["a", "b"] * 7 and best == {"a": 2, "b": 3}


def test_a_profile_stops_sweeping_once_its_budget_is_spent(monkeypatch):
    """`fastest` with a budget: passes of 2 s each (by an injected clock) get one warm-up sweep (it
    took more than a quarter of the 3 s budget) and two timed sweeps (one alone can be a busy
    moment), then stop at 6 s, not after 7 sweeps; passes of 0.5 s get both warm-ups and as many
    timed sweeps as fit."""
    class Clock:
        now = 0.0

        @classmethod
        def perf_counter(cls):
            return cls.now

    def runner():
        Clock.now += 2.0
        return 2.0

    monkeypatch.setattr(timing, "time", Clock)
    assert timing.fastest({"a": runner}, repeats=5, budget_s=3.0) == {"a": 2.0} and Clock.now == 6.0
    Clock.now = 0.0
    timing.fastest({"a": runner}, repeats=5)
    assert Clock.now == 14.0  # no budget: every sweep
    Clock.now, seen = 0.0, []
    timing.fastest({"a": lambda: seen.append(Clock.now) or setattr(Clock, "now", Clock.now + 0.5) or 0.5},
                   repeats=5, budget_s=3.0)
    assert len(seen) == 7 and Clock.now == 3.5  # 2 warm-ups, then sweeps while under 3 s: 5 timed


def test_cost_tables_are_kept_on_disk(tmp_path, monkeypatch):
    """A cost table is measured once per machine (`batchspec/cache.py`), the target's passes of
    one row count in one KV buffer: with the in-memory cache emptied (a new process), it is read
    back from `BATCHSPEC_CACHE`, the same numbers, after one pass per row count is timed to check
    it; one that says passes cost far more than they do (taken at a busy moment) is measured
    again, as is an unreadable file; `off` writes nothing."""
    p = pair("llama", "perturbed")
    engine = SpecEngine(p, EngineConfig(drafter="draft_model", batch_size=2, gamma=1, adaptive=False))
    measured, checked, buffers = [], [], []
    measure, step_time, kv_buffer = profile.measure, profile.step_time, profile.kv_buffer
    monkeypatch.setattr(profile, "kv_buffer", lambda m, b, c: buffers.append((b, c)) or kv_buffer(m, b, c))
    monkeypatch.setattr(profile, "measure", lambda *a, **k: measured.append(1) or measure(*a, **k))
    monkeypatch.setattr(profile, "step_time", lambda *a, **k: checked.append(1) or step_time(*a, **k))
    monkeypatch.setattr(profile, "_TABLES", {})
    monkeypatch.setattr(profile, "PROFILE_BUDGET_S", 0.5)
    monkeypatch.setenv("BATCHSPEC_CACHE", str(tmp_path))

    def cost_table():
        profile._TABLES.clear()
        return profile.cost_table(p.target, engine.drafter, p.draft, 2, 1)

    first = cost_table()
    files = list((tmp_path / "profiles").iterdir())
    assert measured == [1] and len(files) == 1 and first.draft_s and first.verify_s[(2, 2)] > 0
    assert set(first.first_s) == {2} and 0 <= first.first_s[2] <= first.verify_s[(2, 2)] - first.verify_s[(2, 1)]
    # the target's passes of one row count share one buffer, as wide as the widest
    assert buffers == [(1, profile.CONTEXT + 2), (2, profile.CONTEXT + 2)]
    stale = profile.STALE
    monkeypatch.setattr(profile, "STALE", 0.0)  # (a table of a tiny model is noise itself)
    assert cost_table() == first and len(measured) == 1 and len(checked) == 2  # read back: only the check ran
    monkeypatch.setattr(profile, "STALE", stale)
    busy = json.loads(files[0].read_text())
    busy["verify_s"] = [[b, n, 1000 * s] for b, n, s in busy["verify_s"]]
    files[0].write_text(json.dumps(busy))
    again = cost_table()
    assert len(measured) == 2 and again.verify_s[(1, 1)] < 10 * first.verify_s[(1, 1)]
    assert json.loads(files[0].read_text())["verify_s"] != busy["verify_s"]  # the new one is kept
    files[0].write_text("{not json")
    cost_table()
    assert len(measured) == 3
    files[0].unlink()
    monkeypatch.setenv("BATCHSPEC_CACHE", "off")
    cost_table()
    assert len(measured) == 4 and not list((tmp_path / "profiles").iterdir())


def test_a_kept_table_whose_plain_pass_read_slow_is_measured_again():
    """The worked example of `profile.stale`: a plain pass 20 % faster now than the table says
    means the table was taken at a busy moment (its shape reads drafts as cheap)."""
    from batchspec.sched.costs import CostTable
    from batchspec.sched.profile import stale

    table = CostTable((1, 8), (1, 2), {(1, 1): 0.040, (1, 2): 0.042, (8, 1): 0.054, (8, 2): 0.071}, {}, 0.0, {})
    assert stale(table, {1: 0.032, 8: 0.054}.__getitem__)  # the 1-row plain pass read 25 % slow
    assert not stale(table, {1: 0.038, 8: 0.053}.__getitem__)  # within the noise a check itself carries
    assert stale(table, {1: 0.040, 8: 0.045}.__getitem__)


# ----------------------------------------------------------------------------- exactness with the policy on
def counting_verified(policy) -> list[int]:
    """Drafts verified in each planned round, as the policy is told of them."""
    verified, observe = [], policy.observe
    policy.observe = lambda decision, lengths, *a: verified.append(sum(lengths)) or observe(decision, lengths, *a)
    return verified


@pytest.mark.parametrize("method", ["eqspec", pytest.param("exspec", marks=SLOW)])
@pytest.mark.parametrize("options", [dict(adaptive=True), dict(adaptive=False, budget=5),
                                     pytest.param(dict(adaptive=True, budget=3), marks=SLOW)])
def test_adaptive_and_budgets_keep_greedy_exact(method, options):
    """Greedy output is the target's whatever the policy verifies; a budget C is never exceeded in
    a round (greedy rows hold nothing), and at a fixed γ the budget is what cuts the rounds."""
    p = pair("llama", "perturbed")
    ids = prompts(16, seed=7)
    refs = references(p, ids, 20)
    for bs in (1, 4, 16):
        engine = SpecEngine(p, EngineConfig(drafter="draft_model", method=method, batch_size=bs, gamma=4, **options))
        verified = counting_verified(engine.policy)
        assert [o.token_ids for o in engine.generate(ids, SamplingParams(max_new_tokens=20))] == refs
        decided = engine.last_run.summary()["adaptive"]
        assert decided is not None and sum(decided["gamma_hist"].values()) == engine.last_run.row_rounds
        if "budget" in options:
            assert decided["verified_per_round"] <= options["budget"] and max(verified) <= options["budget"]
            if not options["adaptive"] and bs > 1:
                assert max(verified) == options["budget"]  # (4 x bs drafted: the budget cut them)


def ragged_plan(policy):
    """A plan forced to ragged lengths: even rows 1 draft, odd rows 2 (each within its cap)."""
    def plan(stats, caps, offer, held, left=None):
        caps = [c if o is None else min(c, o) for c, o in zip(caps, offer)]
        lengths = [min(c, 1 + i % 2) for i, c in enumerate(caps)]
        return Decision(len(caps), lengths, [o is None and n > 0 for o, n in zip(offer, lengths)], False)

    policy.plan, policy.worth_offering = plan, lambda *a: True


@pytest.mark.parametrize("drafter", ["draft_model", "hybrid:suffix:20,2", pytest.param("ngram", marks=SLOW)])
def test_ragged_planned_lengths_stay_exact(drafter):
    """Rows planned different lengths (forced here: 1 and 2) are drafted that far and verify only
    that; the draft model commits only what it was fed (debug checks every round): greedy output
    stays exact. A hybrid's rows are recorded by source: its lookup's and its model's."""
    p = pair("llama", "perturbed")
    ids = [x[:10] * 4 for x in prompts(12, seed=3)]  # (text that repeats: the lookups find copies)
    refs = references(p, ids, 16)
    engine = SpecEngine(p, EngineConfig(drafter=drafter, batch_size=4, gamma=4, debug=True))
    ragged_plan(engine.policy)
    outs = engine.generate(ids, SamplingParams(max_new_tokens=16))
    assert [o.token_ids for o in outs] == refs
    verified = engine.stats.gamma_hist
    assert max(verified) == 2 and verified[1] > 0 and verified[2] > 0
    sources = {looked for o in outs for looked in o.stats.records}
    assert sources == {"draft_model": {False}, "ngram": {True}}.get(drafter, {False, True})


@pytest.mark.parametrize("drafter", ["draft_model", "hybrid:ngram", pytest.param("suffix", marks=SLOW)])
def test_a_seeded_sampled_request_samples_the_same_text_in_any_batch(drafter):
    """With the adaptive default, a seeded sampled row is held at its cap (what its drafter offers
    it, from its own tokens), so it samples what it samples alone, next to greedy and unseeded
    rows that the policy plans."""
    p = pair("llama", "perturbed")
    ids = [x[:10] * 3 for x in prompts(8, seed=11)]
    mine = [SamplingParams(temperature=1.0, max_new_tokens=16, seed=40 + i) for i in range(3)]
    alone = [SpecEngine(p, EngineConfig(drafter=drafter, batch_size=1, gamma=3)).generate([x], [sp])[0].token_ids
             for x, sp in zip(ids, mine)]
    others = [SamplingParams(max_new_tokens=20), SamplingParams(temperature=0.8, max_new_tokens=20)] * 2 + \
        [SamplingParams(max_new_tokens=12)]
    engine = SpecEngine(p, EngineConfig(drafter=drafter, batch_size=8, gamma=3))
    outs = engine.generate(ids, mine + others)
    assert [o.token_ids for o in outs[:3]] == alone
    assert len({tuple(a) for a in alone}) > 1
