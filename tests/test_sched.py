"""Scheduling policy on made-up lengths: no models, no tensors."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from batchspec.sched import StaticBatcher, WindowScheduler, pick_batch


def padding(lengths, chosen):
    longest = max(lengths[i] for i in chosen)
    return sum(longest - lengths[i] for i in chosen)


def test_docstring_example():
    assert pick_batch([10, 40, 11, 12, 41, 40], [0] * 6, 3, max_wait=10) == [1, 5, 4]


def test_same_length_group_is_taken_whole():
    lengths = [5, 9, 7, 9, 3, 9, 9, 1]
    chosen = pick_batch(lengths, [0] * 8, 4, max_wait=10)
    assert sorted(chosen) == [1, 3, 5, 6] and padding(lengths, chosen) == 0


def test_starving_requests_are_forced_in():
    lengths = [100, 100, 100, 3]
    waits = [0, 0, 0, 5]
    chosen = pick_batch(lengths, waits, 3, max_wait=5)
    assert 3 in chosen and len(chosen) == 3


@given(lengths=st.lists(st.integers(1, 50), min_size=1, max_size=40), batch=st.integers(1, 12),
       waits=st.data())
def test_pick_batch_properties(lengths, batch, waits):
    w = waits.draw(st.lists(st.integers(0, 6), min_size=len(lengths), max_size=len(lengths)))
    chosen = pick_batch(lengths, w, batch, max_wait=4)
    assert len(chosen) == len(set(chosen)) == min(batch, len(lengths))
    forced = [i for i in range(len(lengths)) if w[i] >= 4]
    if len(forced) <= batch:
        assert set(forced) <= set(chosen)
    if not forced:
        # no batch of the same size has less padding
        best = min(padding(lengths, c) for c in _windows(lengths, len(chosen)))
        assert padding(lengths, chosen) == best


def _windows(lengths, k):
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[s:s + k] for s in range(len(order) - k + 1)]


class Req:
    prefilled = True

    def __init__(self, index, n):
        self.index, self.num_tokens = index, n


def test_fixed_batches_admit_only_when_empty():
    s = StaticBatcher(2, refill="none")
    reqs = [Req(i, 10 - i) for i in range(5)]
    for r in reqs:
        s.add(r)
    admit, batch = s.schedule()
    assert admit == reqs[:2] and batch == reqs[:2]
    s.finish(reqs[0])
    assert s.schedule() == ([], [reqs[1]])  # the row left; nobody joins a fixed batch
    s.finish(reqs[1])
    assert s.schedule()[0] == reqs[2:4]


def test_window_refills_as_soon_as_one_finishes():
    s = WindowScheduler(2, 3)
    reqs = [Req(i, 10 + i) for i in range(5)]
    for r in reqs:
        s.add(r)
    admit, batch = s.schedule()
    assert admit == reqs[:3] and len(batch) == 2
    s.finish(batch[0])
    admit, batch = s.schedule()
    assert admit == [reqs[3]] and len(s.resident) == 3


def test_window_sorts_by_length_when_asked():
    s = WindowScheduler(1, 2, sort_by_length=True)
    reqs = [Req(0, 30), Req(1, 5), Req(2, 20), Req(3, 1)]
    for r in reqs:
        s.add(r)
    admit, _ = s.schedule()
    assert [r.index for r in admit] == [3, 1]


def test_every_resident_request_runs_eventually():
    s = WindowScheduler(2, 6)
    reqs = [Req(i, 10 if i < 5 else 500) for i in range(6)]
    for r in reqs:
        s.add(r)
    seen = set()
    for _ in range(12):
        _, batch = s.schedule()
        seen.update(r.index for r in batch)
        for r in batch:
            r.num_tokens += 1
    assert seen == set(range(6))
