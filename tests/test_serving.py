"""The engine as a serving core: per-round outputs, requests arriving over time, continuous
batching, abort, a KV budget, chunked prefill, and the streaming APIs.

Exactness is the same bar as everywhere: greedy output of every request that was not aborted
equals target-only greedy decoding at batch size 1, whenever it arrived and whoever shared its
batch, under a tight KV budget and chunked prefill too.
"""

from __future__ import annotations

import functools
import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule
from tiny import pair, prompts, references

from batchspec import EngineConfig, SamplingParams, SpecEngine
from batchspec.sched import StaticBatcher, plan_prefill

MAX_NEW = 16
METHODS = ("autoregressive", "eqspec", "exspec")


@functools.cache
def workload():
    p = pair("llama", "perturbed")
    ids = prompts(24, seed=3)
    return p, ids, references(p, ids, MAX_NEW)


def drive(engine: SpecEngine, outs: dict, limit: int = 10_000) -> None:
    """Step until idle, collecting StepOutputs per request id."""
    for _ in range(limit):
        if not engine.has_unfinished():
            return
        for o in engine.step():
            outs.setdefault(o.index, []).append(o)
    raise AssertionError("engine did not become idle")


def assert_no_kv_held(engine: SpecEngine) -> None:
    assert engine.slots.free == engine.rows and not engine.scheduler.resident
    for runner in (engine.target, engine.draft_runner):
        if runner is not None:
            assert not runner.fed


@pytest.mark.parametrize("method", METHODS)
def test_requests_arriving_at_random_rounds_match_the_reference(method):
    p, ids, refs = workload()
    engine = SpecEngine(p, EngineConfig(drafter="draft_model", method=method, batch_size=3, gamma=3, debug=True))
    rng = random.Random(0)
    order = list(range(len(ids)))
    rng.shuffle(order)
    rid_of, outs = {}, {}
    while order or engine.has_unfinished():
        for _ in range(rng.randint(0, 3) if order else 0):
            i = order.pop()
            rid_of[engine.add_request(ids[i], SamplingParams(max_new_tokens=MAX_NEW))] = i
            if not order:
                break
        for o in engine.step():
            outs.setdefault(o.index, []).append(o)
    for rid, i in rid_of.items():
        steps = outs[rid]
        assert [o.finished for o in steps] == [False] * (len(steps) - 1) + [True]  # ends exactly once, last
        assert sum((o.new_token_ids for o in steps), []) == refs[i] == steps[-1].output.token_ids
        assert steps[-1].finish_reason == "length"
    assert_no_kv_held(engine)


@pytest.mark.parametrize("adaptive", [True, False])
@pytest.mark.parametrize("method", METHODS)
def test_tight_kv_budget_and_chunked_prefill_stay_exact(method, adaptive):
    # fixed gamma: the drafter always prefills the requests joining a round, whose slots need not
    # come in order (a freed low slot taken after a higher one); adaptive: whether it does depends
    # on measured costs
    p, ids, refs = workload()
    engine = SpecEngine(p, EngineConfig(drafter="draft_model", adaptive=adaptive,
                                        method=method, batch_size=4, gamma=3, max_prefill_tokens=24, debug=True))
    rows = engine.rows
    budget = rows * (60 + MAX_NEW + 3)  # rows just long enough for the longest request
    engine = SpecEngine(p, EngineConfig(drafter="draft_model", adaptive=adaptive,
                                        method=method, batch_size=4, gamma=3, max_kv_tokens=budget,
                                        max_prefill_tokens=24, debug=True))
    assert engine.kv_tokens == budget and engine.row_capacity == 60 + MAX_NEW + 3
    outs = engine.generate(ids, SamplingParams(max_new_tokens=MAX_NEW))
    assert [o.token_ids for o in outs] == refs
    assert 0 < engine.stats.peak_kv_tokens <= budget
    # prompts longer than 24 slots took chunks of their own before joining a round with the rest
    assert engine.stats.prefill_forwards > 0 and (engine.stats.fused_prefills > 0) == (method != "exspec")
    assert engine.stats.prefill_tokens == sum(len(i) - 1 for i in ids)
    assert_no_kv_held(engine)


def test_budget_too_small_for_a_request_is_refused_up_front():
    p, ids, _ = workload()
    engine = SpecEngine(p, EngineConfig(drafter="draft_model",
                                        method="eqspec", batch_size=2, gamma=3, max_kv_tokens=32))
    with pytest.raises(ValueError, match="KV budget"):
        engine.generate([ids[1]], SamplingParams(max_new_tokens=MAX_NEW))  # 60-token prompt
    assert not engine.has_unfinished()


def test_continuous_refill_beats_fixed_batches_on_rounds():
    """One long request in a fixed batch holds the batch at size 1; refilling keeps it full."""
    p, ids, refs = workload()
    long_short = [SamplingParams(max_new_tokens=MAX_NEW if i % 4 == 0 else 2) for i in range(len(ids))]
    rounds = {}
    for refill in ("continuous", "none"):
        engine = SpecEngine(p, EngineConfig(drafter="draft_model",
                                            method="autoregressive", batch_size=4, refill=refill))
        outs = engine.generate(ids, long_short)
        assert [o.token_ids for o in outs] == [r[: sp.max_new_tokens] for r, sp in zip(refs, long_short)]
        rounds[refill] = engine.stats.rounds
    assert rounds["continuous"] < 0.75 * rounds["none"], rounds


def test_fixed_batches_wait_for_the_whole_batch():
    s = StaticBatcher(2, refill="none")

    class R:
        prefilled = True

        def __init__(self, i):
            self.index, self.num_tokens = i, 5

    reqs = [R(i) for i in range(4)]
    for r in reqs:
        s.add(r)
    assert s.schedule()[0] == reqs[:2]
    s.finish(reqs[0])
    assert s.schedule() == ([], [reqs[1]])
    s = StaticBatcher(2)  # continuous
    for r in reqs:
        s.add(r)
    s.schedule()
    s.finish(reqs[0])
    assert s.schedule() == ([reqs[2]], [reqs[1], reqs[2]])


def test_generate_keeps_requests_queued_earlier_and_the_stats():
    p, ids, refs = workload()
    engine = SpecEngine(p, EngineConfig(drafter="draft_model", method="eqspec", batch_size=4, gamma=3))
    early = engine.add_request(ids[0], SamplingParams(max_new_tokens=MAX_NEW))
    outs = engine.generate(ids[1:5], SamplingParams(max_new_tokens=MAX_NEW))
    assert [o.token_ids for o in outs] == refs[1:5] and [o.index for o in outs] == [0, 1, 2, 3]
    first_rounds = engine.stats.rounds
    assert engine.last_run.rounds <= first_rounds
    rest = {}
    drive(engine, rest)
    assert sum((o.new_token_ids for o in rest[early]), []) == refs[0]  # nothing of it was lost
    assert rest[early][-1].finished
    engine.generate(ids[5:7], SamplingParams(max_new_tokens=MAX_NEW))
    assert engine.stats.rounds > first_rounds  # cumulative, never reset


def test_abort_from_another_thread_frees_both_models_kv():
    p, ids, refs = workload()
    engine = SpecEngine(p, EngineConfig(drafter="draft_model", method="eqspec", batch_size=4, gamma=3))
    rids = [engine.add_request(i, SamplingParams(max_new_tokens=MAX_NEW)) for i in ids[:6]]
    engine.step()
    engine.step()
    t = threading.Thread(target=lambda: [engine.abort(r) for r in rids[::2]])
    t.start()
    t.join()
    engine.abort(10_000)  # unknown ids are ignored
    outs = {}
    drive(engine, outs)
    for k, rid in enumerate(rids):
        last = outs[rid][-1]
        assert sum(o.finished for o in outs[rid]) == 1
        if k % 2 == 0:
            assert last.finish_reason == "abort" and refs[k][: len(last.output.token_ids)] == last.output.token_ids
        else:
            assert last.output.token_ids == refs[k]
    engine.abort(rids[1])  # already finished: nothing happens
    assert engine.step() == [] and engine.stats.aborted == 3
    assert_no_kv_held(engine)


def test_stream_iterator_and_early_close():
    p, ids, refs = workload()
    engine = SpecEngine(p, EngineConfig(drafter="draft_model", method="exspec", batch_size=2, gamma=3))
    pieces: dict[int, list[int]] = {}
    for out in engine.stream(ids[:4], SamplingParams(max_new_tokens=MAX_NEW)):
        pieces.setdefault(out.index, []).extend(out.new_token_ids)
        if out.finished:
            assert out.output.token_ids == pieces[out.index]
    assert [pieces[i] for i in range(4)] == refs[:4]
    gen = engine.stream(ids[4:8], SamplingParams(max_new_tokens=MAX_NEW))
    next(gen)
    gen.close()  # the unfinished prompts are aborted at the next round boundary
    drive(engine, {})
    assert_no_kv_held(engine)


def test_oracle_drafter_through_step():
    p, ids, refs = workload()
    engine = SpecEngine(p, EngineConfig(method="eqspec", batch_size=4, gamma=3, drafter="oracle:0.6", adaptive=False))
    rids = [engine.add_request(i, SamplingParams(max_new_tokens=MAX_NEW)) for i in ids[:5]]
    outs = {}
    drive(engine, outs)
    assert [outs[r][-1].output.token_ids for r in rids] == refs[:5]
    assert 0 < engine.stats.accepted < engine.stats.drafted


def test_seeded_samples_do_not_depend_on_arrival_or_company():
    p, ids, _ = workload()
    sp = SamplingParams(temperature=1.0, seed=1234, max_new_tokens=MAX_NEW)
    alone = SpecEngine(p, EngineConfig(drafter="draft_model",
                                       method="eqspec", batch_size=1, gamma=3)).generate([ids[2]], sp)[0].token_ids
    for method in ("eqspec", "exspec"):
        engine = SpecEngine(p, EngineConfig(drafter="draft_model",
                                            method=method, batch_size=4, gamma=3, max_prefill_tokens=16))
        for k, other in enumerate(ids[5:12]):
            engine.add_request(other, SamplingParams(temperature=0.8, seed=k, max_new_tokens=MAX_NEW))
        engine.step()
        engine.step()
        rid = engine.add_request(ids[2], sp)  # arrives late, into a busy engine
        outs = {}
        drive(engine, outs)
        assert outs[rid][-1].output.token_ids == alone, method


def test_plan_prefill_docstring_example():
    assert plan_prefill([10, 2, 3], 8) == [8, 0, 0]
    assert plan_prefill([3, 3, 3], 9) == [3, 3, 3]


@settings(max_examples=200, deadline=None)
@given(remaining=st.lists(st.integers(1, 50), min_size=1, max_size=10), budget=st.integers(1, 64))
def test_plan_prefill_respects_the_budget(remaining, budget):
    chunk = plan_prefill(remaining, budget)
    fed = [c for c in chunk if c]
    assert fed and all(0 <= c <= r for c, r in zip(chunk, remaining))
    assert len(fed) * max(fed) <= max(budget, 1)  # rows x width slots
    n = len(fed)
    assert all(c > 0 for c in chunk[:n]) and not any(chunk[n:])  # first come, first served


class ServingMachine(RuleBasedStateMachine):
    """Random interleavings of add / abort / step / generate against one engine."""

    @initialize(method=st.sampled_from(METHODS), prefill=st.sampled_from([2048, 16]))
    def build(self, method, prefill):
        self.p, self.ids, self.refs = workload()
        self.engine = SpecEngine(self.p, EngineConfig(drafter="draft_model",
                                                      method=method, batch_size=3, gamma=3, max_prefill_tokens=prefill,
                                                      debug=True))
        self.expected: dict[int, list[int]] = {}
        self.tokens: dict[int, list[int]] = {}
        self.ended: dict[int, str] = {}

    def record(self, outs) -> None:
        for o in outs:
            assert o.index in self.expected and o.index not in self.ended, "reported after it ended"
            self.tokens.setdefault(o.index, []).extend(o.new_token_ids)
            if o.finished:
                self.ended[o.index] = o.finish_reason
                assert o.output.token_ids == self.tokens[o.index]

    @rule(i=st.integers(0, 23), max_new=st.integers(0, MAX_NEW))
    def add(self, i, max_new):
        rid = self.engine.add_request(self.ids[i], SamplingParams(max_new_tokens=max_new))
        self.expected[rid] = self.refs[i][:max_new]

    @rule(k=st.integers(0, 63))
    def abort(self, k):
        # (which requests are live depends on how many tokens rounds committed, which an adaptive
        # plan decides by the clock: drawing from them would make hypothesis's data depend on timing)
        live = sorted(set(self.expected) - set(self.ended))
        if live:
            self.engine.abort(live[k % len(live)])

    @rule()
    def step(self):
        self.record(self.engine.step())

    @rule(idx=st.lists(st.integers(0, 23), max_size=3))
    def generate(self, idx):
        outs = self.engine.generate([self.ids[i] for i in idx], SamplingParams(max_new_tokens=MAX_NEW))
        assert [o.token_ids for o in outs] == [self.refs[i] for i in idx]

    def teardown(self):
        if not hasattr(self, "engine"):
            return
        for _ in range(10_000):
            if not self.engine.has_unfinished():
                break
            self.record(self.engine.step())
        assert set(self.ended) == set(self.expected)  # every request ended, exactly once (see record)
        for rid, reason in self.ended.items():
            got, want = self.tokens.get(rid, []), self.expected[rid]
            assert got == want if reason != "abort" else want[: len(got)] == got
        assert_no_kv_held(self.engine)


TestServingMachine = ServingMachine.TestCase
TestServingMachine.settings = settings(max_examples=20, stateful_step_count=60, deadline=None)


def test_async_streams_and_cancellation():
    import asyncio

    from batchspec.async_engine import AsyncEngine, QueueFull

    p, ids, refs = workload()
    engine = AsyncEngine(SpecEngine(p, EngineConfig(drafter="draft_model",
                                                    method="eqspec", batch_size=4, gamma=3)), max_waiting=64)

    async def collect(i):
        toks = []
        async for out in engine.stream(ids[i], SamplingParams(max_new_tokens=MAX_NEW)):
            toks.extend(out.new_token_ids)
        return toks

    async def cancel_midway(i):
        async for _ in engine.stream(ids[i], SamplingParams(max_new_tokens=MAX_NEW)):
            raise asyncio.CancelledError  # the client went away after the first round

    async def main():
        got = await asyncio.gather(*(collect(i) for i in range(6)))
        assert got == refs[:6]
        results = await asyncio.gather(*(cancel_midway(i) for i in range(6, 10)), return_exceptions=True)
        assert all(isinstance(r, asyncio.CancelledError) for r in results)
        out = await engine.generate(ids[10], SamplingParams(max_new_tokens=MAX_NEW))
        assert out.token_ids == refs[10]
        with pytest.raises(ValueError, match="empty"):
            await engine.generate([], SamplingParams())
        engine.max_waiting = 0
        with pytest.raises(QueueFull):
            engine.submit(ids[0])

    try:
        asyncio.run(main())
        for _ in range(100):  # the aborts take effect at the next round boundary
            if not engine.engine.has_unfinished():
                break
            threading.Event().wait(0.02)
        assert engine.engine.stats.aborted == 4
        assert_no_kv_held(engine.engine)
    finally:
        engine.close()


def test_the_loop_runs_on_the_calling_thread_when_asked():
    """`start=False`: no loop thread; `run()` steps the engine on the caller's thread (what `serve`
    does, see AsyncEngine) while coroutines on another thread's event loop submit and stream, and
    returns once `alive()` turns false."""
    import asyncio

    from batchspec.async_engine import AsyncEngine

    p, ids, refs = workload()
    stepped_on = set()
    engine = AsyncEngine(SpecEngine(p, EngineConfig(drafter="draft_model", batch_size=4, gamma=3)), start=False,
                         on_step=lambda outs: stepped_on.add(threading.current_thread()))
    got = {}

    def client():
        async def main():
            return await asyncio.gather(*(engine.generate(ids[i], SamplingParams(max_new_tokens=MAX_NEW))
                                          for i in range(5)))
        got["outs"] = asyncio.run(main())

    thread = threading.Thread(target=client)
    thread.start()
    try:
        engine.run(alive=thread.is_alive)
        thread.join()
    finally:
        engine.close()
    assert [o.token_ids for o in got["outs"]] == refs[:5]
    assert stepped_on == {threading.current_thread()}
    threaded = AsyncEngine(engine.engine)
    try:
        with pytest.raises(RuntimeError, match="own thread"):
            threaded.run()
    finally:
        threaded.close()


def test_few_requests_run_on_few_threads():
    """`few_rows`: while at most that many requests are in, rounds run on `few_threads` torch
    threads; more requests get every thread back; closing leaves the setting as it was found.
    Output stays exact either way."""
    import asyncio

    import torch

    from batchspec.async_engine import AsyncEngine

    p, ids, refs = workload()
    seen: list[tuple[int, int]] = []  # (requests that advanced, torch threads) per step
    before = torch.get_num_threads()
    engine = AsyncEngine(SpecEngine(p, EngineConfig(drafter="draft_model", batch_size=4, gamma=3)),
                         few_rows=1, few_threads=1, on_step=lambda outs: seen.append(
                             (len({o.index for o in outs}), torch.get_num_threads())))
    torch.set_num_threads(2)  # the machine may have one core: give the test two threads to take away
    engine.all_threads = 2

    async def main():  # several requests first, one last: the engine ends on few threads
        many = await asyncio.gather(*(engine.generate(ids[i], SamplingParams(max_new_tokens=MAX_NEW))
                                      for i in range(4)))
        one = await engine.generate(ids[4], SamplingParams(max_new_tokens=MAX_NEW))
        return [o.token_ids for o in many] + [one.token_ids]

    try:
        assert asyncio.run(main()) == refs[:5]
        assert seen[-1] == (1, 1)  # the last rounds ran on one thread
    finally:
        engine.close()
    assert torch.get_num_threads() == 2
    torch.set_num_threads(before)
    assert any(n == 1 and t == 1 for n, t in seen) and any(n > 1 and t == 2 for n, t in seen)
