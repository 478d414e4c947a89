"""The engine process's side of `ProcessEngine` (engine_process.py): load the engine, then run its
rounds, taking requests and aborts from a queue and sending each round's outputs back in one message.

Messages, parent to child (a multiprocessing queue, so that the HTTP side never waits on a send):

    ("add", rid, token_ids, SamplingParams)   rid: the parent's request id
    ("abort", rid)
    ("stop",)                                 end the loop (requests in flight end with it)

child to parent (one pipe, read by the parent's reader thread):

    ("ready", info)                           once loaded and warmed up (`describe`)
    ("failed", kind, message)                 loading failed (kind: "ValueError" or another class name)
    ("step", outputs, refused, snapshot)      after every round: StepOutputs with the parent's ids,
                                              [(rid, message)] of adds the engine refused, `snapshot`
    ("error", message, rids)                  a round failed: those requests were dropped

The child ignores SIGINT and SIGTERM: Ctrl-C at a terminal reaches the whole process group, and
the parent drains its HTTP requests before it stops the child. It ends on "stop", when the parent
process is gone, or when the parent terminates it.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import queue as queue_mod
import signal
from dataclasses import replace
from typing import Any

log = logging.getLogger(__name__)
STATS = ("rounds", "row_rounds", "drafted", "accepted")


def warm_up(engine) -> None:
    """One short generation before serving, so that the first client does not pay for first-call setup."""
    from ..sampling import SamplingParams

    prompt = "def main():\n" if engine.pair.tokenizer is not None else [0]
    engine.generate([prompt], SamplingParams(max_new_tokens=engine.gamma + 2))


def describe(engine) -> dict[str, Any]:
    """What the HTTP side needs of the engine to check and prepare requests (fixed at start-up)."""
    return dict(tokenizer=engine.pair.tokenizer, vocab_size=engine.pair.vocab_size, context=engine.context,
                gamma=engine.gamma, rows=engine.rows, row_capacity=engine.row_capacity, kv_tokens=engine.kv_tokens,
                config=engine.config, device=str(engine.device),
                synthetic=bool(getattr(engine.drafter, "synthetic", False)), snapshot=snapshot(engine, 0))


def snapshot(engine, received: int) -> dict[str, Any]:
    """The engine's state after a round: its statistics, queue, rows and KV; `received` counts the
    adds taken off the queue so far (the parent counts those it sent and not yet seen as waiting)."""
    return dict(stats={name: getattr(engine.stats, name) for name in STATS}, waiting=engine.num_waiting(),
                running=engine.num_running(), kv_in_use=engine.kv_tokens_in_use(), received=received,
                unfinished=engine.has_unfinished())


def main(load: dict[str, Any], commands, out, few_rows: int = 0, few_threads: int = 1) -> None:
    """The engine process's entry point (spawned: everything it gets is pickled)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        from ..engine import SpecEngine

        engine = SpecEngine.from_pretrained(load["target"], load["draft"], load["config"], dtype=load["dtype"],
                                            device=load["device"])
        warm_up(engine)
        out.send(("ready", describe(engine)))
    except BaseException as exc:  # said to the parent, which raises it where the server is started
        out.send(("failed", type(exc).__name__, str(exc)))
        return
    with contextlib.suppress(BrokenPipeError, EOFError, OSError):  # the parent went away
        Loop(engine, commands, out, few_rows, few_threads).run()


class Loop:
    """The round loop: take what the queue holds (waiting for it only while idle), run one step,
    send its outputs with the parent's ids."""

    def __init__(self, engine, commands, out, few_rows: int, few_threads: int) -> None:
        import torch

        self.engine, self.commands, self.out = engine, commands, out
        self.ids: dict[int, int] = {}  # the parent's request id -> the engine's
        self.rids: dict[int, int] = {}  # the engine's -> the parent's
        self.received = 0
        self.refused: list[tuple[int, str]] = []
        self.stopped = False
        self.parent = multiprocessing.parent_process()
        self.torch = torch
        self.few_rows = few_rows if engine.device.type == "cpu" else 0
        self.few_threads, self.all_threads = few_threads, torch.get_num_threads()

    def run(self) -> None:
        engine = self.engine
        while not self.stopped:
            self.take(block=not engine.has_unfinished())
            if self.parent is not None and not self.parent.is_alive():
                return
            if self.stopped:
                return
            if not engine.has_unfinished():
                if self.refused:
                    self.send([])
                continue
            self.set_threads()
            try:
                outputs = engine.step()
            except Exception as exc:  # keep serving: fail what was in flight, drop it from the engine
                log.exception("a round failed; failing the requests in flight")
                for erid in self.rids:
                    engine.abort(erid)
                rids, self.ids, self.rids = list(self.ids), {}, {}
                self.out.send(("error", f"{type(exc).__name__}: {exc}", rids))
                continue
            self.send(outputs)

    def take(self, block: bool) -> None:
        """Apply every command waiting on the queue; while idle, wait up to 0.1 s for one."""
        try:
            command = self.commands.get(timeout=0.1) if block else self.commands.get_nowait()
            while True:
                self.apply(command)
                command = self.commands.get_nowait()
        except queue_mod.Empty:
            pass

    def apply(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, rid, token_ids, params = command
            self.received += 1
            try:
                erid = self.engine.add_request(token_ids, params)
            except ValueError as exc:  # checked on the HTTP side already: a stale limit at most
                self.refused.append((rid, str(exc)))
                return
            self.ids[rid], self.rids[erid] = erid, rid
        elif kind == "abort":
            erid = self.ids.get(command[1])
            if erid is not None:
                self.engine.abort(erid)
        elif kind == "stop":
            self.stopped = True

    def set_threads(self) -> None:
        """Few torch threads while few requests are in the engine (see AsyncEngine's docstring)."""
        if self.few_rows <= 0:
            return
        rows = self.engine.num_running() + self.engine.num_waiting()
        want = self.few_threads if rows <= self.few_rows else self.all_threads
        if self.torch.get_num_threads() != want:
            self.torch.set_num_threads(want)

    def send(self, outputs: list) -> None:
        mine = []
        for out in outputs:
            rid = self.rids.pop(out.index, None) if out.finished else self.rids.get(out.index)
            if rid is None:
                continue  # the warm-up's, or one the parent no longer follows
            if out.finished:
                self.ids.pop(rid, None)
            mine.append(replace(out, index=rid, output=replace(out.output, index=rid) if out.output else None))
        refused, self.refused = self.refused, []
        self.out.send(("step", mine, refused, snapshot(self.engine, self.received)))
