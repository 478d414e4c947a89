"""GGUF files as a model source: `--target model.gguf` (or a folder holding only a GGUF).

transformers reads GGUF (`from_pretrained(folder, gguf_file=name)`, the tokenizer likewise, from
the file's metadata) and dequantizes every tensor to the requested dtype. The model it returns
carries a `quantization_config` that makes `save_pretrained` refuse, so the conversion loads its
state dict into a plain model built from the same config without it, and saves that with the
tokenizer as an ordinary safetensors checkpoint, which every later load reads like any local
folder (a 135M-parameter model: ~40 s to convert on a busy 2-core CPU, ~2 s to load).

Cache layout (`models_root()`: `$BATCHSPEC_MODELS`, else `<cache_dir()>/models`, see cache.py):
    models/gguf/<file stem>-<digest>/   config.json, model.safetensors, tokenizer files,
                                        generation_config.json, batchspec-source.json
The digest is of the file's identity (resolved path, size, modification time) and the dtype, so a
file edited or replaced is converted again. With `BATCHSPEC_CACHE=off` (and no
`$BATCHSPEC_MODELS`) the checkpoint goes to a temporary folder removed at exit.

Loading a GGUF needs the `gguf` and `accelerate` packages: `pip install 'batchspec[gguf]'`.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import importlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from .cache import cache_dir, locked

MODELS_ENV = "BATCHSPEC_MODELS"
INSTALL = "pip install 'batchspec[gguf]'"
CONFIG = "config.json"
SOURCE = "batchspec-source.json"  # what a converted checkpoint was made from


def log_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def models_root() -> Path | None:
    """Where converted and fetched models are kept (None: nowhere, with the disk cache off)."""
    root = os.environ.get(MODELS_ENV)
    if root:
        return Path(root).expanduser()
    base = cache_dir()
    return base / "models" if base is not None else None


def require_gguf() -> None:
    """Raise ValueError naming the extra to install when GGUF support is missing."""
    for package in ("gguf", "accelerate"):
        try:
            importlib.import_module(package)
        except ImportError:
            raise ValueError(f"loading a GGUF file needs the {package!r} package: {INSTALL}") from None


def gguf_in_folder(folder: Path) -> Path | None:
    """The GGUF file a folder holds instead of a checkpoint (no config.json), or None."""
    if not folder.is_dir() or (folder / CONFIG).exists():
        return None
    files = sorted(folder.glob("*.gguf"))
    if len(files) > 1:
        raise ValueError(f"{folder} holds {len(files)} GGUF files ({', '.join(f.name for f in files[:3])}); "
                         "name the one to load")
    return files[0] if files else None


def convert(path: str | Path, out: str | Path, dtype: torch.dtype = torch.float32, note: dict | None = None) -> Path:
    """Dequantize the GGUF at `path` to `dtype` and save it to folder `out` as a plain safetensors
    checkpoint with its tokenizer; written whole or not at all (a temporary folder renamed)."""
    require_gguf()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, out = Path(path), Path(out)
    folder, name = str(path.parent), path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    except (OSError, ValueError, KeyError, NotImplementedError) as exc:
        raise ValueError(f"cannot read GGUF file {path}: {first_line(exc)}") from None
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    plain_config = type(loaded.config).from_dict(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(plain_config, dtype=dtype)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    del loaded
    out.parent.mkdir(parents=True, exist_ok=True)
    part = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    os.chmod(part, 0o755)
    try:
        model.save_pretrained(part)
        tokenizer.save_pretrained(part)
        (part / SOURCE).write_text(json.dumps({"gguf": str(path), "dtype": str(dtype).removeprefix("torch."),
                                               **(note or {})}, indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.replace(part, out)
    finally:
        shutil.rmtree(part, ignore_errors=True)
    return out


def checkpoint_for(path: str | Path, dtype: torch.dtype = torch.float32,
                   log: Callable[[str], None] = log_stderr) -> Path:
    """The converted checkpoint of the GGUF at `path` in `dtype` (float64: float32, which holds every
    dequantized value exactly), converting it on first use."""
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"GGUF file {path} does not exist")
    dtype = torch.float32 if dtype == torch.float64 else dtype
    stat = path.stat()
    key = json.dumps({"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "dtype": str(dtype)})
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    root = models_root()
    if root is None:
        out = Path(tempfile.mkdtemp(prefix="batchspec-gguf-")) / "model"
        atexit.register(shutil.rmtree, out.parent, ignore_errors=True)
        where = "not cached: BATCHSPEC_CACHE=off"
    else:
        out = root / "gguf" / f"{path.stem}-{digest}"
        if (out / CONFIG).is_file():
            return out
        where = f"cached in {out}"
    require_gguf()
    with locked(out.parent / f".{out.name}.lock") if root is not None else contextlib.nullcontext():
        if (out / CONFIG).is_file():  # (another process converted it while this one waited)
            return out
        log(f"converting {path.name} to a {str(dtype).removeprefix('torch.')} checkpoint, once ({where})")
        return convert(path, out, dtype)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
