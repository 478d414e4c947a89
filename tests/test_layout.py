"""Properties of the KV layout (core/rows.py): after any sequence of joins, rounds that feed rows
different numbers of tokens and keep a prefix of them (rejection), leaves and row moves, each
row's visible KV equals that row computed alone, positions run 0..len-1 over its content, and
nothing beyond its length is visible."""

from __future__ import annotations

import random

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny import VOCAB, make_model
from transformers import DynamicCache

from batchspec.core.forward import cache_arg
from batchspec.core.request import Request
from batchspec.core.rows import RowKV
from batchspec.core.runner import ModelRunner, row_inputs
from batchspec.sampling import SamplingParams
from batchspec.sched.slots import SlotTable, arrange, is_tight

MODEL = make_model("llama", 32, 2, seed=0, dtype=torch.float64)
ROWS, CAPACITY = 6, 48


def alone_kv(tokens: list[int]) -> list[torch.Tensor]:
    """Keys per layer of one sequence computed by itself, no padding: [H, len, D] each."""
    cache = DynamicCache()
    with torch.no_grad():
        MODEL(input_ids=torch.tensor([tokens]), use_cache=True, **{cache_arg(MODEL): cache})
    return [layer.keys[0] for layer in cache.layers]


def check_rows(runner: ModelRunner, reqs: list[Request]) -> None:
    for r in reqs:
        n = r.kv_len.get("target", 0)
        assert n == len(r.token_ids)  # every committed token is content, in order
        if n == 0:
            continue
        for layer, keys in enumerate(alone_kv(r.token_ids)):
            got = runner.kv.data[layer, 0, r.slot, :, :n]
            torch.testing.assert_close(got, keys, rtol=0, atol=1e-9)
    if reqs:  # what the next feed of one token per row would see
        starts = [r.kv_len.get("target", 0) for r in reqs]
        positions, visible = row_inputs(starts, 1, max(starts) + 1, "cpu")
        for i, s in enumerate(starts):
            assert positions[i].tolist() == [s]
            assert visible[i, 0, 0].tolist() == [True] * (s + 1) + [False] * (max(starts) - s)


operation = st.one_of(
    st.tuples(st.just("join"), st.integers(1, 12)),
    st.tuples(st.just("round"), st.lists(st.tuples(st.booleans(), st.integers(0, 3), st.integers(0, 3)),
                                         min_size=ROWS, max_size=ROWS)),
    st.tuples(st.just("leave"), st.integers(0, ROWS - 1)),
    st.tuples(st.just("gather"), st.lists(st.booleans(), min_size=ROWS, max_size=ROWS)),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(operation, min_size=1, max_size=14), seed=st.integers(0, 10**6))
def test_rows_stay_exact_through_rounds_joins_leaves_and_moves(ops, seed):
    rng = random.Random(seed)
    runner = ModelRunner(MODEL, "target", VOCAB, rows=ROWS, capacity=CAPACITY, debug=True)
    slots, resident, next_id = SlotTable(ROWS), [], 0
    for op, arg in ops:
        if op == "join" and slots.free:
            req = Request(next_id, [], SamplingParams(), frozenset())
            next_id += 1
            req.slot = slots.take()
            prompt = [rng.randrange(VOCAB) for _ in range(arg)]
            runner.feed([req], torch.tensor([prompt]), [arg], logits="none")
            runner.commit([req], [arg])
            req.token_ids.extend(prompt)
            resident.append(req)
        elif op == "round" and resident:
            picks = [(r, g, k) for r, (take, g, k) in zip(resident, arg) if take]
            picks = sorted(picks or [(resident[0], 1, 0)], key=lambda p: p[0].slot)
            picks = [(r, g, k) for r, g, k in picks if len(r.token_ids) + 1 + g <= CAPACITY]
            if not picks:
                continue
            batch = [r for r, _, _ in picks]
            counts = [1 + g for _, g, _ in picks]  # the newest token + g drafts, per row
            fed = [[rng.randrange(VOCAB) for _ in range(c)] for c in counts]
            ids = torch.tensor([f + [0] * (max(counts) - len(f)) for f in fed])
            runner.feed(batch, ids, counts, logits="all")
            keep = [1 + min(k, g) for _, g, k in picks]  # a prefix survives verification
            runner.commit(batch, keep)
            for r, f, k in zip(batch, fed, keep):
                r.token_ids.extend(f[:k])
        elif op == "leave" and resident:
            req = resident.pop(arg % len(resident))
            runner.release(req)
            slots.give(req.slot)
        elif op == "gather" and resident:
            batch = [r for r, take in zip(resident, arg) if take] or resident[:1]
            pairs = arrange([r.slot for r in batch], {r.slot for r in resident})
            by_slot = {r.slot: r for r in resident}
            runner.move(pairs, [len(by_slot[src].token_ids) for src, _ in pairs])
            for src, dst in pairs:
                by_slot[src].slot = dst
            slots.moved(pairs)
            assert sorted(slots._free) == sorted(set(range(ROWS)) - {r.slot for r in resident})
            assert is_tight(sorted(r.slot for r in batch))
        check_rows(runner, resident)


def test_arrange_docstring_example():
    assert arrange([1, 6], {1, 2, 3, 4, 5, 6}) == [(6, 0)]
    assert arrange([0, 1], {0, 1, 5}) == []
    assert arrange([2, 3, 4, 9], {0, 1, 2, 3, 4, 9}) == [(4, 0), (0, 4), (9, 1), (1, 9)]


def test_unwritten_columns_are_never_read_as_nan():
    """The buffer starts uninitialised; columns a forward reads are zeroed first, so masked keys
    can never be NaN (0 x NaN would poison the row)."""
    kv = RowKV(1, 1, 2, rows=2, capacity=8, dtype=torch.float64, device="cpu")
    kv.data.fill_(float("nan"))
    kv.make_clean([1], 5)
    assert torch.isfinite(kv.data[:, :, 1, :, :5]).all() and kv.clean == [0, 5]
    kv.move([(1, 0)], [3])  # 3 columns copied: row 0 is clean up to there, and no further
    assert kv.clean[0] == 3 and torch.isfinite(kv.data[:, :, 0, :, :3]).all()


def test_a_request_leaving_touches_no_other_row():
    runner = ModelRunner(MODEL, "target", VOCAB, rows=3, capacity=16)
    reqs = [Request(i, [], SamplingParams(), frozenset()) for i in range(3)]
    for s, r in enumerate(reqs):
        r.slot = s
        runner.feed([r], torch.tensor([[1 + s, 2, 3]]), [3], logits="none")
        runner.commit([r], [3])
        r.token_ids.extend([1 + s, 2, 3])
    def written(row: int) -> torch.Tensor:  # the columns ever written or zeroed (the rest is uninitialised memory)
        return runner.kv.data[:, :, row, :, : runner.kv.clean[row]].clone()

    before = [written(row) for row in range(3)]
    runner.release(reqs[1])
    assert all(torch.equal(written(row), before[row]) for row in range(3))
    runner.feed([reqs[0], reqs[2]], torch.tensor([[5], [6]]), [1, 1])  # slot 1 idle inside the range
    runner.commit([reqs[0], reqs[2]], [1, 1])
    assert torch.equal(written(1)[..., : before[1].shape[-2], :], before[1]) and runner.stats.idle_rows == 1
    for r, t in zip((reqs[0], reqs[2]), (5, 6)):
        r.token_ids.append(t)
    check_rows(runner, [reqs[0], reqs[2]])
