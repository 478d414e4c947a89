"""A generation job on Ray: connect, shard prompts over actors, collect every answer once, in order.

    connect("local", num_cpus=2)
    ds = predict(prompt_dataset(prompts), workers=2, cpus_per_worker=1, max_new_tokens=64)
    for row in served_in_order(ds, len(prompts)):   # ids 0, 1, 2, ... each exactly once
        ...

Faults (what `predict` sets, per dataset, not globally):
    max_restarts        an actor whose process dies is restarted (its models reloaded) up to this often;
    max_task_retries    a call lost with its actor is resubmitted up to this often, so the rows of a
                        block a dead worker had not finished are served by the restarted actor;
    max_consecutive_actor_init_deaths  max_restarts: an actor lost while loading its models is
                        replaced (Ray does not restart an actor whose constructor never finished);
    max_errored_blocks  0: a block whose call raises fails the job instead of being dropped;
    actor_task_retry_on_errors  False: an exception from the engine (e.g. a prompt too long for the
                        model) is not retried, since it would only raise again.
`served_in_order` then checks that ids 0..n-1 each came back exactly once and otherwise raises
`JobIncomplete` naming the ids that could not be served.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import warnings
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import ray

from .predictor import BatchSpecPredictor, split_fields

MAX_RESTARTS = 3  # per actor
MAX_TASK_RETRIES = 3  # per call, after its actor died


def connect(address: str = "local", *, num_cpus: int | None = None, num_gpus: int | None = None) -> bool:
    """Join a Ray cluster at `address` ("auto", "ray://host:10001", "host:6379"), or start a local
    instance for "local". Reuses a connection this process already has. Returns whether it connected
    (and so should `ray.shutdown()` when done)."""
    if ray.is_initialized():
        return False
    if address == "local":
        ray.init(num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, logging_level=logging.WARNING)
    else:
        ray.init(address=address, logging_level=logging.WARNING)
    return True


def local_cpus(workers: int, cpus_per_worker: int | None) -> tuple[int, int]:
    """(CPUs per worker, CPUs for a local instance): by default the machine's cores split evenly."""
    cores = os.cpu_count() or 1
    per_worker = cpus_per_worker or max(1, cores // workers)
    return per_worker, max(cores, workers * per_worker)


def rows_per_call(num_prompts: int, workers: int, batch_size: int) -> int:
    """Prompts per actor call: a few engine batches (rows freed mid-call are refilled), but no more
    than an even share, so every worker gets work; a lost call then costs at most this many rows."""
    return max(1, min(4 * batch_size, math.ceil(num_prompts / workers)))


def prompt_dataset(prompts: Sequence[str]) -> ray.data.Dataset:
    """Rows {"id": i, "prompt": text}: the id is added before Ray shards anything."""
    return ray.data.from_items([{"id": i, "prompt": p} for i, p in enumerate(prompts)])


def predict(ds: ray.data.Dataset, *, workers: int = 1, cpus_per_worker: float = 1, gpus_per_worker: float = 0,
            rows: int | None = None, max_restarts: int = MAX_RESTARTS, max_task_retries: int = MAX_TASK_RETRIES,
            predictor: type = BatchSpecPredictor, **predictor_kwargs) -> ray.data.Dataset:
    """`ds` with BatchSpecPredictor's columns added by `workers` actors, each holding one engine
    with `cpus_per_worker` CPUs (and as many torch threads) and `gpus_per_worker` GPUs.
    `predictor_kwargs` go to `predictor` (BatchSpecPredictor or a subclass); its engine and sampling
    fields are checked here, before any actor starts."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if cpus_per_worker <= 0 or gpus_per_worker < 0:
        raise ValueError("cpus_per_worker must be > 0 and gpus_per_worker >= 0")
    named = {p.name for cls in {BatchSpecPredictor, predictor} for p in inspect.signature(cls).parameters.values()
             if p.kind is not p.VAR_KEYWORD}
    config, _ = split_fields({k: v for k, v in predictor_kwargs.items() if k not in named})
    predictor_kwargs.setdefault("threads", max(1, int(cpus_per_worker)))
    ctx = ds.context  # this dataset's own copy of the DataContext
    ctx.max_errored_blocks = 0
    ctx.actor_task_retry_on_errors = False
    ctx.max_consecutive_actor_init_deaths = max_restarts
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
        return ds.map_batches(predictor, fn_constructor_kwargs=predictor_kwargs, batch_format="numpy",
                              batch_size=rows or 4 * config.batch_size, compute=pool(workers),
                              num_cpus=cpus_per_worker, num_gpus=gpus_per_worker or None,
                              **_restarts(ds, max_restarts, max_task_retries))


def pool(workers: int) -> ray.data.ActorPoolStrategy:
    """A fixed pool of `workers` actors, each sent one call at a time: a call is queued on no actor
    but goes to whichever is free first, so a slow or restarting worker holds back no one else's
    rows (prefetching the next prompts would save nothing: they are a few bytes of text)."""
    return ray.data.ActorPoolStrategy(size=workers, max_tasks_in_flight_per_actor=1)


def _restarts(ds: ray.data.Dataset, max_restarts: int, max_task_retries: int) -> dict:
    """The actor options map_batches passes on to Ray (as `**ray_remote_args`, which Ray 2.60 marks
    deprecated with no named replacement yet). Where a later Ray takes no such keywords, Ray Data's
    own defaults apply: restarts and retries without limit."""
    params = inspect.signature(ds.map_batches).parameters.values()
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        return {}
    return {"max_restarts": max_restarts, "max_task_retries": max_task_retries}


class JobIncomplete(RuntimeError):
    """Some prompts were not answered exactly once."""

    def __init__(self, missing: list[int], duplicates: list[int], cause: BaseException | None = None) -> None:
        self.missing, self.duplicates = missing, duplicates
        parts = []
        if missing:
            parts.append(f"{len(missing)} prompts could not be served: ids {_ids(missing)}")
        if duplicates:
            parts.append(f"{len(duplicates)} prompts were answered more than once: ids {_ids(duplicates)}")
        if cause is not None:
            parts.append(f"cause: {type(cause).__name__}: {cause}")
        super().__init__("; ".join(parts))


class InOrder:
    """Rows with ids 0..n-1, arriving in any order, released in id order; remembers what never came
    and what came twice.

    >>> order = InOrder(3)
    >>> order.add({"id": 2}), order.add({"id": 0}), order.add({"id": 1})
    ([], [{'id': 0}], [{'id': 1}, {'id': 2}])
    """

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self.next = 0  # ids below it have been released
        self.waiting: dict[int, dict] = {}  # arrived ahead of an earlier id
        self.duplicates: list[int] = []

    def add(self, row: dict) -> list[dict]:
        rid = int(row["id"])
        if not 0 <= rid < self.num_rows:
            raise ValueError(f"row id {rid} is outside 0..{self.num_rows - 1}")
        if rid < self.next or rid in self.waiting:
            self.duplicates.append(rid)
            return []
        self.waiting[rid] = row
        released = []
        while self.next in self.waiting:
            released.append(self.waiting.pop(self.next))
            self.next += 1
        return released

    def missing(self) -> list[int]:
        return [i for i in range(self.next, self.num_rows) if i not in self.waiting]

    def check(self, cause: BaseException | None = None) -> None:
        missing = self.missing()
        if missing or self.duplicates or cause is not None:
            raise JobIncomplete(missing, sorted(set(self.duplicates)), cause)


def served_in_order(ds: ray.data.Dataset, num_rows: int,
                    on_arrival: Callable[[list[dict]], None] | None = None) -> Iterator[dict]:
    """Run `ds` and yield its rows in id order, as plain Python values. `on_arrival(rows)` sees each
    block as it comes back (for progress). Raises JobIncomplete unless ids 0..num_rows-1 each came
    back exactly once."""
    order = InOrder(num_rows)
    try:
        for batch in ds.iter_batches(batch_format="numpy", batch_size=None):
            rows = batch_rows(batch)
            if on_arrival is not None:
                on_arrival(rows)
            for row in rows:
                yield from order.add(row)
    except Exception as exc:  # a worker's error, or Ray giving up on restarts: name what is missing
        order.check(cause=exc)
    order.check()


def batch_rows(batch: dict[str, np.ndarray]) -> list[dict]:
    """{column: array} -> [{column: plain Python value}] (lists for arrays, ints / floats / str)."""
    columns = {k: v.tolist() if v.dtype != object else [_plain(x) for x in v] for k, v in batch.items()}
    size = len(next(iter(columns.values()), []))
    return [{k: v[i] for k, v in columns.items()} for i in range(size)]


def _plain(value):
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value.item() if isinstance(value, np.generic) else value


def _ids(ids: list[int], show: int = 20) -> str:
    text = ", ".join(map(str, ids[:show]))
    return text + (f", ... ({len(ids) - show} more)" if len(ids) > show else "")
