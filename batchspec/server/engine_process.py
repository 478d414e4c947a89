"""The engine in its own process, so that the HTTP event loop and the rounds share no interpreter
(no GIL between them): `ProcessEngine` offers the server what `AsyncEngine` does (`submit`,
`abort`, `running`, `close`, `on_step`, and `.engine`, here an `EngineView`).

    engine = ProcessEngine.start(target, draft, EngineConfig(), dtype="auto", device="auto")
    rid, queue = engine.submit(token_ids, SamplingParams(max_new_tokens=32))   # on the event loop
    out = await queue.get()                                                   # each round's StepOutput

A spawned child (multiprocessing's "spawn" context) loads the models as `SpecEngine.from_pretrained`
would, warms them up and runs the step loop (engine_child.py). Requests go to it as token ids and
SamplingParams over a multiprocessing queue (a put never blocks the event loop); each round's
StepOutputs come back in one message, with the engine's statistics, queue, rows and KV in use,
which a reader thread hands to the requests' asyncio queues and to `on_step` (the metrics).

The HTTP side keeps the child's tokenizer (sent once at start-up, pad token included) and its
limits, so prompts are tokenized, rendered and checked there (`EngineView.encode` and
`check_request` are SpecEngine's own). When the child dies, every request in flight fails,
`running` turns false (the server answers 503 with Retry-After) and `/health` says so. The child
ends with `close()`, or by itself when the parent process is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from types import SimpleNamespace
from typing import Any

from ..async_engine import QueueFull, deliver
from ..config import EngineConfig
from ..core.request import StepOutput
from ..engine import SpecEngine
from ..sampling import SamplingParams
from . import engine_child

log = logging.getLogger(__name__)
STOP_TIMEOUT = 10.0  # seconds the child gets to end after "stop" before it is terminated


class EngineView:
    """The HTTP side's stand-in for the SpecEngine in the child: its limits and tokenizer (fixed at
    start-up), and its state after the last round (`stats`, `num_waiting()`, ...)."""

    encode = SpecEngine.encode  # the engine's own checks, over the limits the child reported
    check_request = SpecEngine.check_request

    def __init__(self, info: dict[str, Any]) -> None:
        self.pair = SimpleNamespace(tokenizer=info["tokenizer"], vocab_size=info["vocab_size"])
        self.context, self.gamma, self.rows = info["context"], info["gamma"], info["rows"]
        self.row_capacity, self.kv_tokens = info["row_capacity"], info["kv_tokens"]
        self.config: EngineConfig = info["config"]
        self.device = info["device"]
        self.drafter = SimpleNamespace(synthetic=True) if info["synthetic"] else None
        self.update(info["snapshot"], 0)

    def update(self, snap: dict[str, Any], sent: int) -> None:
        self.stats = SimpleNamespace(**snap["stats"])
        self._running, self._kv = snap["running"], snap["kv_in_use"]
        self._unfinished = snap["unfinished"]
        self._waiting, self._received = snap["waiting"], snap["received"]
        self._sent = sent

    def num_waiting(self) -> int:
        """Waiting in the child after its last round, plus those sent since that it had not taken."""
        return self._waiting + self._sent - self._received

    def num_running(self) -> int:
        return self._running

    def kv_tokens_in_use(self) -> int:
        return self._kv

    def has_unfinished(self) -> bool:
        return self._unfinished or self._sent > self._received


class ProcessEngine:
    """`AsyncEngine`'s interface over an engine in a child process (see the module docstring)."""

    def __init__(self, process, commands, results, info: dict[str, Any], max_waiting: int | None = None) -> None:
        self.process, self.commands, self.results = process, commands, results
        self.engine = EngineView(info)
        self.max_waiting = max_waiting
        self.on_step: Callable[[list[StepOutput]], None] | None = None
        self.exitcode: int | None = None
        self._streams: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._next_id = 0
        self._sent = 0
        self._stopped = False  # set once the child has ended or close() was called
        self._closing = False
        self._reader = threading.Thread(target=self._read, name="batchspec-engine-reader", daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, target: str | None = None, draft: str | None = None, config: EngineConfig | None = None, *,
              dtype: str | None = None, device: str | None = None, max_waiting: int | None = None,
              few_rows: int = 0, timeout: float | None = None) -> ProcessEngine:
        """Spawn the engine process and wait until it has loaded and warmed up the models (up to
        `timeout` seconds; None: as long as that takes). ValueError for what the engine refuses
        (a bad model name, an option that does not fit), RuntimeError if the child dies."""
        ctx = multiprocessing.get_context("spawn")
        commands = ctx.Queue()
        results, child_end = ctx.Pipe(duplex=False)
        load = dict(target=target, draft=draft, config=config or EngineConfig(), dtype=dtype, device=device)
        process = ctx.Process(target=engine_child.main, args=(load, commands, child_end, few_rows),
                              name="batchspec-engine", daemon=True)
        process.start()
        child_end.close()
        try:
            if not wait([results, process.sentinel], timeout) or not results.poll():
                raise RuntimeError("the engine process did not start in time" if process.is_alive() else
                                   f"the engine process exited while loading (exit code {process.exitcode})")
            message = results.recv()
        except BaseException:
            _end(process, commands, 0)
            raise
        if message[0] == "failed":
            _end(process, commands, STOP_TIMEOUT)
            _, kind, text = message
            raise (ValueError if kind == "ValueError" else RuntimeError)(
                text if kind == "ValueError" else f"the engine process failed to load: {kind}: {text}")
        return cls(process, commands, results, message[1], max_waiting)

    # ----------------------------------------------------------------------------- the reader thread
    def _read(self) -> None:
        while True:
            try:
                ready = wait([self.results, self.process.sentinel])
                if self.results not in ready:
                    break  # the child ended and left nothing unread
                message = self.results.recv()
            except (EOFError, OSError):
                break
            self._handle(message)
        self.process.join(timeout=STOP_TIMEOUT)
        self.exitcode = self.process.exitcode
        if not self._stopped:
            log.error("the engine process died (exit code %s); answering 503 until the server restarts",
                      self.exitcode)
        self._stopped = True
        self._fail_all(RuntimeError("the engine was closed" if self._closing else
                                    f"the engine process died (exit code {self.exitcode})"))

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "error":
            _, text, rids = message
            self._fail(rids, RuntimeError(text))
            return
        _, outputs, refused, snap = message
        self.engine.update(snap, self._sent)
        for rid, text in refused:
            self._fail([rid], ValueError(text))
        self._deliver(outputs)
        if self.on_step is not None:
            try:
                self.on_step(outputs)
            except Exception:  # an observer must not stop the reader
                log.exception("on_step failed")

    def _deliver(self, outputs: list[StepOutput]) -> None:
        deliver(self._streams, self._lock, outputs)

    def _fail(self, rids: list[int], exc: Exception) -> None:
        with self._lock:
            streams = [(rid, self._streams.pop(rid)) for rid in rids if rid in self._streams]
        for _, (loop, queue) in streams:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(queue.put_nowait, exc)

    def _fail_all(self, exc: Exception) -> None:
        with self._lock:
            rids = list(self._streams)
        self._fail(rids, exc)

    # ----------------------------------------------------------------------------- the event loop's side
    @property
    def running(self) -> bool:
        """Whether the engine process serves."""
        return not self._stopped  # the reader thread sets it the moment the child's sentinel fires

    def submit(self, prompt: Sequence[int], params: SamplingParams | None = None, *,
               add_special_tokens: bool | None = None, queue: asyncio.Queue | None = None) -> tuple[int, asyncio.Queue]:
        """As `AsyncEngine.submit`; prompts as token ids (text is encoded here first)."""
        if not self.running:
            raise RuntimeError("the engine process has stopped" if self.exitcode is None else
                               f"the engine process died (exit code {self.exitcode})")
        if self.max_waiting is not None and self.engine.num_waiting() >= self.max_waiting:
            raise QueueFull(f"{self.engine.num_waiting()} requests are already waiting (limit {self.max_waiting}); "
                            "try again later")
        params = params or SamplingParams()
        ids = self.engine.encode(prompt, add_special_tokens)
        self.engine.check_request(ids, params)
        queue = queue if queue is not None else asyncio.Queue()
        loop = asyncio.get_running_loop()
        with self._lock:
            rid = self._next_id
            self._next_id += 1
            self._streams[rid] = (loop, queue)
            self._sent += 1
            self.engine._sent = self._sent
        self.commands.put(("add", rid, ids, params))
        return rid, queue

    def abort(self, rid: int) -> None:
        with self._lock:
            followed = self._streams.pop(rid, None) is not None
        if followed and not self._stopped:
            self.commands.put(("abort", rid))

    def close(self) -> None:
        """Stop the engine process (requests still in flight fail with RuntimeError) and wait for
        it to end; terminated after STOP_TIMEOUT seconds."""
        self._closing = True
        self._stopped = True
        _end(self.process, self.commands, STOP_TIMEOUT)
        self._reader.join(timeout=STOP_TIMEOUT)
        self._fail_all(RuntimeError("the engine was closed"))
        self.results.close()


def _end(process, commands, timeout: float) -> None:
    """Ask the child to stop, then terminate and kill it if it does not."""
    if process.is_alive():
        with contextlib.suppress(Exception):
            commands.put(("stop",))
        process.join(timeout)
    if process.is_alive():
        process.terminate()
        process.join(2.0)
    if process.is_alive():
        process.kill()
        process.join()
    commands.cancel_join_thread()  # what is still buffered for a dead child is dropped, not waited for
    commands.close()
