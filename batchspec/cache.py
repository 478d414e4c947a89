"""Measurements kept on disk, so a machine measures a thing once, not once per process: the
scheduling policy's cost tables (`sched/profile.py`, which keeps them in memory too) and which
matrix-product kernel a few tokens take on this CPU (`core/kernels.py`).

A profile's cost depends on the architecture, not on the weights: the key is each model's config
(name and path left out), dtype, device (the GPU's name on CUDA), thread count, CPU, torch version
and the profile's grid. Files go under `$BATCHSPEC_CACHE` (default `$XDG_CACHE_HOME/batchspec` or
`~/.cache/batchspec`; the test suite points it at a folder of its own); `BATCHSPEC_CACHE=off` turns
the disk cache off. A profile is written whole or not at all (a temporary file renamed), and a
folder that cannot be written is not an error: the engine profiles again next time. A profile read
back is checked against one pass timed now and measured again if it was taken at a busy moment
(`sched/profile.py`). Work that two processes must not do at once on one folder (fetching or
converting a model into it) runs under `locked`.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

CACHE_ENV = "BATCHSPEC_CACHE"


def cache_dir() -> Path | None:
    root = os.environ.get(CACHE_ENV)
    if root == "off":
        return None
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "batchspec"


def _model(model) -> dict | None:
    if model is None:
        return None
    config = {k: v for k, v in model.config.to_dict().items() if not k.startswith("_") and k != "name_or_path"}
    device = model.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    return {"config": config, "dtype": str(model.dtype), "device": f"{device.type}:{name}"}


def keyed_path(kind: str, key: dict) -> Path | None:
    """Where a measurement of `kind` ("profiles", "kernels") under `key` is kept (None: no disk
    cache); the key is completed with the thread count, torch version and core count."""
    root = cache_dir()
    if root is None:
        return None
    key = {**key, "threads": torch.get_num_threads(), "torch": torch.__version__, "cpus": os.cpu_count()}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]
    return root / kind / f"{digest}.json"


def cpu_name() -> str:
    return platform.processor() or platform.machine()


def profile_path(target, draft, grid: dict) -> Path | None:
    """Where the profile of `target` and `draft` (None: a model-free drafter) on `grid` is kept."""
    return keyed_path("profiles", {"target": _model(target), "draft": _model(draft), "grid": grid})


def read(path: Path | None):
    """The JSON at `path`, or None when there is none or it cannot be read."""
    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write(path: Path | None, data) -> None:
    """Write `data` as JSON, whole or not at all; a folder that cannot be written is no error."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_suffix(f".{os.getpid()}.part")
        part.write_text(json.dumps(data))
        os.replace(part, path)
    except OSError:
        pass


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the file `path` (created) while the block runs: another process
    (or thread) entering the same lock waits, then finds the work done. Two first runs at once (a
    test suite on two processes, Ray workers on one machine) fetch and convert a model once,
    where each would otherwise replace the folder the other is reading. Without advisory locks
    (Windows) the block runs unguarded."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
