"""`batchspec serve`: the engine behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

from typing import Annotated

import typer

from ..config import EngineConfig
from ..server.config import ServerConfig
from .common import console, fail, load_engine
from .options import Device, Draft, Dtype, Target, dataclass_options, derive

SERVER_PANEL = "Server"
ENGINE = dataclass_options(EngineConfig, exclude=("sort_by_length", "profile"),
                           overrides={"batch_size": {"help": "Rows verified together in one target pass, the "
                                                             "most requests decoding at once (alias: "
                                                             "--max-batch-size)"}})
SERVER = dataclass_options(ServerConfig, panel=SERVER_PANEL)


@derive(SERVER, into="server")
@derive(ENGINE, into="engine")
def serve(
    *,
    target: Target = None, draft: Draft = None, dtype: Dtype = "auto", device: Device = "auto",
    engine: dict | None = None,
    server: dict | None = None,
    served_model_name: Annotated[str | None, typer.Option(
        "--served-model-name", metavar="NAME", rich_help_panel=SERVER_PANEL,
        help="Model id clients name (default: --target, or batchspec/default_pair)")] = None,
    max_batch_size: Annotated[int | None, typer.Option("--max-batch-size", hidden=True)] = None,
):
    """Serve the engine over an OpenAI-compatible HTTP API (completions, chat, streaming, metrics)."""
    from ..server import serve as run_server

    try:
        if max_batch_size is not None:  # --batch-size's alias, kept out of --help (its column would not fit)
            engine["batch_size"] = max_batch_size
        config = EngineConfig(**engine)
        for name, flag in (("max_waiting", "--max-waiting"), ("few_rows", "--single-thread-rows")):
            if server[name] is not None and server[name] < 0:
                raise ValueError(f"{flag} must be >= 0, got {server[name]}")
        settings = ServerConfig(**server, model_name=served_model_name or target or "batchspec/default_pair")
        if settings.engine_process:
            engine_ = start_engine_process(target, draft, config, dtype, device, settings)
        else:
            engine_ = load_engine(target, draft, config, dtype, device)
    except ValueError as exc:
        fail(str(exc))
    console.print(f"serving [bold]{settings.model_name}[/] ({config.method}, batch {config.batch_size}"
                  f"{f', gamma {config.gamma}' if config.speculative else ''}) on "
                  f"http://{settings.host}:{settings.port}/v1{' with an API key' if settings.api_key else ''}")
    try:
        run_server(engine_, settings)
    except RuntimeError as exc:
        fail(str(exc))


def start_engine_process(target, draft, config, dtype, device, settings):
    """The engine in its own process (`ProcessEngine`), under the same spinner as `load_engine`;
    ValueError for what the engine refuses, a clean error line if the process fails."""
    from ..server.engine_process import ProcessEngine

    with console.status("starting the engine process: loading the models (a machine's first run also times its "
                        "kernels and step costs)"):
        try:
            return ProcessEngine.start(target, draft, config, dtype=dtype, device=device,
                                       max_waiting=settings.max_waiting, few_rows=settings.few_rows)
        except RuntimeError as exc:
            fail(str(exc))
