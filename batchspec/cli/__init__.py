"""The `batchspec` command line: one module per command (generate, verify, bench, serve, loadtest, models).

The options that configure the engine are derived once from `EngineConfig`'s fields
(`options.py`), so every command takes them under the same names, help and defaults."""

from __future__ import annotations

import typer

from . import bench, generate, loadtest, models, serve, trace, train_draft, verify
from .bench import echo_workload

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Exact batch speculative decoding for Hugging Face causal LMs.")
for module in (generate, verify, bench, serve, loadtest, train_draft):  # the modules stay reachable by their names
    app.command()(getattr(module, module.__name__.rsplit(".", 1)[1]))
app.add_typer(models.app, name="models")
app.add_typer(trace.app, name="trace")

__all__ = ["app", "echo_workload"]
