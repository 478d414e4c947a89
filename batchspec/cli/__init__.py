"""The `batchspec` command line: one module per command (generate, verify, bench, serve, loadtest).

The options that configure the engine are derived once from `EngineConfig`'s fields
(`options.py`), so every command takes them under the same names, help and defaults."""

from __future__ import annotations

import typer

from .bench import bench, echo_workload
from .generate import generate
from .loadtest import loadtest
from .serve import serve
from .verify import verify

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Exact batch speculative decoding for Hugging Face causal LMs.")
for command in (generate, verify, bench, serve, loadtest):
    app.command()(command)

__all__ = ["app", "echo_workload"]
