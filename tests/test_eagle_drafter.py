"""EagleDrafter driven directly with hand-made target features: its drafts are, row by row, what the
head drafts alone from the row's committed history, through ragged acceptance, rows that skip
rounds, rows joining with their prompts and rounds whose features it never got."""

from __future__ import annotations

import random

import pytest
import torch
from tiny import VOCAB, make_model

from batchspec.core.request import Request
from batchspec.drafters.base import RoundOutcome
from batchspec.drafters.eagle import EagleDrafter
from batchspec.eagle.head import new_head
from batchspec.sampling import BatchSampling, SamplingParams, probabilities, sample

torch.set_num_threads(1)
GAMMA = 4


def make_head(kind: str, draft_vocab: int | None):
    target = make_model("llama", 64, 4, seed=0)
    head = new_head(target, kind, draft_vocab=draft_vocab, seed=5)
    if draft_vocab:
        ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))[:draft_vocab].sort().values
        head.set_vocab(ids)
    with torch.no_grad():  # spread logits: greedy ties impossible
        for p in head.parameters():
            p.mul_(3.0)
    return head.eval()


class World:
    """Requests whose target features are a fixed random table per position (the head does not
    care what produced them); the 'target' accepts a scripted, ragged number of drafts."""

    def __init__(self, head, lengths: list[int], seed: int = 0) -> None:
        self.head, self.rng = head, random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        self.width = head.spec.feature_size * len(head.spec.layers)
        self.feats = {i: torch.randn(512, self.width, generator=gen) for i in range(len(lengths))}
        self.reqs = [Request(i, [self.rng.randrange(VOCAB) for _ in range(n)], SamplingParams(), frozenset(), slot=i)
                     for i, n in enumerate(lengths)]

    def reference(self, req: Request, g: int, base: int = 0) -> list[int]:
        """The head's greedy chain alone: entries (x_p, f_{p-1}) for p = base+1..T, then its drafts."""
        head, t = self.head, req.num_tokens - 1
        ids = torch.tensor([req.token_ids[base + 1:t + 1]])
        kv = head.new_kv()
        with torch.no_grad():
            logits, out = head.step(kv, [0], ids, self.feats[req.index][base:t][None], [0])
            drafts, col = [], t - base
            for _ in range(g):
                d = self.to_target(logits[0, -1:]).argmax(-1)
                drafts.append(int(d))
                logits, out = head.step(kv, [0], d[None], out[:, -1:], [col])
                col += 1
        return drafts

    def to_target(self, logits):
        ids = self.head.target_ids
        if ids is None:
            return logits
        full = torch.full((logits.shape[0], VOCAB), float("-inf"))
        full[:, ids] = logits
        return full


@pytest.mark.parametrize("kind,draft_vocab", [("eagle", None), ("eagle3", 120)])
def test_drafts_equal_the_head_alone_through_ragged_rounds(kind, draft_vocab):
    head = make_head(kind, draft_vocab)
    world = World(head, [7, 1, 12, 3])
    reqs = world.reqs
    drafter = EagleDrafter(head, VOCAB)
    # the prefill of tokens [0, len - 1) of rows longer than one token, features left-aligned
    pre = [r for r in reqs if r.num_tokens > 1]
    ends = [r.num_tokens - 1 for r in pre]
    hidden = torch.zeros(len(pre), max(ends), world.width)
    for i, (r, e) in enumerate(zip(pre, ends)):
        hidden[i, :e] = world.feats[r.index][:e]
    drafter.prefill(pre, ends, hidden)
    greedy = BatchSampling.of([SamplingParams()] * len(reqs), "cpu")
    checked = 0
    for round_ in range(12):
        lengths = [world.rng.choice([0, 1, 2, GAMMA]) if round_ else GAMMA for _ in reqs]
        proposal = drafter.propose(reqs, lengths, None, greedy)
        got = proposal.lengths or lengths
        for i, r in enumerate(reqs):
            if got[i]:
                assert proposal.tokens[i, :got[i]].tolist() == world.reference(r, got[i]), (round_, i)
                checked += 1
        # the target: accepts a ragged prefix; features of rejected drafts are garbage
        accepted = [world.rng.randint(0, n) for n in got]
        width = 1 + max(got)
        states = torch.randn(len(reqs), width, world.width) * 100
        for i, r in enumerate(reqs):
            t = r.num_tokens - 1
            states[i, :1 + accepted[i]] = world.feats[r.index][t:t + 1 + accepted[i]]
        drafter.observe(reqs, RoundOutcome(accepted, got, hidden=states))
        for i, r in enumerate(reqs):  # (then the round appends its tokens)
            r.token_ids += proposal.tokens[i, :accepted[i]].tolist() + [world.rng.randrange(VOCAB)]
    assert checked > 20
    # the 1-token prompt had no features at first: it drafted nothing in round 0, then did
    assert reqs[1].kv_len["eagle"] > 0


def test_rows_joining_with_prompts_and_missing_rounds():
    head = make_head("eagle", None)
    world = World(head, [5, 9], seed=3)
    a, b = world.reqs
    drafter = EagleDrafter(head, VOCAB)
    greedy = BatchSampling.of([SamplingParams()] * 2, "cpu")
    # b joins the round with its prompt (leads 8 columns before its newest token); a was prefilled
    drafter.prefill([a], [4], world.feats[0][None, :4])
    prop = drafter.propose([a, b], [2, 0], None, greedy)
    assert prop.tokens[0].tolist() == world.reference(a, 2)
    states = torch.zeros(2, 9, world.width)
    states[0, :2] = world.feats[0][4:6]
    states[1, :9] = world.feats[1][:9]
    drafter.observe([a, b], RoundOutcome([1, 0], [2, 0], hidden=states, leads=[0, 8]))
    a.token_ids += [int(prop.tokens[0, 0]), 7]
    b.token_ids += [11]
    prop = drafter.propose([a, b], [3, 3], None, greedy)
    assert prop.lengths is None
    assert prop.tokens[0].tolist() == world.reference(a, 3)
    assert prop.tokens[1].tolist() == world.reference(b, 3)
    # a round whose features the drafter is not given: b cannot draft from its newest position,
    # and after the next round's features it starts again from them (a gap: a new base)
    drafter.observe([a, b], RoundOutcome([0, 0], [3, 3], hidden=None))
    a.token_ids += [3]
    b.token_ids += [4]
    prop = drafter.propose([a, b], [2, 2], None, greedy)
    assert prop.lengths == [0, 0]
    t = b.num_tokens - 1
    states = torch.zeros(2, 1, world.width)
    states[0, 0], states[1, 0] = world.feats[0][a.num_tokens - 1], world.feats[1][t]
    drafter.observe([a, b], RoundOutcome([0, 0], [0, 0], hidden=states))
    a.token_ids += [5]
    b.token_ids += [6]
    prop = drafter.propose([a, b], [2, 2], None, greedy)
    assert prop.tokens[1].tolist() == world.reference(b, 2, base=t)
    assert prop.tokens[0].tolist() == world.reference(a, 2, base=a.num_tokens - 2)
    drafter.release(a)
    assert "eagle" not in a.kv_len and drafter.free == [0]


@pytest.mark.parametrize("start", [0, 3, 7])
def test_a_row_fed_again_takes_the_new_features(start):
    """Prefill with counts over positions the row holds (the target fed the row again: LongRoPE's
    regime change re-prefills): its features from `start` on replace the old, committed entries
    built on them included; the drafts are the head's alone from the new features."""
    head = make_head("eagle", None)
    world = World(head, [10], seed=4)
    (req,) = world.reqs
    greedy = BatchSampling.of([SamplingParams()], "cpu")
    old = world.feats[0].clone()
    world.feats[0][start:] = torch.randn(512 - start, world.width, generator=torch.Generator().manual_seed(9))
    drafter = EagleDrafter(head, VOCAB)
    drafter.prefill([req], [9], old[None, :9])
    drafter.propose([req], [2], None, greedy)  # enters (and commits) entries built on the old features
    assert req.kv_len["eagle"] > 0
    drafter.prefill([req], [9], world.feats[0][None, start:9], counts=[9 - start])
    assert drafter.propose([req], [3], None, greedy).tokens[0].tolist() == world.reference(req, 3)


def test_rounds_without_drafts_pile_features_up_without_copies():
    """Plain rounds (no drafts) hand the drafter one feature a row each: kept as chunks, joined
    once when the row drafts again (no copy of the whole pile per round), and the drafts then are
    the head's alone."""
    head = make_head("eagle", None)
    world = World(head, [6], seed=5)
    (req,) = world.reqs
    greedy = BatchSampling.of([SamplingParams()], "cpu")
    drafter = EagleDrafter(head, VOCAB)
    drafter.prefill([req], [5], world.feats[0][None, :5])
    for _ in range(12):
        t = req.num_tokens - 1
        drafter.observe([req], RoundOutcome([0], [0], hidden=world.feats[0][None, t:t + 1]))
        req.token_ids.append(world.rng.randrange(VOCAB))
    row = drafter.state[req.index]
    assert len(row._chunks) == 13 and row.waiting == 12  # (one chunk a round: nothing was copied)
    assert drafter.propose([req], [3], None, greedy).tokens[0].tolist() == world.reference(req, 3)
    assert len(row._chunks) == 1


def test_sampled_q_is_the_heads_softmax_and_zero_outside_its_vocabulary():
    head = make_head("eagle3", 120)
    world = World(head, [6, 4], seed=7)
    reqs = world.reqs
    drafter = EagleDrafter(head, VOCAB)
    drafter.prefill(reqs, [5, 3], torch.stack([world.feats[0][:5], torch.cat([world.feats[1][:3],
                                                                              torch.zeros(2, world.width)])]))
    params = [SamplingParams(temperature=0.7, top_p=0.9, seed=1), SamplingParams()]
    sampling = BatchSampling.of(params, "cpu")
    u = torch.rand(2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    prop = drafter.propose(reqs, [3, 2], u, sampling)
    q = prop.probs
    assert q.shape == (2, 3, VOCAB)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[head.target_ids] = False
    assert float(q[:, :, outside].abs().sum()) == 0.0
    torch.testing.assert_close(q[0].sum(-1), torch.ones(3))
    assert float(q[1, 0].max()) == 1.0  # greedy row: one-hot
    # row 0's first draft: drawn by `sample` from the head's own softmax under its parameters
    kv = head.new_kv()
    with torch.no_grad():
        logits, _ = head.step(kv, [0], torch.tensor([reqs[0].token_ids[1:6]]), world.feats[0][None, :5], [0])
    want = probabilities(world.to_target(logits[0, -1:])[None], BatchSampling.of(params[:1], "cpu"))[0, 0]
    torch.testing.assert_close(q[0, 0], want)
    assert int(prop.tokens[0, 0]) == int(sample(want[None], u[:1, 0])[0])
    assert drafter.offer(reqs, [3, 3]) == [None, None]
    assert drafter.step_probe(2)() > 0


def test_a_speculative_loop_through_the_runner():
    """The contract the engine wires, end to end on a tiny target: prefill chunks and verify passes
    through `ModelRunner.feed(hidden=drafter.features)`, greedy verification, ragged lengths and
    acceptance; each proposal equals the head's chain from the target's true features
    (`output_hidden_states` over the whole sequence), and the output is the target's greedy one."""
    from batchspec.core.runner import ModelRunner, padded_ids

    target = make_model("llama", 64, 4, seed=0)
    head = new_head(target, "eagle3", draft_vocab=200, seed=4)
    drafter = EagleDrafter(head, VOCAB)
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (6, 1, 11)]
    reqs = [Request(i, list(p), SamplingParams(), frozenset(), slot=i) for i, p in enumerate(prompts)]
    runner = ModelRunner(target, "target", VOCAB, rows=3, capacity=64)
    for lo, hi in ((0, 4), (4, 99)):  # the prefill in two chunks: tokens [lo, hi) of [0, len - 1)
        rows = [r for r in reqs if min(hi, r.num_tokens - 1) > lo]
        chunks = [r.token_ids[lo:min(hi, r.num_tokens - 1)] for r in rows]
        counts = [len(c) for c in chunks]
        _, states = runner.feed(rows, padded_ids(chunks, "cpu"), counts, logits="none", hidden=drafter.features)
        runner.commit(rows, counts)
        drafter.prefill(rows, [lo + c for c in counts], states, counts=counts if lo else None)  # (both forms)
    greedy = BatchSampling.of([SamplingParams()] * 3, "cpu")
    for _ in range(10):
        lengths = [rng.choice([0, 1, 3]) for _ in reqs]
        prop = drafter.propose(reqs, lengths, None, greedy)
        lengths = prop.lengths or lengths
        for i, r in enumerate(reqs):  # the proposal is the head's chain over the true features
            if lengths[i]:
                with torch.no_grad():
                    out = target(input_ids=torch.tensor([r.token_ids[:-1]]), output_hidden_states=True)
                feats = torch.cat([out.hidden_states[j][0] for j in head.spec.layers], dim=-1)
                world = World.__new__(World)
                world.head, world.feats = head, {r.index: feats}
                assert prop.tokens[i, :lengths[i]].tolist() == world.reference(r, lengths[i])
        ids = padded_ids([[r.token_ids[-1]] + prop.tokens[i, :n].tolist() for i, (r, n) in
                          enumerate(zip(reqs, lengths))], "cpu")
        logits, states = runner.feed(reqs, ids, [1 + n for n in lengths], logits="all", hidden=drafter.features)
        best = logits.argmax(-1)
        accepted = []
        for i, n in enumerate(lengths):
            a = 0
            while a < n and int(prop.tokens[i, a]) == int(best[i, a]):
                a += 1
            accepted.append(a)
        runner.commit(reqs, [1 + a for a in accepted])
        drafter.observe(reqs, RoundOutcome(accepted, lengths, hidden=states))
        for i, r in enumerate(reqs):
            r.token_ids += prop.tokens[i, :accepted[i]].tolist() + [int(best[i, accepted[i]])]
    for p, r in zip(prompts, reqs):  # the target's own greedy text
        with torch.no_grad():
            ref = target.generate(torch.tensor([p]), max_new_tokens=r.num_tokens - len(p), do_sample=False,
                                  attention_mask=torch.ones(1, len(p), dtype=torch.long), pad_token_id=0)
        assert ref[0].tolist() == r.token_ids


def test_a_greedy_draft_round_reads_nothing_back_from_the_device():
    """Every host read of a device tensor (`int(t)`, `.item()`) makes a GPU's host wait for its
    queue to drain, each draft step, and a small model there is bound by its host: a greedy
    round's drafting reads nothing back (the gate, which decides on the drafts' confidence, is
    the one reader, and it is not in this round)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Reads.count += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    head = make_head("eagle3", 120)
    world = World(head, [7, 9, 12])
    drafter = EagleDrafter(head, VOCAB)
    ends = [r.num_tokens - 1 for r in world.reqs]
    hidden = torch.stack([world.feats[r.index][:max(ends)] for r in world.reqs])
    drafter.prefill(world.reqs, ends, hidden)
    greedy = BatchSampling.of([SamplingParams()] * 3, "cpu")
    with Reads():
        proposal = drafter.propose(world.reqs, [GAMMA] * 3, None, greedy)
    assert proposal.tokens.shape == (3, GAMMA) and Reads.count == 0
