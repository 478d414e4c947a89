"""`batchspec serve`: the engine behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

from typing import Annotated

import typer

from ..config import EngineConfig
from .common import console, fail, load_engine
from .options import Device, Draft, Dtype, Target, dataclass_options, derive

SERVER_PANEL = "Server"
ENGINE = dataclass_options(EngineConfig, exclude=("sort_by_length", "profile"),
                           overrides={"batch_size": {"help": "Rows verified together in one target pass, the "
                                                             "most requests decoding at once (alias: "
                                                             "--max-batch-size)"}})


@derive(ENGINE, into="engine")
def serve(
    *,
    target: Target = None, draft: Draft = None, dtype: Dtype = "auto", device: Device = "auto",
    engine: dict | None = None,
    host: Annotated[str, typer.Option("--host", metavar="ADDRESS", rich_help_panel=SERVER_PANEL,
                                      help="Address to bind (loopback unless told otherwise)")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", metavar="N", rich_help_panel=SERVER_PANEL)] = 8000,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar="BATCHSPEC_API_KEY", metavar="KEY", rich_help_panel=SERVER_PANEL,
        help="Require 'Authorization: Bearer KEY' on every endpoint but /health")] = None,
    served_model_name: Annotated[str | None, typer.Option(
        "--served-model-name", metavar="NAME", rich_help_panel=SERVER_PANEL,
        help="Model id clients name (default: --target, or batchspec/default_pair)")] = None,
    max_waiting: Annotated[int, typer.Option(
        "--max-waiting", metavar="N", rich_help_panel=SERVER_PANEL,
        help="Requests allowed to wait for a row; more get 429")] = 256,
    log_level: Annotated[str, typer.Option("--log-level", metavar="NAME", rich_help_panel=SERVER_PANEL,
                                           help="uvicorn log level (info logs every request)")] = "warning",
    max_batch_size: Annotated[int | None, typer.Option("--max-batch-size", hidden=True)] = None,
    few_rows: Annotated[int, typer.Option(
        "--single-thread-rows", metavar="N", rich_help_panel="Expert",
        help="On a CPU, run rounds on one torch thread while at most N requests are in the engine, leaving "
             "the other cores to the HTTP side (0 = never)")] = 0,
):
    """Serve the engine over an OpenAI-compatible HTTP API (completions, chat, streaming, metrics)."""
    from ..server import serve as run_server

    try:
        if max_batch_size is not None:  # --batch-size's alias, kept out of --help (its column would not fit)
            engine["batch_size"] = max_batch_size
        config = EngineConfig(**engine)
        if max_waiting < 0:
            raise ValueError(f"--max-waiting must be >= 0, got {max_waiting}")
        if few_rows < 0:
            raise ValueError(f"--single-thread-rows must be >= 0, got {few_rows}")
        engine_ = load_engine(target, draft, config, dtype, device)
    except ValueError as exc:
        fail(str(exc))
    name = served_model_name or target or "batchspec/default_pair"
    console.print(f"serving [bold]{name}[/] ({config.method}, batch {config.batch_size}"
                  f"{f', gamma {config.gamma}' if config.speculative else ''}) on http://{host}:{port}/v1"
                  f"{' with an API key' if api_key else ''}")
    try:
        run_server(engine_, host=host, port=port, model_name=name, api_key=api_key, max_waiting=max_waiting,
                   log_level=log_level, few_rows=few_rows)
    except RuntimeError as exc:
        fail(str(exc))
