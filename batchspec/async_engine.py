"""asyncio over the engine: one thread owns the models and runs `step()`; coroutines submit
requests and await their per-round outputs.

    engine = AsyncEngine(SpecEngine.from_pretrained())
    async for out in engine.stream("def add(a, b):\\n", SamplingParams(max_new_tokens=32)):
        print(out.new_text, end="")          # each verification round's text as it is accepted
    await engine.generate("class Stack:\\n")  # the final Output

The event loop never waits for a round: `add_request()` and `abort()` only queue work for the
loop thread, which hands each StepOutput to the request's asyncio queue. A consumer that stops
early (the client disconnected, the task was cancelled) aborts its request, and its KV is freed
at the next round boundary. An error inside a round fails the requests in flight with that
error, and the loop goes on serving the others.

`on_step(outputs)`, when given, is called on the loop thread after every step: the one place
where engine state (queue, KV in use, the statistics) can be read without racing the rounds.
Outputs reach each event loop in one callback per step, not one per request.

`start=False` leaves the loop to the caller: `run()` runs it on the calling thread until `close()`.
`batchspec serve` does that on the thread that loaded the models, and serves HTTP from another.
With torch's OpenMP build, a process in which two threads have both run parallel regions pays for
it in every later one (two thread pools on the cores): built and warmed up on the main thread, the
bundled target's plain rounds at 8 rows took 25 ms on a loop thread against 16.5 ms on the main
thread, and 14.7 ms with everything on one other thread (five runs each, 64 tokens per row).

`few_rows` (a server's setting, off by default): while at most this many requests are in the
engine, a CPU engine runs its rounds on `few_threads` torch threads (default 1) instead of all of
them, leaving the other cores to the HTTP side. Measured with the loop on its own thread, one
streaming client got 106-130 tokens/s on one thread against 68-88 on two; with the loop on the
main thread (`serve`), two threads are faster (89-105 against 69-72), so `serve` leaves it off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence

import torch

from .core.request import Output, StepOutput
from .engine import SpecEngine
from .sampling import SamplingParams

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """More requests are waiting than `max_waiting` allows."""


class AsyncEngine:
    def __init__(self, engine: SpecEngine, max_waiting: int | None = None,
                 on_step: Callable[[list[StepOutput]], None] | None = None, few_rows: int = 0,
                 few_threads: int = 1, start: bool = True) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.on_step = on_step
        # few threads for few requests: CPU engines only (the setting means nothing to a GPU's kernels)
        self.few_rows = few_rows if torch.device(engine.device).type == "cpu" else 0
        self.few_threads, self.all_threads = few_threads, torch.get_num_threads()
        self._streams: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = False
        self._thread = None
        if start:
            self._thread = threading.Thread(target=self._loop, name="batchspec-engine", daemon=True)
            self._thread.start()

    def run(self, alive: Callable[[], bool] | None = None) -> None:
        """Run the loop on the calling thread (an engine made with `start=False`) until `close()`,
        or until `alive()` turns false (checked after every step, and every 0.1 s while idle)."""
        if self._thread is not None:
            raise RuntimeError("this engine's loop already runs on its own thread")
        self._loop(alive)

    # ----------------------------------------------------------------------------- the loop thread
    def _loop(self, alive: Callable[[], bool] | None = None) -> None:
        engine = self.engine
        while not self._stopped and (alive is None or alive()):
            if not engine.has_unfinished():
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            self._set_threads()
            try:
                outputs = engine.step()
            except Exception as exc:  # keep serving: fail what was in flight, drop it from the engine
                log.exception("a round failed; failing the requests in flight")
                self._fail_all(exc)
                outputs = []
            self._deliver(outputs)
            if self.on_step is not None:
                try:
                    self.on_step(outputs)
                except Exception:  # an observer must not stop the engine
                    log.exception("on_step failed")

    def _set_threads(self) -> None:
        """Few torch threads while few requests are in the engine (see the module docstring)."""
        if self.few_rows <= 0:
            return
        rows = self.engine.num_running() + self.engine.num_waiting()
        want = self.few_threads if rows <= self.few_rows else self.all_threads
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)

    def _deliver(self, outputs: list[StepOutput]) -> None:
        deliver(self._streams, self._lock, outputs)

    def _fail_all(self, exc: Exception) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
        for rid, (loop, queue) in streams.items():
            self.engine.abort(rid)
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(queue.put_nowait, exc)

    @property
    def running(self) -> bool:
        """Whether the loop serves: its thread is alive (with `start=False`: until closed)."""
        return not self._stopped and (self._thread is None or self._thread.is_alive())

    def close(self) -> None:
        """Stop the loop (with `start=False`, call it once `run()` has returned); requests still in
        flight fail (their consumers get a RuntimeError)."""
        self._stopped = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        if self.few_rows > 0:  # per thread with OpenMP builds, process-wide with others: leave it as found
            torch.set_num_threads(self.all_threads)
        self._fail_all(RuntimeError("the engine was closed"))

    # ----------------------------------------------------------------------------- coroutines' side
    def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
               add_special_tokens: bool | None = None, queue: asyncio.Queue | None = None) -> tuple[int, asyncio.Queue]:
        """Queue a request (ValueError for bad input, QueueFull when too many wait); returns its
        id and the asyncio queue its StepOutputs arrive on. Call from the event loop's thread.

        Several requests may share one `queue` (a server's n choices): each StepOutput carries its
        request id in `index`, and a failed round puts the exception once per request."""
        if self._stopped:
            raise RuntimeError("the engine was closed")
        if self.max_waiting is not None and self.engine.num_waiting() >= self.max_waiting:
            raise QueueFull(f"{self.engine.num_waiting()} requests are already waiting (limit {self.max_waiting}); "
                            "try again later")
        queue = queue if queue is not None else asyncio.Queue()
        loop = asyncio.get_running_loop()
        with self._lock:  # registered before the loop thread can report on it
            rid = self.engine.add_request(prompt, params, add_special_tokens=add_special_tokens)
            self._streams[rid] = (loop, queue)
        self._wake.set()
        return rid, queue

    async def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                     add_special_tokens: bool | None = None) -> AsyncIterator[StepOutput]:
        """Each round's StepOutput for one request; the last one has `finished` set."""
        rid, queue = self.submit(prompt, params, add_special_tokens=add_special_tokens)
        async for out in self.follow(rid, queue):
            yield out

    async def follow(self, rid: int, queue: asyncio.Queue) -> AsyncIterator[StepOutput]:
        """The StepOutputs of a submitted request; leaving early aborts it."""
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, Exception):
                    finished = True
                    raise RuntimeError(f"request {rid} failed inside the engine: {out}") from out
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(rid)

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                       add_special_tokens: bool | None = None) -> Output:
        async for out in self.stream(prompt, params, add_special_tokens=add_special_tokens):
            if out.finished:
                return out.output
        raise RuntimeError("the request ended without an output")

    def abort(self, rid: int) -> None:
        with self._lock:
            self._streams.pop(rid, None)
        self.engine.abort(rid)
        self._wake.set()


def deliver(streams: dict, lock, outputs: list[StepOutput]) -> None:
    """Hand each output to its request's queue, {request id: (event loop, queue)} in `streams`,
    one call per event loop; a finished request's entry is removed (under `lock`)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, StepOutput]]] = {}
    with lock:
        for out in outputs:
            target = streams.pop(out.index, None) if out.finished else streams.get(out.index)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], out))
    for loop, items in by_loop.items():
        with contextlib.suppress(RuntimeError):  # that event loop was closed: nobody is listening
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[asyncio.Queue, StepOutput]]) -> None:
    for queue, out in items:
        queue.put_nowait(out)
