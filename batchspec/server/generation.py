"""The engine requests behind one HTTP request: one per choice, all reporting on one asyncio queue."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from ..async_engine import AsyncEngine
from ..core.request import Output, StepOutput
from ..sampling import SamplingParams
from .metrics import ServerMetrics


class EngineFailed(RuntimeError):
    """A round failed inside the engine while this request was in flight."""


class Generation:
    """Submits every choice at once (or none: a QueueFull or ValueError on one aborts those already
    queued) and hands out their StepOutputs as (choice, output) while timing them for the metrics.

    Anything that ends the iteration early, or `abort()`, aborts the choices still open; their KV
    is freed at the engine's next round boundary."""

    def __init__(self, engine: AsyncEngine, prompts: list[list[int]], params: list[SamplingParams],
                 metrics: ServerMetrics, arrival: float, usage_prompt_tokens: int | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.arrival = arrival
        self.queue: asyncio.Queue = asyncio.Queue()
        self.choice_of: dict[int, int] = {}  # engine request id -> choice index
        self.open: set[int] = set()
        self.prompt_tokens = sum(len(ids) for ids in prompts)  # what the engine prefills: every choice's prompt
        self.usage_prompt_tokens = self.prompt_tokens if usage_prompt_tokens is None else usage_prompt_tokens
        self.completion_tokens = 0
        try:
            for choice, (ids, sp) in enumerate(zip(prompts, params)):
                rid, _ = engine.submit(ids, sp, queue=self.queue)
                self.choice_of[rid] = choice
                self.open.add(rid)
        except BaseException:
            self.abort()
            raise
        self.outputs_by_choice: list[Output | None] = [None] * len(prompts)
        metrics.prompt_tokens.inc(self.prompt_tokens)

    async def outputs(self) -> AsyncIterator[tuple[int, StepOutput]]:
        last: dict[int, float] = {}
        try:
            while self.open:
                out = await self.queue.get()
                if isinstance(out, Exception):
                    raise EngineFailed(f"the engine failed while generating: {out}") from out
                if out.index not in self.open:
                    continue
                choice = self.choice_of[out.index]
                if out.new_token_ids:
                    now = time.perf_counter()
                    first = out.index not in last
                    self.metrics.token_times(first, now - last.get(out.index, self.arrival), len(out.new_token_ids))
                    last[out.index] = now
                    self.completion_tokens += len(out.new_token_ids)
                if out.finished:
                    self.open.discard(out.index)
                    self.outputs_by_choice[choice] = out.output
                    self.metrics.latency.observe(time.perf_counter() - self.arrival)
                yield choice, out
        finally:
            self.abort()

    def abort(self) -> None:
        for rid in self.open:
            self.engine.abort(rid)
        self.open.clear()
