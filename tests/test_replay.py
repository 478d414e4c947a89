"""The trace-replay simulator (batchspec/sched/replay.py), and the policy judged on recorded traces.

Deterministic and clock-free: replay prices rounds from a trace's cost table and recorded ratios.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from tiny import pair, prompts, references

from batchspec import EngineConfig, SamplingParams, SpecEngine
from batchspec.drafters.hybrid import Alongside, lookup_outcome
from batchspec.sched.costs import CostTable
from batchspec.sched.policy import SpecPolicy
from batchspec.sched.replay import (
    SOURCES,
    PolicyChooser,
    Trace,
    autoregressive,
    clairvoyant,
    compare,
    fixed,
    record,
    replay,
)

TRACES = sorted((Path(__file__).parent / "traces").glob("*.json"))


def _worked_trace() -> Trace:
    """One row, γ 2, drafts by a model; accepted 2, 0, 2, 1; every stage took what the table says
    and each round 1 ms more (host time)."""
    table = CostTable((1,), (1, 2, 3), {(1, 1): 0.010, (1, 2): 0.012, (1, 3): 0.014}, {1: 0.002})
    rounds = [{"rows": [[0, 2, None, False, a]], "offer_s": 0.0, "draft_s": 0.004, "verify_s": 0.014,
               "round_s": 0.019, "fused": False} for a in (2, 0, 2, 1)]
    return Trace(2, table, rounds)


def test_replay_prices_the_worked_example():
    """fixed γ 2: 4 + (2 + 0 + 2 + 1) tokens in 4 x (4 + 14 + 1) ms; γ 1: 4 + 3 in 4 x (2 + 12 + 1);
    plain 4 in 4 x 11; the clairvoyant plan drafts 2, 0, 2, 1: 9 tokens in 19 + 11 + 19 + 15 ms."""
    trace = _worked_trace()
    assert replay(trace, fixed(2)) == pytest.approx(9 / 0.076)
    assert replay(trace, fixed(1)) == pytest.approx(7 / 0.060)
    assert replay(trace, fixed(0)) == pytest.approx(4 / 0.044)
    assert replay(trace, clairvoyant) == pytest.approx(9 / 0.064)


def test_replay_scales_the_table_to_what_the_rounds_measured():
    """Stages recorded at twice the table's seconds are replayed at twice them (medians of the rounds)."""
    trace = _worked_trace()
    for rnd in trace.rounds:
        rnd["draft_s"], rnd["verify_s"], rnd["round_s"] = 0.008, 0.028, 0.037
    assert replay(trace, fixed(0)) == pytest.approx(4 / (4 * (0.020 + 0.001)))


def test_plain_decoding_runs_on_its_own_schedule():
    """`autoregressive`'s worked example: 2 slots, requests emitting 3, 1 and 2 tokens in the
    recorded run (request 2 joined when request 1 finished): plain decoding fills both slots in
    every round, 6 tokens in 3 rounds of 2 rows, where the recorded rounds' own occupancy (2 rows,
    then 2) makes 4 in 2. What the rows would accept as another source (`Trace.view`) does not
    change what they emitted. With one row the two are the same rate."""
    verify = {(r, c): 0.008 + 0.002 * r + 0.001 * (c - 1) for r in (1, 2) for c in (1, 2, 3)}
    table = CostTable((1, 2), (1, 2, 3), verify, {1: 0.002, 2: 0.002})

    def rnd(rows):
        return {"rows": rows, "offer_s": 0.0, "draft_s": 0.004, "verify_s": 0.014, "round_s": 0.019, "fused": False}
    trace = Trace(2, table, [rnd([[0, 2, None, False, 1, [2, 0]], [1, 2, None, False, 0, [0, 0]]]),
                             rnd([[0, 2, None, False, 0, [1, 1]], [2, 2, None, False, 1, [2, 2]]])],
                  meta={"batch_size": 2})
    assert autoregressive(trace) == pytest.approx(6 / (3 * (0.012 + 0.001)))
    assert replay(trace, fixed(0)) == pytest.approx(4 / (2 * (0.012 + 0.001)))
    assert autoregressive(trace.view("lookup")) == pytest.approx(autoregressive(trace))
    one = _worked_trace()  # (one request: 3 + 1 + 3 + 2 tokens, a token a round)
    assert autoregressive(one) == pytest.approx(replay(one, fixed(0))) == pytest.approx(9 / (9 * 0.011))


def test_a_lookups_offer_caps_and_frees_its_rows():
    """A row whose lookup found 1 token verifies at most 1 whatever γ, at no draft step."""
    table = CostTable((1,), (1, 2, 3), {(1, 1): 0.010, (1, 2): 0.012, (1, 3): 0.014}, {1: 0.002})
    rounds = [{"rows": [[0, 2, 1, False, 1]], "offer_s": 0.0005, "draft_s": 0.0, "verify_s": 0.012,
               "round_s": 0.0125, "fused": False}] * 3
    trace = Trace(2, table, rounds)
    assert replay(trace, fixed(2)) == pytest.approx(6 / (3 * (0.012 + 0.0005)))  # (host 0: offer, verify)


def test_the_policy_beats_plain_where_drafts_are_cheap_and_good():
    """Rows that accept everything: the policy drafts; rows that accept nothing: it stops drafting."""
    table = CostTable((1, 8), (1, 2, 3, 4, 5), {(r, c): 0.010 + 0.0005 * (c - 1) * r for r in (1, 8)
                                                for c in (1, 2, 3, 4, 5)}, {1: 0.001, 8: 0.0015})

    def trace(accepted: int) -> Trace:
        rows = [[i, 4, None, False, accepted] for i in range(8)]
        return Trace(4, table, [{"rows": rows, "offer_s": 0.0, "draft_s": 0.006, "verify_s": 0.026,
                                 "round_s": 0.032, "fused": False}] * 200)

    good, bad = compare(trace(4)), compare(trace(0))
    assert good["policy"] > 1.5 * good["plain"]
    assert bad["policy"] >= 0.97 * bad["plain"]  # (a few rounds learn that drafts fail)


VIEWS = [(p, s) for p in TRACES for s in (SOURCES if Trace.load(p).alongside else SOURCES[:1])]


@pytest.mark.parametrize("path,source", VIEWS, ids=[f"{p.stem}-{s}" for p, s in VIEWS])
def test_the_policy_is_near_the_oracle_on_recorded_traces(path, source):
    """Issue 70's goals, on the shipped traces: within 5 % of the hindsight oracle's tokens per
    second, and never more than 2 % below the best fixed γ nor plain decoding on its own schedule,
    for what the defaults run (a hybrid trace as recorded, or as the hybrid drafts). A SmolLM2
    trace recorded alongside replays as its head alone too, and as its lookup alone: there only
    the first goal holds at batch 1, where the head barely pays on this CPU (fixed γ = 1 makes
    1.05x plain decoding) and the policy, having seen its first few drafts rejected, spends ~100
    rounds plain before trying it again (0.97 of fixed γ = 1); and the head alone at batch 32
    makes 0.92 of plain decoding on its own schedule."""
    trace = Trace.load(path)
    res = compare(trace.view(source))
    best = max(v for k, v in res.items() if k.startswith("fixed"))
    assert res["policy"] >= 0.95 * res["oracle"], res
    if source == ("hybrid" if trace.alongside else "recorded"):
        assert res["policy"] >= 0.98 * best, res
        assert res["policy"] >= 0.98 * res["autoregressive"], res  # (issue 71: the defaults never lose > 2 %)


def test_a_trace_recorded_alongside_replays_as_each_source():
    """The view docstring's example: one row of a model's drafts (1 of 4 accepted) and the
    lookup's (2 of 3 would be), one whose lookup found nothing."""
    rows = [[7, 4, None, False, 1, [3, 2]], [8, 4, None, False, 1, [0, 0]]]
    trace = Trace(4, _worked_trace().table, [{"rows": rows, "offer_s": 0.0, "draft_s": 0.004, "verify_s": 0.014,
                                               "round_s": 0.019, "fused": False}])
    assert trace.alongside and trace.sources == (False,)
    assert trace.view("recorded").rounds[0]["rows"] == [[7, 4, None, False, 1], [8, 4, None, False, 1]]
    hybrid = trace.view("hybrid")
    assert hybrid.rounds[0]["rows"] == [[7, 4, 3, False, 2], [8, 4, None, False, 1]]
    assert hybrid.sources == (False, True) and hybrid.run is trace.rounds  # (priced as the run went)
    assert trace.view("lookup").rounds[0]["rows"] == [[7, 4, 3, False, 2], [8, 4, 0, False, 0]]
    with pytest.raises(ValueError, match="one source per row"):
        _worked_trace().view("hybrid")


def test_a_lookup_proposal_is_judged_against_the_final_tokens():
    """Alongside's example: 12 tokens held, [5, 9, 9] proposed, final tokens at 12.. [5, 9, 4]."""

    class Req:
        token_ids = list(range(12)) + [5, 9, 4, 1]
    assert lookup_outcome(Req, 12, [5, 9, 9]) == (3, 2)
    assert lookup_outcome(Req, 14, [4, 1, 3]) == (3, 2)  # (the row ended: nothing past it is accepted)
    assert lookup_outcome(Req, 12, []) == (0, 0)


def test_a_hybrid_is_recorded_alongside(monkeypatch):
    """Recording a hybrid (suffix + draft model) drafts every row by the model, as `draft_model`
    records the same rounds, and judges each lookup proposal against the target's own greedy
    output (computed apart) at the position it was made for."""
    p, ids = pair("llama"), prompts(8, seed=3, max_len=12)
    config = EngineConfig(adaptive=False, gamma=3, batch_size=4, drafter="hybrid")
    held, proposed = [], []  # per row asked: (request, its length then); what the lookup proposed
    offer, take = Alongside.offer, Alongside.take

    def spy_offer(self, reqs, caps):
        held.extend((r, r.num_tokens) for r in reqs)
        return offer(self, reqs, caps)

    def spy_take(self):
        got = take(self)
        proposed.extend(f for _, _, f in got or [])
        return got
    monkeypatch.setattr(Alongside, "offer", spy_offer)
    monkeypatch.setattr(Alongside, "take", spy_take)
    trace = record(SpecEngine(p, config), ids, SamplingParams(max_new_tokens=24))
    plain = record(SpecEngine(p, EngineConfig(**{**config.__dict__, "drafter": "draft_model"})), ids,
                   SamplingParams(max_new_tokens=24))
    assert [[r[:5] for r in rnd["rows"]] for rnd in trace.rounds] == [rnd["rows"] for rnd in plain.rounds]
    looked = [r[5] for rnd in trace.rounds for r in rnd["rows"]]
    assert all(0 <= a <= n <= r[1] for rnd in trace.rounds for r in rnd["rows"] for n, a in [r[5]])
    assert sum(n for n, _ in looked) > 0 and sum(a for _, a in looked) > 0  # (random models repeat themselves)
    finals = {tuple(q): q + out for q, out in zip(ids, references(p, ids, 24))}
    assert len(held) == len(proposed) == len(looked)
    for (req, at), proposal, got in zip(held, proposed, looked):
        final = finals[tuple(req.token_ids[:req.prompt_len])][at:]  # the target's own tokens after the row's
        a = next((j for j, (x, y) in enumerate(zip(proposal, final)) if x != y), min(len(proposal), len(final)))
        assert got == [len(proposal), a]


def test_the_goals_fail_a_policy_that_never_drafts():
    """The check above can fail: always-plain falls short on the shipped traces."""
    traces = [Trace.load(p) for p in TRACES]
    assert traces
    for trace in traces:
        res = compare(trace)
        if res["plain"] < 0.95 * res["oracle"]:
            return
    pytest.fail("no shipped trace tells a policy that never drafts from the oracle")


def test_a_recorded_trace_replays_what_the_run_did(tmp_path):
    """Recorded at fixed γ, the trace's own `fixed(γ)` replay commits exactly the tokens the run
    emitted in its decoding rounds, and a saved trace loads back equal."""
    engine = SpecEngine(pair("llama"), EngineConfig(adaptive=False, gamma=3, batch_size=4, drafter="draft_model"))
    trace = record(engine, prompts(8), SamplingParams(max_new_tokens=12))
    rows = [row for rnd in trace.rounds for row in rnd["rows"]]
    assert len({r[0] for r in rows}) == 8 and all(0 <= r[4] <= r[1] <= 3 for r in rows)
    emitted = sum(1 + r[4] for r in rows)  # rows at cap 0 (joining or at their last token) commit one
    counted = {"tokens": 0}

    def spy(ids, records, caps, offer, held, accepted, costs):
        counted["tokens"] += len(ids) + sum(min(a, c) for a, c in zip(accepted, caps))
        return fixed(3)(ids, records, caps, offer, held, accepted, costs)

    replay(trace, spy)
    assert counted["tokens"] == emitted
    trace.save(tmp_path / "t.json")
    back = Trace.load(tmp_path / "t.json")
    assert back.rounds == trace.rounds and back.table.verify_s == trace.table.verify_s


def test_recording_needs_fixed_gamma():
    engine = SpecEngine(pair("llama"), EngineConfig(gamma=3, batch_size=2, drafter="draft_model"))
    with pytest.raises(ValueError, match="fixed γ"):
        record(engine, prompts(2), SamplingParams(max_new_tokens=4))


def test_replaying_a_policy_does_not_touch_the_trace():
    trace = _worked_trace()
    before = copy.deepcopy(trace)
    chooser = PolicyChooser(SpecPolicy(2, copy.deepcopy(trace.table)))
    replay(trace, chooser, chooser.observe)
    assert trace.rounds == before.rounds and trace.table == before.table


def test_the_oracle_plans_on_each_requests_true_rates():
    """Hindsight's plan reads the truth, whatever the records say: a request whose drafts are all
    accepted drafts to its cap, one whose drafts never are drafts none, beside it in one round."""
    from batchspec.core.request import AcceptanceRecord, RequestStats
    from batchspec.sched.replay import Hindsight

    sure, never = AcceptanceRecord(), AcceptanceRecord()
    for _ in range(20):
        sure.add(3, 3)
        never.add(0, 3)
    passes = {(b, c): 0.02 * b + 0.001 * (c - 1) for b in (1, 2) for c in range(1, 5)}
    oracle = Hindsight(3, CostTable((1, 2), (1, 2, 3, 4), passes, {1: 0.001, 2: 0.0015}), (False,),
                       {(7, False): sure, (8, False): never})
    oracle.ids = [7, 8]
    assert oracle.plan([RequestStats(), RequestStats()], [3, 3], [None, None], [False, False]).lengths == [3, 0]
