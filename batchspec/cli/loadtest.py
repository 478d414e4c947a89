"""`batchspec loadtest`: drive an OpenAI-compatible server with the official openai client."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from .common import check_output_folder, fail
from .options import JsonPath, Prompts

REQUEST_PANEL = "Requests"


def loadtest(
    *,
    url: Annotated[str, typer.Option("--url", metavar="URL",
                                     help="Server base URL (with or without /v1)")] = "http://127.0.0.1:8000",
    concurrency: Annotated[int, typer.Option("--concurrency", metavar="N", help="Requests in flight at once")] = 8,
    requests: Annotated[int, typer.Option("--requests", metavar="N", help="Timed requests in all")] = 64,
    warmup: Annotated[int | None, typer.Option(
        "--warmup", metavar="N", help="Untimed requests first (default: one per concurrent client)")] = None,
    timeout: Annotated[float, typer.Option("--timeout", metavar="S", help="Seconds one request may take")] = 600.0,
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="BATCHSPEC_API_KEY", metavar="KEY",
                                                   help="Bearer key the server requires")] = None,
    json_path: JsonPath = None,
    prompts: Prompts = None,
    model: Annotated[str | None, typer.Option(
        "--model", metavar="NAME", rich_help_panel=REQUEST_PANEL,
        help="Model id to request (default: the first of GET /v1/models)")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", metavar="N", rich_help_panel=REQUEST_PANEL,
                                            help="max_tokens of every request")] = 64,
    stream: Annotated[bool, typer.Option("--stream", metavar="", rich_help_panel=REQUEST_PANEL,
                                         help="Stream (needed for TTFT and inter-token latency)")] = False,
    chat: Annotated[bool, typer.Option("--chat", metavar="", rich_help_panel=REQUEST_PANEL,
                                       help="Send each prompt as one user message to /v1/chat/completions")] = False,
    temperature: Annotated[float, typer.Option("--temperature", metavar="T", rich_help_panel=REQUEST_PANEL,
                                               help="0 = greedy")] = 0.0,
):
    """Load-test an OpenAI-compatible server with the official openai client."""
    import asyncio

    from ..prompts import load_prompts
    from ..server.loadtest import format_report, run_loadtest

    try:
        texts = load_prompts(prompts)
        check_output_folder(json_path)
        report = asyncio.run(run_loadtest(url, texts, concurrency=concurrency, requests=requests,
                                          max_tokens=max_tokens, stream=stream, chat=chat, temperature=temperature,
                                          model=model, api_key=api_key, warmup=warmup, timeout=timeout))
    except ValueError as exc:
        fail(str(exc))
    table = Table(title=f"{report['model']} at {url}: concurrency {concurrency}, {requests} requests, "
                        f"max_tokens {max_tokens}{', streaming' if stream else ''}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for label, value in format_report(report):
        table.add_row(label, value)
    Console().print(table)
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=2))
    if report["failed"]:
        raise typer.Exit(1)
