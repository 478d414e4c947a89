"""The gate (sched/gate.py): a confident drafter's rows stopped where their next draft does not pay,
the plan made again at each depth. Its bookkeeping on worked examples, and through the engine:
greedy output stays the target's, and sampling stays lossless, while the gate cuts rows at ragged,
confidence-dependent depths; a gate that reads the drawn token instead fails the same test."""

from __future__ import annotations

import pytest
import torch
from tiny import pair, prompts, references

from batchspec import EngineConfig, SamplingParams, SpecEngine
from batchspec.sched.gate import Calibration, Gate, drive
from batchspec.sched.policy import Decision, SpecPolicy


def floor_plan(floor: float):
    """A stand-in for the policy's planner: every draft whose cumulative gain is at least `floor`."""
    def plan(gains, held, sunk):
        return [max(h, sum(1 for g in row if g >= floor)) for row, h in zip(gains, held)]
    return plan


class Exact(Calibration):
    """Chance = confidence, whatever was learned (the worked examples' arithmetic)."""

    def chance(self, confidence: float) -> float:
        return confidence


def test_the_worked_example():
    """The module docstring: cap 3, rates [0.4, 0.5, 0.5], gains of at least 0.2 kept."""
    gate = Gate([2], [3], [[0.4, 0.5, 0.5]], [True], floor_plan(0.2), Exact())
    assert gate.limits == [3] and gate.live() == [0]
    assert gate.step(1, [0], [0.9]) == [0] and gate.lengths == [1]  # gains 0.9, 0.45, 0.225: go on
    assert gate.step(2, [0], [0.3]) == [] and gate.lengths == [2]  # 0.9, 0.27: d_2 kept, no step for q_3
    assert gate.settle() == [2] and gate.fed([True]) == [1, 1]  # steps 0 and 1
    unsure = Gate([2], [3], [[0.4, 0.5, 0.5]], [True], floor_plan(0.2), Exact())
    assert drive(unsure, [[0.1, 0.9, 0.9]]) == [0] and unsure.fed([True]) == [1]


def test_rows_the_gate_does_not_steer_keep_their_plan():
    """A lookup row (no step) and a held row (stepped to its cap) beside a steered one that stops
    at depth 1: the held row's steps are still counted at every depth."""
    gate = Gate([2, 3, 1], [4, 3, 4], [[0.5] * 4, [0.5] * 3, [0.5] * 4], [False, False, True], floor_plan(0.3),
                Exact())
    assert gate.limits == [2, 3, 4]
    assert drive(gate, [[], [], [0.2, 0.9]]) == [2, 3, 0]
    assert gate.fed([False, True, True]) == [2, 1, 1]  # the held row's 3 steps, the steered row's first


def test_a_sub_gate_maps_a_hybrids_model_rows():
    gate = Gate([1, 2, 2], [4, 4, 4], [[0.9] * 4] * 3, [True, False, True], floor_plan(0.5), Exact())
    sub = gate.sub([0, 2])
    assert sub.live() == [0, 1] and sub.steered == [True, True]
    assert sub.step(1, [0, 1], [0.95, 0.4]) == [0]  # row 0 goes on; row 2 stops before its d_1
    sub.drop(0)
    assert gate.settle() == [0, 2, 0] and sub.settle() == [0, 0]


def test_calibration_learns_an_overconfident_head():
    cal = Calibration()
    assert cal.chance(0.83) == pytest.approx(0.83)
    for _ in range(40):  # drafts at 0.9 accepted one time in four; the draft after a rejection tells nothing
        cal.add([0.9, 0.9], 0)
        cal.add([0.9, 0.9, 0.9], 0)
        cal.add([0.9, 0.9, 0.9], 0)
        cal.add([0.95, 0.1], 1)
    assert cal.reached[9] == 160 and cal.accepted[9] == 40
    assert cal.reached[1] == 40 and cal.accepted[1] == 0
    assert cal.chance(0.9) == pytest.approx((40 + 16 * 0.9) / 176)


def test_the_policy_gates_a_confident_drafters_rows():
    """The first plan starts a row; its confidences then take it deeper, or stop it, and the
    prediction counts the steps the gate let run."""
    from batchspec.sched.costs import CostTable

    # a pass: 20 ms a row, 2 ms a token fed past the first (packed: a shorter row saves its share)
    passes = {(b, c): (0.02 + 0.002 * (c - 1)) * b for b in (1, 2) for c in range(1, 6)}
    table = CostTable((1, 2), (1, 2, 3, 4, 5), passes, {1: 0.001, 2: 0.0015}, token_s=0.002)
    policy = SpecPolicy(4, table, confident=True)
    from batchspec.core.request import RequestStats

    stats = [RequestStats(), RequestStats()]
    decision = policy.plan(stats, [4, 4], [None, None], [False, False])
    assert decision.gate is not None and decision.gate.limits == [4 if n else 0 for n in decision.lengths]
    assert all(decision.lengths)
    lengths = drive(decision.gate, [[0.99, 0.99, 0.99, 0.99], [0.02, 0.9, 0.9, 0.9]])
    assert lengths == [4, 0]
    assert decision.gate.fed(decision.model_rows) == [2, 1, 1, 1]
    draft, _ = policy.predicted(decision, lengths)
    assert draft == pytest.approx(table.draft(2) + 3 * table.draft(1))
    policy.observe(decision, lengths, [4, 0], [False, False], draft, 0.05)
    assert policy.calibration.reached[9] == 4
    plain = SpecPolicy(4, table)
    assert plain.plan(stats, [4, 4], [None, None], [False, False]).gate is None


# ---------------------------------------------------------------------------- through the engine
def gated(monkeypatch, floor: float) -> None:
    """Every round plans every row its cap, and a gate keeping drafts while the product of the
    head's confidences is at least `floor` steers the rows that are not held."""
    def plan(self, stats, caps, offer, held, left=None):
        steered = [o is None and c > 0 and not h for o, c, h in zip(offer, caps, held)]
        caps = [c if o is None else min(c, o) for c, o in zip(caps, offer)]
        gate = Gate(list(caps), list(caps), [[0.5] * c for c in caps], steered, floor_plan(floor), Exact())
        return Decision(len(caps), list(caps), list(steered), True, gate, stats)
    monkeypatch.setattr(SpecPolicy, "plan", plan)
    monkeypatch.setattr(SpecPolicy, "worth_offering", lambda self, *a, **k: True)


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    from batchspec.eagle.formats import save_head
    from batchspec.eagle.head import new_head

    out = tmp_path_factory.mktemp("head")
    head = new_head(pair("llama").target, "eagle3", draft_vocab=200, seed=3)
    with torch.no_grad():  # (confidences spread: a floor of 0.2 stops rows at every depth)
        for w in head.parameters():
            w.mul_(2.0)
    save_head(head, out)
    return out


@pytest.mark.parametrize("method", ["eqspec", "exspec"])
@pytest.mark.parametrize("batch_size", [*(pytest.param(b, marks=pytest.mark.slow) for b in (1, 3)), 8, 32])
def test_a_gated_head_keeps_greedy_output_exact(head_dir, monkeypatch, method, batch_size):
    gated(monkeypatch, 0.2)
    p, ids = pair("llama"), prompts(12)
    engine = SpecEngine(p, EngineConfig(method=method, batch_size=batch_size, gamma=3, adaptive=True,
                                        drafter=f"eagle:{head_dir}", debug=True, max_prefill_tokens=24))
    outs = engine.generate(ids, SamplingParams(max_new_tokens=12))
    assert [o.token_ids for o in outs] == references(p, ids, 12)
    hist = engine.last_run.gamma_hist
    assert hist[1] and hist[2] and hist[3]  # (ragged: the gate stopped rows at every depth)


def test_a_gate_takes_rows_past_the_first_plan(head_dir, monkeypatch):
    """The first plan gives every row one draft; a gate that keeps every draft takes each row to its
    cap (3), and the round verifies all of them, not the first plan's one."""
    def plan(self, stats, caps, offer, held, left=None):
        steered = [o is None and c > 0 and not h for o, c, h in zip(offer, caps, held)]
        first = [min(1, c) for c in caps]
        gate = Gate(first, list(caps), [[0.5] * c for c in caps], steered, floor_plan(0.0), Exact())
        return Decision(len(caps), first, list(steered), True, gate, stats)
    monkeypatch.setattr(SpecPolicy, "plan", plan)
    monkeypatch.setattr(SpecPolicy, "worth_offering", lambda self, *a, **k: True)
    p, ids = pair("llama"), prompts(4)
    engine = SpecEngine(p, EngineConfig(method="eqspec", batch_size=4, gamma=3, adaptive=True,
                                        drafter=f"eagle:{head_dir}"))
    assert [o.token_ids for o in engine.generate(ids, SamplingParams(max_new_tokens=12))] == references(p, ids, 12)
    hist = engine.last_run.gamma_hist
    assert hist[3] > 0 and hist[3] >= hist[1], dict(hist)


def test_a_gated_hybrid_keeps_greedy_output_exact(head_dir, monkeypatch):
    gated(monkeypatch, 0.2)
    p, ids = pair("llama", draft_kind="none"), prompts(12)
    ids = [q + q[: len(q) // 2] for q in ids]  # (repeats: the lookup drafts some rows)
    engine = SpecEngine(p, EngineConfig(method="eqspec", batch_size=8, gamma=3, adaptive=True,
                                        drafter=f"hybrid:suffix+eagle:{head_dir}", debug=True))
    assert [o.token_ids for o in engine.generate(ids, SamplingParams(max_new_tokens=12))] == references(p, ids, 12)
    assert engine.last_run.gamma_hist[1] + engine.last_run.gamma_hist[2]


def sampled_head(tmp_path, monkeypatch, floor: float):
    """Unseeded sampled draws of the first two tokens with a random head over 5 of the 8 ids, every
    row gated at `floor`: (draws, exact joint, the run's draft-length histogram)."""
    from test_sampling import exact_joint, models, sampled

    from batchspec.eagle.formats import save_head
    from batchspec.eagle.head import new_head

    target, _ = models()
    head = new_head(target, "eagle3", draft_vocab=5, seed=2, vocab_ids=torch.tensor([0, 2, 3, 5, 7]))
    with torch.no_grad():  # (confidences spread: a floor of 0.2 cuts rows at every depth)
        for w in head.parameters():
            w.mul_(2.0)
    save_head(head, tmp_path)
    gated(monkeypatch, floor)
    sp = SamplingParams(temperature=1.0)
    draws, engine = sampled(sp, "eqspec", 16, 3, seeded=False, drafter=f"eagle:{tmp_path}", adaptive=True)
    return draws, exact_joint(sp), engine.stats.gamma_hist


@pytest.mark.slow
def test_a_gated_head_samples_the_target(tmp_path, monkeypatch):
    from test_sampling import ALPHA, chi_square

    draws, exact, hist = sampled_head(tmp_path, monkeypatch, 0.2)
    assert hist[1] and hist[2] and hist[3]  # (ragged)
    assert chi_square(draws, exact) > ALPHA


@pytest.mark.slow
def test_a_gate_reading_the_drawn_token_fails_the_same_test(tmp_path, monkeypatch):
    """The counterexample: a 'confidence' read off the drawn draft (q of d_ij, not max q) keeps
    drafts the head happened to draw likely ones of, and the emitted tokens are no longer the
    target's distribution."""
    import test_sampling
    from test_sampling import chi_square

    from batchspec.drafters.eagle import EagleDrafter

    draft = EagleDrafter._draft

    def peeking(self, j, live, at, logits, tokens, probs, uniforms, sampling, ups=None):
        draft(self, j, live, at, logits, tokens, probs, uniforms, sampling, ups)
        rows = [live[k] for k in at]
        return probs[rows, j].gather(-1, tokens[rows, j][:, None])[:, 0]
    monkeypatch.setattr(EagleDrafter, "_draft", peeking)
    monkeypatch.setattr(test_sampling, "N", 2000)  # (at 6,000 draws it fails at p ~ 1e-91)
    draws, exact, _ = sampled_head(tmp_path, monkeypatch, 0.2)
    assert chi_square(draws, exact) < 1e-6
