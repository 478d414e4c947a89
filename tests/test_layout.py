"""Properties of the batch layout: after every round's realignment each row's content is
right-aligned to one width, positions count 0..len-1 over content, padding is masked, and each
row's KV equals that row computed alone."""

from __future__ import annotations

import random

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny import VOCAB, make_model
from transformers import DynamicCache

from batchspec.core.kv_store import KVStore
from batchspec.core.request import Request
from batchspec.core.runner import ModelRunner, layout_inputs
from batchspec.sampling import SamplingParams

MODEL = make_model("llama", 32, 2, seed=0, dtype=torch.float64)
GAMMA = 3


def alone_kv(tokens: list[int]) -> list[torch.Tensor]:
    """Keys per layer of one sequence computed by itself, no padding: [H, len, D] each."""
    cache = DynamicCache()
    with torch.no_grad():
        MODEL(input_ids=torch.tensor([tokens]), past_key_values=cache, use_cache=True)
    return [layer.keys[0] for layer in cache.layers]


def check_round_boundary(runner: ModelRunner, reqs: list[Request]) -> None:
    lay, kv = runner.layout, runner.kv
    total = lay.width + lay.tail
    mask, positions = layout_inputs(lay.start, lay.width, lay.tail)
    for i, r in enumerate(reqs):
        content = r.kv_len["target"] + 1  # committed KV + the newest token, fed now
        assert lay.kept[i] == r.kv_len["target"] and lay.tail == 1
        row = mask[i].tolist()
        assert row == [False] * (total - content) + [True] * content  # right-aligned, padding masked
        assert positions[i].tolist() == [content - 1]  # the newest token sits at position len - 1
        start = int(lay.start[i])
        assert start == total - content
        if lay.kept[i] == 0:
            continue
        alone = alone_kv(r.token_ids[: lay.kept[i]])
        for layer, keys in enumerate(alone):
            got = kv.view[layer, 0][i, :, start:lay.width]
            torch.testing.assert_close(got, keys, rtol=0, atol=1e-9)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 24), min_size=1, max_size=5),
       accepts=st.lists(st.lists(st.integers(0, GAMMA), min_size=5, max_size=5), min_size=1, max_size=4),
       seed=st.integers(0, 10**6))
def test_realignment_invariants(lengths, accepts, seed):
    rng = random.Random(seed)
    runner = ModelRunner(MODEL, "target", VOCAB, block_size=4, debug=True)
    reqs = [Request(i, [rng.randrange(VOCAB) for _ in range(n)], SamplingParams(), frozenset())
            for i, n in enumerate(lengths)]
    tail = runner.begin(reqs, leave=1)
    if tail:
        runner.feed(keep=1)
    runner.commit(reqs, [tail - cp for cp in runner.layout.tail_pad])
    for accepted in accepts:
        runner.begin(reqs, extra=GAMMA)
        check_round_boundary(runner, reqs)
        drafts = torch.tensor([[rng.randrange(VOCAB) for _ in range(GAMMA)] for _ in reqs])
        runner.feed(extra=drafts, keep=GAMMA + 1)
        acc = accepted[: len(reqs)] + [0] * (len(reqs) - len(accepted))
        runner.commit(reqs, [1 + a for a in acc])
        for r, row, a in zip(reqs, drafts.tolist(), acc):
            r.token_ids.extend(row[:a] + [rng.randrange(VOCAB)])  # accepted drafts + a bonus token
    runner.begin(reqs, extra=GAMMA)
    check_round_boundary(runner, reqs)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 40), min_size=1, max_size=6), block=st.integers(1, 8),
       room=st.integers(0, 5))
def test_gather_index_lays_rows_right_aligned(lengths, block, room):
    store = KVStore(1, 1, 1, torch.float64, "cpu", block_size=block, num_blocks=1 + 6 * (40 // block + 1))
    for key, n in enumerate(lengths):  # interleave reservations so block tables are fragmented
        store.reserve(key, n // 2)
    for key, n in enumerate(lengths):
        store.reserve(key, n)
        if n:
            codes = torch.tensor([1000.0 * (key + 1) + p for p in range(n)], dtype=torch.float64)
            values = codes.view(1, 1, 1, n, 1).expand(1, 2, 1, n, 1).contiguous()  # keys and values alike
            store.write(torch.tensor(store.slots(key, 0, n)), values)
    width = max(lengths)
    index = store.gather_index(list(range(len(lengths))), lengths, width, width + room)
    got = store.gather(index)[0, 1].view(len(lengths), width + room)  # the values
    for key, n in enumerate(lengths):
        expect = [0.0] * (width - n) + [1000.0 * (key + 1) + p for p in range(n)] + [0.0] * room
        assert got[key].tolist() == expect


def test_layout_inputs_docstring_example():
    mask, positions = layout_inputs(torch.tensor([2, 0]), 3, 2)
    assert mask.int().tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert positions.tolist() == [[1, 2], [3, 4]]


def test_uniform_acceptance_reuses_the_buffer():
    """Rows that all advance by the same amount need no gather (no realignment)."""
    runner = ModelRunner(MODEL, "target", VOCAB, block_size=4)
    reqs = [Request(i, list(range(1, n + 1)), SamplingParams(), frozenset()) for i, n in enumerate([3, 7, 5])]
    runner.begin(reqs, leave=1)
    runner.feed(keep=1)
    runner.commit(reqs, [2, 6, 4])
    gathers = runner.stats.gathers
    for _ in range(4):
        runner.begin(reqs)
        runner.feed(keep=1)
        runner.commit(reqs, [1, 1, 1])
        for r in reqs:
            r.token_ids.append(7)
    assert runner.stats.gathers == gathers  # the prefill's buffer is already aligned: no gather at all
    runner.begin(reqs, extra=GAMMA)
    runner.feed(extra=torch.zeros(3, GAMMA, dtype=torch.long), keep=GAMMA + 1)
    runner.commit(reqs, [1, 3, 2])  # ragged: the next round must realign
    for r, a in zip(reqs, [0, 2, 1]):
        r.token_ids.extend([7] * (a + 1))
    runner.begin(reqs)
    assert runner.stats.gathers == gathers + 1 and runner.last_layout.padded_rows > 0


def test_replaced_batch_buffers_are_freed_at_once():
    """A BatchKV must not sit in a reference cycle: buffers replaced every few rounds would
    otherwise pile up until the cyclic collector runs (it once took a long run to 24 GB)."""
    import gc
    import weakref

    from batchspec.core.batch_cache import BatchKV

    gc.disable()
    try:
        kv = BatchKV(torch.zeros(2, 2, 1, 3 * 8, 4), rows=3, capacity=8, width=2)
        kv.layers[0].update(torch.ones(3, 1, 1, 4), torch.ones(3, 1, 1, 4))
        buf, cache = weakref.ref(kv.buf), weakref.ref(kv)
        del kv
        assert cache() is None and buf() is None
    finally:
        gc.enable()
