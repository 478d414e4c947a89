"""Planned or standing rounds (sched/standing.py; decode/round.py; AdaptivePolicy._edge)."""

from __future__ import annotations

import pytest
from tiny import pair, prompts, references

from batchspec import EngineConfig, SamplingParams, SpecEngine
from batchspec.sched.adaptive import AdaptivePolicy
from batchspec.sched.cost_model import CostModel
from batchspec.sched.standing import Standing, StandingGate


def planned(gate: StandingGate, rounds: int, edge: float, lengths: list[int], rows: int = 1,
            host_s: float = 0.5e-3, seconds: float = 5e-3) -> None:
    """`rounds` planned rounds, each rated `edge` and verifying `lengths`."""
    for _ in range(rounds):
        if gate.to_rate(rows) is not None:
            gate.rated(rows, edge)
        gate.record(rows, seconds, host_s, False, lengths)


def test_rounds_stand_once_the_plans_edge_is_below_what_planning_costs():
    """The docstring's example: plans chose 2 (L = 2) and rated themselves 1.5 % above it; after
    `probe` standing rounds measured 0.36 ms of host time against 0.52 planned, of 5.5 ms rounds
    (overhead 2.9 %), 7 rounds in 8 stand, the 8th is planned."""
    gate = StandingGate(block=4, probe=2, replan=8)
    assert gate.length(1) is None  # nothing planned yet
    planned(gate, 4, 0.015, [2])  # (the first plan has no L to rate yet)
    assert gate.length(1) is None and gate.mode(1) == 2  # (fewer than `block` plans rated L)
    planned(gate, 1, 0.015, [4])
    assert gate.mode(1) == 2  # (the most frequent)
    for _ in range(2):  # probing: standing rounds' host time is not known yet
        assert gate.length(1) == Standing(2)
        gate.record(1, 5.3e-3, 0.36e-3, True, [2])
    for _ in range(4):
        planned(gate, 1, 0.015, [2], host_s=0.52e-3, seconds=5.5e-3)
    assert 0.015 < gate.overhead(1) < 0.04
    kinds = []
    for _ in range(16):
        n = gate.length(1)
        kinds.append(n)
        if n is None:
            planned(gate, 1, 0.015, [2], host_s=0.52e-3, seconds=5.5e-3)
        else:
            gate.record(1, 5.3e-3, 0.36e-3, True, n.lengths([4]))
    assert kinds == ([Standing(2)] * 7 + [None]) * 2


def test_plans_that_earn_their_cost_are_kept():
    """Rated 10 % above the standing length, with planning 3 % of a round: every round planned;
    and no standing round is ever probed where the plans' edge exceeds `probe_edge`."""
    gate = StandingGate(block=4, probe=2)
    planned(gate, 5, 0.05, [2])
    for _ in range(2):  # probing (5 % < probe_edge)
        assert gate.length(1) == Standing(2)
        gate.record(1, 5e-3, 0.35e-3, True, [2])
    planned(gate, 60, 0.10, [2], host_s=0.5e-3, seconds=5e-3)
    assert gate.overhead(1) == pytest.approx(0.03) and gate.summary()["<2"]["edge"] > 0.08
    assert gate.length(1) is None
    wide = StandingGate(block=4, probe_edge=0.1)
    planned(wide, 8, 0.3, [1, 3, 0, 3], rows=4)
    assert wide.length(4) is None and wide.summary()["<8"]["rounds"] == [8, 0]


def test_plain_plans_give_no_standing_length_and_batch_sizes_are_apart():
    gate = StandingGate(block=2)
    planned(gate, 10, 0.0, [0] * 32, rows=32)
    assert gate.mode(32) is None and gate.length(32) is None
    planned(gate, 10, 0.0, [3], rows=1)
    assert gate.mode(1) == 3 and gate.mode(32) is None


def test_rounds_stand_only_where_the_policy_lets_plans_speculate():
    """Standing turns the policy's plain rounds into speculative ones at L, so it is only tried
    where at least `min_speculative` of the planned rounds speculated: at 32 rows plans rated L
    ~5 % below their own lengths only in the rounds they looked into (edge < `probe_edge`: probes),
    while the policy ran ~90 % of rounds plain. Rounds nothing could draft in count for neither."""
    def rounds(gate, n, declined, lengths=(0,) * 31 + (2,)):
        for _ in range(n):
            if gate.to_rate(32) is not None:
                gate.rated(32, 0.05)
            gate.record(32, 0.03, 1e-3, False, list(lengths), declined=declined)

    gate = StandingGate(block=4)
    rounds(gate, 2, False)  # two plans drafted a row (L = 2), then the policy ran 18 rounds plain
    rounds(gate, 18, True, [0] * 32)
    assert gate.mode(32) == 2 and gate.summary()["<64"]["edge"] < gate.probe_edge
    assert gate.length(32) is None and gate.summary()["<64"]["speculative"] < 0.25
    open_ = StandingGate(block=4)  # the same plans where nothing else could draft: probes
    rounds(open_, 2, False)
    rounds(open_, 18, None, [0] * 32)
    assert open_.length(32) == Standing(2)
    speculating = StandingGate(block=4)  # plans that speculate in half the rounds
    for _ in range(10):
        rounds(speculating, 1, False)
        rounds(speculating, 1, True, [0] * 32)
    assert speculating.length(32) == Standing(2)


@pytest.mark.parametrize("drafter", ["hybrid", "suffix"])
def test_a_round_tells_the_gate_whether_the_policy_ran_it_plain(drafter):
    """`run_round` records each planned round as declined (the policy ran it plain where rows
    could draft: a kept or due plain plan, `may_speculate`'s no, a plan of all zeros) or not (a
    plan that drafts); a round nothing could draft in (a hybrid's lookups found nothing, its
    model off) counts for neither. Plans forced each way; output exact throughout."""
    p = pair("llama", "perturbed")
    ids = [x[:10] * 4 for x in prompts(8, seed=5)]
    refs = references(p, ids, 20)
    engine = SpecEngine(p, EngineConfig(drafter=drafter, batch_size=4, gamma=4, fuse_prefill=False))
    if drafter == "hybrid":  # its model's gate goes by the clock (on a loaded machine it turned the model
        engine.drafter.gate.use = lambda: True  # off, and rounds whose lookups found nothing counted for neither)
    policy, seen = engine.policy, []
    record = policy.standing.record
    policy.standing.length = lambda rows: None  # every round planned

    def spy(rows, seconds, host_s, stood, lengths, sources=None, declined=False):
        seen.append(declined)
        return record(rows, seconds, host_s, stood, lengths, sources, declined)

    policy.standing.record = spy
    policy.may_speculate = lambda *a, **k: True
    for plan, expected in ((lambda alphas, caps, *a, **k: list(caps), {False}),
                           (lambda alphas, caps, *a, **k: [0] * len(caps), {True})):
        policy.plan, seen[:] = plan, []
        assert [o.token_ids for o in engine.generate(ids, SamplingParams(max_new_tokens=20))] == refs
        assert set(seen) - {None} == expected and seen.count(expected.pop()) > len(seen) // 2
    if drafter == "hybrid":  # its lookups are asked for only if even free drafts would pay
        policy.may_speculate, seen[:] = (lambda *a, **k: False), []
        assert [o.token_ids for o in engine.generate(ids, SamplingParams(max_new_tokens=20))] == refs
        assert seen and set(seen) == {True}
    policy.plain_now = lambda *a, **k: True  # every round a kept plain plan
    seen.clear()
    assert [o.token_ids for o in engine.generate(ids, SamplingParams(max_new_tokens=20))] == refs
    assert seen and set(seen) == {True}


def test_the_standing_length_is_the_plans_not_what_the_cut_left():
    """L is learnt from the lengths plans chose, not from those verified after the draft model's
    cut (and TETRIS's prune): standing rounds cut too, so an L learnt after the cut would cut
    twice. Plans forced to 3 drafts a row, the cut stopping every row at its first draft: the
    rounds verify 1, and L is 3. Output exact."""
    p = pair("llama", "perturbed")
    ids = prompts(4, seed=3)
    refs = references(p, ids, 12)
    engine = SpecEngine(p, EngineConfig(drafter="draft_model", batch_size=1, gamma=4, fuse_prefill=False))
    policy = engine.policy
    policy.standing.length = lambda rows: None  # every round planned
    policy.plan = lambda alphas, caps, *a, **k: [min(3, c) for c in caps]
    policy.prune = lambda alphas, lengths, *a, **k: lengths
    engine.drafter.stop = lambda reqs, depth, confidence, lengths: [depth] * len(lengths)
    assert [o.token_ids for o in engine.generate(ids, SamplingParams(max_new_tokens=12))] == refs
    assert max(engine.stats.gamma_hist) == 1  # every round verified one draft at most
    assert policy.standing.mode(1) == 3


def test_old_lengths_count_less():
    gate = StandingGate(block=1, memory=8)
    planned(gate, 6, 0.0, [4])
    planned(gate, 4, 0.0, [2])  # 10 > 8: halved to {4: 3, 2: 2}, then ...
    assert gate.mode(1) == 4
    planned(gate, 2, 0.0, [2])
    assert gate.mode(1) == 2


def test_a_hybrids_rows_have_a_standing_length_per_source():
    """A hybrid's rounds: rows its lookup drafted give the lookup's L, rows its draft model could
    have drafted give the model's, a 0 counted too (at 32 rows plans rarely draft them); rows
    neither could draft count for nothing. Each row stands at its own source's L, at most its cap."""
    gate = StandingGate(block=2)
    sources = [True, True, True, False, False, False, None]
    planned_hybrid = [6, 8, 8, 0, 0, 2, 0]
    for _ in range(3):
        gate.to_rate(7)
        gate.rated(7, 0.0)
        gate.record(7, 0.05, 1e-3, False, planned_hybrid, sources)
    assert gate.mode(7, looked=True) == 8 and gate.mode(7) == 0
    standing = gate.length(7)
    assert standing == Standing(0, 8)
    assert standing.lengths([8, 3, 8, 8], [True, True, False, False]) == [8, 3, 0, 0]
    gate.record(7, 0.05, 1e-3, False, [0] * 7, sources)  # (a plain round says nothing of lengths)
    assert gate.length(7) == Standing(0, 8)
    assert StandingGate(block=1).standing(7) is None  # (nothing drafted yet)


def cost() -> CostModel:
    return CostModel(rows=(1, 8), cols=(1, 2, 3, 4),
                     verify_s={(1, 1): 0.010, (1, 2): 0.0105, (1, 3): 0.011, (1, 4): 0.0115,
                               (8, 1): 0.020, (8, 2): 0.030, (8, 3): 0.040, (8, 4): 0.050},
                     draft_s={1: 0.001, 8: 0.002})


def test_a_plan_rates_its_lengths_against_the_standing_ones():
    """One row, rates 0.9 then 0.8: the plan verifies 4 (the 4th draft still pays at 0.5 ms a
    column); at the standing length 2 the round makes 1 + 0.9 + 0.72 tokens where the plan's
    makes 1 + 0.9 + 0.72 + 0.576 + 0.461: the edge is the ratio of the two rates, both over the
    margin. Standing at 4 rates the same as the plan: edge 0."""
    policy = AdaptivePolicy(cost(), gamma_max=4, prior=0.8, optimism=0.0, margin=1.05)
    policy._positions[False] = [[90.0, 100.0], [80.0, 100.0], [80.0, 100.0], [80.0, 100.0]]
    policy.standing.block = 1
    edges, weighed = [], []
    policy.standing.rated = lambda rows, edge: edges.append(edge)
    policy.standing.to_rate = lambda rows: None
    best = policy._best_lengths
    policy._best_lengths = lambda *args: weighed.append(best(*args)) or weighed[-1]
    lengths = policy.plan([0.9], [4])
    assert lengths == [4]
    rated = weighed[-1][2]
    gains, seconds, tokens, first_fed = rated
    assert gains[0][0] == 0.9 and gains[0][1] == pytest.approx(0.72, abs=0.01)  # (later rates ~0.8)
    plan_rate = (1 + sum(gains[0])) / seconds(4, [1, 1, 1, 1])
    stand_rate = (1 + sum(gains[0][:2])) / seconds(2, [1, 1])
    assert policy._edge(lengths, [2], rated) == pytest.approx(plan_rate / stand_rate - 1)
    assert policy._edge(lengths, [4], rated) == 0.0
    # a plain plan against standing drafts: plain decoding's rate over theirs, over the margin
    assert policy._edge([0], [2], rated) == pytest.approx(max(0.0, (1 / cost().verify(1, 1)) / (stand_rate / 1.05) - 1))
    policy.standing.to_rate = lambda rows: Standing(2)
    policy.plan([0.9], [4])
    assert edges == [pytest.approx(plan_rate / stand_rate - 1)]


@pytest.mark.parametrize(("drafter", "standing"), [("draft_model", Standing(2)), ("hybrid", Standing(2, 2)),
                                                   ("hybrid", Standing(0, 2)), ("suffix", Standing(2))])
def test_standing_rounds_stay_exact_and_skip_the_plan(drafter, standing):
    """Rounds at a standing length (here forced: every round; no prompt joins a round)
    verify min(cap, L) drafts with no plan and no prune, and greedy output stays exact; a
    hybrid's lookup rows are recorded as the lookup's, and its draft model drafts only at an L
    of its own above 0."""
    p = pair("llama", "perturbed")
    ids = [x[:10] * 4 for x in prompts(8, seed=5)]  # (text that repeats: the lookups find copies)
    refs = references(p, ids, 20)
    engine = SpecEngine(p, EngineConfig(drafter=drafter, batch_size=4, gamma=4, fuse_prefill=False, debug=True))
    policy = engine.policy
    policy.standing.length = lambda rows: standing
    policy.plan = policy.prune = lambda *a, **k: pytest.fail("a standing round was planned")
    outs = engine.generate(ids, SamplingParams(max_new_tokens=20))
    assert [o.token_ids for o in outs] == refs
    stats = engine.stats
    assert stats.standing_rounds > 0 and max(stats.gamma_hist) <= 2
    assert stats.summary()["adaptive"]["standing_share"] == stats.standing_rounds / stats.rounds
    looked = sum(reached for _, reached in policy._positions[True])  # lookup drafts, recorded apart
    assert (looked > 0) == (drafter == "hybrid")
    drafted = sum(reached for _, reached in policy._positions[False])  # the draft model's (or suffix's)
    assert (drafted > 0) == (standing.drafted > 0)


def test_a_plain_plan_is_rated_by_what_it_weighed_not_by_free_drafts():
    """A plain plan for known requests also asks whether free drafts would pay (`plan`'s settled
    check): the standing length is rated against the drafts as priced (a draft step, a catch-up),
    not as free ones."""
    policy = AdaptivePolicy(cost(), gamma_max=4, prior=0.5, optimism=0.0, margin=1.05)
    edges = []
    policy.standing.rated = lambda rows, edge: edges.append(edge)
    policy.standing.to_rate = lambda rows: Standing(2)
    weighed = []
    best = policy._best_lengths

    def spy(*args):
        out = best(*args)
        weighed.append(out[2])
        return out

    policy._best_lengths = spy
    assert policy.plan([0.1], [4], first_fed=[20.0], key=("a",)) == [0]
    assert len(weighed) == 2 and weighed[1][3] == [0.0]  # (the check with free drafts ran last)
    assert edges == [pytest.approx(policy._edge([0], [2], weighed[0]))]
    assert edges[0] > policy._edge([0], [2], weighed[1])  # (priced, L's drafts are worth less)


def test_a_catch_up_is_left_out_of_the_edge():
    """A row the draft model is far behind on (first_fed 200: a catch-up worth 200 rows of a step)
    is planned plain, while at the standing length it would catch up now: a one-off that either
    kind of round pays when it first drafts the row, so the edge rates both as if it were paid
    (first_fed 1), and standing loses nothing by it here."""
    policy = AdaptivePolicy(cost(), gamma_max=4, prior=0.8, optimism=0.0, margin=1.05)
    policy._positions[False] = [[90.0, 100.0], [80.0, 100.0], [80.0, 100.0], [80.0, 100.0]]
    weighed = []
    best = policy._best_lengths
    policy._best_lengths = lambda *args: weighed.append(best(*args)) or weighed[-1]
    assert policy.plan([0.9], [4], first_fed=[200.0]) == [0]
    rated = weighed[-1][2]
    gains, seconds, tokens, _ = rated
    assert policy._edge([0], [2], rated) == policy._edge([0], [2], (gains, seconds, tokens, [1.0])) == 0.0
