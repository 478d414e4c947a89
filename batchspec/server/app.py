"""`batchspec serve`: an OpenAI-compatible HTTP API over one engine loop.

    POST /v1/completions        prompt text or token ids (or a list of them), SSE with stream=true
    POST /v1/chat/completions   messages rendered with the tokenizer's chat template
    GET  /v1/models             the served model
    GET  /health                200 while the engine loop runs (never needs the API key)
    GET  /metrics               Prometheus text (see metrics.py)

The engine's rounds run in their own process (`ProcessEngine`, `batchspec serve --engine-process`), or on
one thread of this one (`AsyncEngine`); handlers only queue requests and await their per-round
outputs, so the HTTP side never blocks a round, and in the engine process the rounds never hold
the HTTP side's GIL. Nothing costly
runs on the event loop: a body is size-checked as it arrives (guard.py), and prompts are checked
for length, tokenized and rendered by chat templates on `tokenizer_threads` worker threads
(detokenization happens in the engine's rounds). Every engine
request is aborted when its client goes away, streaming or not: streaming responses are cancelled
by Starlette when the client disconnects, and non-streaming handlers race the generation against
the connection's `http.disconnect`.

Answers, all in OpenAI's error shape ({"error": {"message", "type", "param", "code"}}): 400 with
the reason for anything the client must change (malformed JSON, a body that is not UTF-8, a wrong
type, text with lone surrogates or that the tokenizer refuses, a prompt over `max_prompt_chars`,
a value the engine or SamplingParams refuses, an unsupported feature); 401 without the API key;
404 for another model; 413 for a body over `max_body_bytes`; 429 (with Retry-After) when
`max_waiting` requests already wait; 503 (with Retry-After) when the engine has stopped; 500 when a
round failed (the server keeps serving the others).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import secrets
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..async_engine import AsyncEngine, QueueFull
from ..engine import SpecEngine
from .chat import render
from .config import ServerConfig
from .engine_child import warm_up
from .engine_process import EngineView, ProcessEngine
from .generation import EngineFailed, Generation
from .guard import BodyGuard, check_text, text_chars
from .metrics import ServerMetrics
from .protocol import (
    MAX_CHOICES,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    ResponseFormat,
    error_body,
    usage,
)

log = logging.getLogger(__name__)
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions"}


class ApiError(Exception):
    """An answer other than 200: status, message, and the outcome the metrics count it under."""

    def __init__(self, status: int, message: str, outcome: str = "invalid", kind: str = "invalid_request_error",
                 code: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.outcome, self.kind, self.code = status, message, outcome, kind, code
        self.headers = {"Retry-After": str(retry_after)} if retry_after is not None else None

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.kind, self.code), status_code=self.status,
                            headers=self.headers)


class OpenAIServer:
    """The handlers' state: the engine, its asyncio side (started with the app), the metrics, the
    limits in force and the worker threads that prepare prompts."""

    def __init__(self, engine: SpecEngine | EngineView, config: ServerConfig) -> None:
        self.spec = engine  # with an engine process: its limits, tokenizer and last round's state
        self.config = config
        self.model_name = config.model_name
        self.metrics = ServerMetrics(engine)
        self.engine: AsyncEngine | ProcessEngine | None = None
        self.created = int(time.time())
        tok = engine.pair.tokenizer
        self.longest_token = max((len(t) for t in tok.get_vocab()), default=1) if tok is not None else 1
        self.max_prompt_chars = config.prompt_chars(engine.context, self.longest_token)
        self.max_body_bytes = config.body_bytes(self.max_prompt_chars)
        self.pool = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="batchspec-tokenize")

    # ----------------------------------------------------------------------------- routes
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        return await self._generate("completions", body, request, lambda: self._completion_prompts(body))

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        return await self._generate("chat_completions", body, request, lambda: [self._chat_prompt(body)],
                                    tools=body.wants_tools)

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "batchspec"}]}

    async def health(self) -> JSONResponse:
        ok = self.engine is not None and self.engine.running
        return JSONResponse({"status": "ok" if ok else "engine stopped"}, status_code=200 if ok else 503,
                            headers=None if ok else {"Retry-After": str(self.config.retry_after)})

    async def render_metrics(self) -> Response:
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    # ----------------------------------------------------------------------------- prompts (worker threads)
    def _check_size(self, chars: int, what: str) -> None:
        if chars > self.max_prompt_chars:
            raise ValueError(f"{what} has {chars} characters, more than this server accepts (max_prompt_chars="
                             f"{self.max_prompt_chars}: the model context of {self.spec.context} tokens times the "
                             f"longest token, {self.longest_token} characters, unless set); shorten it")

    def _encode(self, text: str, where: str) -> list[int]:
        check_text(text, where)
        try:
            return self.spec.encode(text)  # no second BOS when a chat template wrote one
        except ValueError:
            raise
        except Exception as exc:  # the tokenizer's own refusal (TypeError, ...): the client's text
            raise ValueError(f"the tokenizer could not encode {where}: {type(exc).__name__}: {exc}") from None

    def _completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        p = body.prompt
        self._check_size(text_chars(p), "the prompt text")
        items = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else p
        if not items:
            raise ValueError("prompt is empty")
        return [self._encode(item, "prompt" if len(items) == 1 else f"prompt[{i}]") if isinstance(item, str)
                else self.spec.encode(item) for i, item in enumerate(items)]

    def _chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        if not body.messages:
            raise ValueError("messages is empty")
        messages = [m.for_template(f"messages[{i}]") for i, m in enumerate(body.messages)]
        self._check_size(text_chars(messages) + text_chars(body.tools or []), "the messages' text (with tools)")
        return self._encode(render(self.spec.pair.tokenizer, messages, body.tools), "the rendered chat prompt")

    def _room(self, prompts: list[list[int]], body: GenerationRequest) -> int:
        """Default max_tokens of chat: the most the engine accepts after the longest prompt (its
        context and KV budget), found by bisection over `check_request`, which runs no model."""
        longest = max(prompts, key=len)
        vocab = self.spec.pair.vocab_size

        def fits(k: int) -> bool:
            try:
                self.spec.check_request(longest, body.sampling_params(k, 0, vocab))
            except ValueError:
                return False
            return True

        lo, hi = 1, max(1, self.spec.context)
        if not fits(lo):
            return lo  # the prompt itself is refused: check_request says why
        while lo < hi:  # invariant: fits(lo)
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    # ----------------------------------------------------------------------------- generation
    async def _start(self, endpoint: str, body: GenerationRequest, make_prompts) -> Generation:
        """Validate (on a worker thread) and submit every choice; ApiError for anything the client
        must change."""
        arrival = time.perf_counter()
        if body.model is not None and body.model != self.model_name:
            raise ApiError(404, f"model {body.model!r} is not served here; this server serves "
                                f"{self.model_name!r} (GET /v1/models)", code="model_not_found")
        unsupported = body.unsupported()
        if unsupported:
            raise ApiError(400, f"not supported by batchspec serve: {', '.join(unsupported)}; leave "
                                f"{'it' if len(unsupported) == 1 else 'them'} unset")
        loop = asyncio.get_running_loop()
        try:
            prompts, params, usage_prompt_tokens = await loop.run_in_executor(
                self.pool, self._prepare, endpoint, body, make_prompts)
            return Generation(self.engine, prompts, params, self.metrics, arrival, usage_prompt_tokens)
        except QueueFull as exc:
            raise ApiError(429, f"the server is busy: {exc}", "queue_full", "rate_limit_error",
                           retry_after=self.config.retry_after) from None
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        except RuntimeError as exc:  # the engine was closed (the server is stopping)
            if self.engine is not None and self.engine.running:
                raise
            raise ApiError(503, f"the engine is not running: {exc}", "unavailable", "server_error",
                           retry_after=self.config.retry_after) from None

    def _prepare(self, endpoint: str, body: GenerationRequest, make_prompts):
        """Prompts, sampling parameters and usage prompt tokens of a request; ValueError for
        anything the client must change. Runs on a worker thread: it tokenizes."""
        prompts = make_prompts()
        if body.choices < 1:
            raise ValueError(f"n must be >= 1, got {body.n}")
        usage_prompt_tokens = sum(len(ids) for ids in prompts)  # OpenAI counts a prompt once, whatever n
        prompts = [ids for ids in prompts for _ in range(body.choices)]  # choice i*n + j: prompt i, sample j
        if len(prompts) > MAX_CHOICES:
            raise ValueError(f"at most {MAX_CHOICES} choices (prompts x n) per request, got {len(prompts)}")
        max_new = body.max_new_tokens(16 if endpoint == "completions" else None)
        if max_new is None:
            max_new = self._room(prompts, body)
        vocab = self.spec.pair.vocab_size
        params = [body.sampling_params(max_new, i, vocab) for i in range(len(prompts))]
        for i, (ids, sp) in enumerate(zip(prompts, params)):
            self.spec.check_request(ids, sp, where="prompt" if len(prompts) == 1 else f"prompt of choice {i}")
        return prompts, params, usage_prompt_tokens

    async def _generate(self, endpoint: str, body: GenerationRequest, request: Request, make_prompts,
                        tools: bool = False) -> Response:
        try:
            gen = await self._start(endpoint, body, make_prompts)
        except ApiError as exc:
            self.metrics.request_done(endpoint, exc.outcome)
            return exc.response()
        fmt = ResponseFormat(endpoint == "chat_completions", self.model_name, tools)
        if not body.stream:
            return await self._whole(endpoint, gen, fmt, request)
        counted = False

        def finish(outcome: str) -> None:
            """Abort what is open and count the outcome, once: at the stream's end or, if the client
            left before the stream started, in the response's background task."""
            nonlocal counted
            gen.abort()
            if not counted:
                counted = True
                self.metrics.request_done(endpoint, outcome)

        return StreamingResponse(self._events(gen, fmt, body.include_usage, finish), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"}, background=BackgroundTask(finish, "cancelled"))

    async def _whole(self, endpoint: str, gen: Generation, fmt: ResponseFormat, request: Request) -> Response:
        async def collect() -> None:
            async for _ in gen.outputs():
                pass

        outcome = "cancelled"
        work = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():  # the client went away: abort (the finally below), answer nobody
                return Response(status_code=499)
            try:
                work.result()
            except Exception as exc:
                outcome = "error"
                if not isinstance(exc, EngineFailed):
                    log.exception("generation failed")
                return ApiError(500, str(exc), "error", "server_error").response()
            outs = gen.outputs_by_choice
            outcome = "ok"
            return JSONResponse(fmt.response([(o.text or "", o.finish_reason) for o in outs],
                                             usage(gen.usage_prompt_tokens, gen.completion_tokens)))
        finally:
            for task in (work, gone):
                task.cancel()
            gen.abort()
            self.metrics.request_done(endpoint, outcome)

    async def _events(self, gen: Generation, fmt: ResponseFormat, include_usage: bool, finish):
        """Server-sent events: each round's accepted text per choice as it arrives, then [DONE]."""
        outcome = "cancelled"  # unless it gets to the end: the client left (Starlette cancels or closes us)
        try:
            if fmt.chat:
                yield "".join(_sse(fmt.chunk(i, None, role=True)) for i in range(len(gen.outputs_by_choice)))
            try:
                async for choice, out in gen.outputs():
                    if fmt.tools:  # a tool call is known once it is whole: the answer comes at its end
                        if out.finished:
                            yield _sse(fmt.whole_chunk(choice, out.output.text or "", out.finish_reason))
                    elif out.new_text or out.finished:
                        yield _sse(fmt.chunk(choice, out.new_text, out.finish_reason))
            except Exception as exc:
                outcome = "error"
                if not isinstance(exc, EngineFailed):
                    log.exception("generation failed")
                yield _sse(error_body(str(exc), "server_error"))
                return
            if include_usage:
                yield _sse(fmt.usage_chunk(usage(gen.usage_prompt_tokens, gen.completion_tokens)))
            yield "data: [DONE]\n\n"
            outcome = "ok"
        finally:
            finish(outcome)


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body was read already, so the next
    ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class BearerAuth:
    """ASGI middleware: every path but /health needs `Authorization: Bearer <api key>`."""

    def __init__(self, app, api_key: str, metrics: ServerMetrics) -> None:
        self.app = app
        self.expected = api_key.encode()
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(given.strip(), self.expected):
                self.metrics.request_done(ENDPOINTS.get(scope["path"], "other"), "unauthorized")
                response = JSONResponse(error_body("missing or wrong API key: send 'Authorization: Bearer <key>'",
                                                   "authentication_error", "invalid_api_key"),
                                        status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(engine: SpecEngine | AsyncEngine | ProcessEngine, config: ServerConfig | None = None,
               **settings) -> FastAPI:
    """The FastAPI app over `engine`, with `config` (ServerConfig's defaults) and any of its fields
    given as keywords (`model_name=...`, `api_key=...`, `max_waiting=...`). Given a SpecEngine, its
    AsyncEngine loop thread starts with the app (lifespan) and stops with it (max_waiting,
    few_rows: see `AsyncEngine`); given an AsyncEngine or a ProcessEngine (the engine in its own
    process), whoever made it runs and closes it (`serve`). Either way `app.state.server` holds the
    handlers' state (`.engine` is the AsyncEngine or ProcessEngine once started). host, port,
    log_level and engine_process matter to `serve` only."""
    config = dataclasses.replace(config or ServerConfig(), **settings)
    given = engine if isinstance(engine, (AsyncEngine, ProcessEngine)) else None
    server = OpenAIServer(engine.engine if given is not None else engine, config)
    if given is not None:
        given.on_step = server.metrics.on_step

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.engine = given or AsyncEngine(engine, max_waiting=config.max_waiting, on_step=server.metrics.on_step,
                                             few_rows=config.few_rows)
        try:
            yield
        finally:
            if given is None:
                server.engine.close()
            server.pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="batchspec", lifespan=lifespan)
    app.state.server = server
    app.post("/v1/completions")(server.completions)
    app.post("/v1/chat/completions")(server.chat_completions)
    app.get("/v1/models")(server.models)
    app.get("/health")(server.health)
    app.get("/metrics")(server.render_metrics)

    def refused(path: str, outcome: str) -> None:
        if path in ENDPOINTS:
            server.metrics.request_done(ENDPOINTS[path], outcome)

    @app.exception_handler(RequestValidationError)
    async def malformed(request: Request, exc: RequestValidationError) -> JSONResponse:
        refused(request.url.path, "invalid")
        errors = list(exc.errors())
        return JSONResponse(error_body(f"malformed request: {_describe(errors)}", param=_param(errors)),
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail)), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:  # uvicorn logs the traceback
        refused(request.url.path, "error")
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"),
                            status_code=500)

    app.add_middleware(BodyGuard, max_bytes=server.max_body_bytes, on_refused=refused)
    if config.api_key:  # outermost: no body is read without the key
        app.add_middleware(BearerAuth, api_key=config.api_key, metrics=server.metrics)
    return app


def _param(errors) -> str | None:
    loc = [str(x) for x in (errors[0].get("loc", ()) if errors else ()) if x != "body"]
    return ".".join(loc) or None


def _describe(errors) -> str:
    parts = []
    for e in list(errors)[:5]:
        where = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{where or 'body'}: {e.get('msg', 'invalid')}")
    return "; ".join(parts)


def serve(engine: SpecEngine | ProcessEngine, config: ServerConfig | None = None, **settings) -> None:
    """Serve until interrupted (Ctrl-C or SIGTERM: uvicorn stops taking requests and finishes those
    in flight first), with `config` and any of its fields as keywords (see `create_app`).

    A ProcessEngine (`ProcessEngine.start`: the engine in its own process) is served by uvicorn on
    the calling thread and closed at the end. A SpecEngine's rounds run on the calling thread, the
    one that loaded the models and warmed them up, and uvicorn on another: with torch's OpenMP
    build, rounds on a second thread after the first had run torch took 1.5x as long (see
    `AsyncEngine`). Raises RuntimeError when the HTTP server cannot start (e.g. the port is taken)."""
    import uvicorn

    config = dataclasses.replace(config or ServerConfig(), **settings)
    if isinstance(engine, ProcessEngine):
        _serve_process(engine, config)
        return
    warm_up(engine)
    runner = AsyncEngine(engine, max_waiting=config.max_waiting, few_rows=config.few_rows, start=False)
    app = create_app(runner, config)
    host, port, log_level = config.host, config.port, config.log_level
    http = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                         access_log=log_level in ("info", "debug", "trace")))
    def run_http() -> None:  # (no signal handlers off the main thread)
        with contextlib.suppress(SystemExit):  # uvicorn exits when it cannot start: said below
            http.run()

    thread = threading.Thread(target=run_http, name="batchspec-http", daemon=True)
    on_term = signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops it like Ctrl-C
    thread.start()
    try:
        try:
            runner.run(alive=thread.is_alive)
        except KeyboardInterrupt:  # uvicorn stops taking requests and finishes those in flight: keep
            http.should_exit = True  # serving them until it is done (a second signal cuts that short)
            runner.run(alive=thread.is_alive)
    except KeyboardInterrupt:
        http.force_exit = True
    finally:
        http.should_exit = True
        thread.join(timeout=30)
        runner.close()
        signal.signal(signal.SIGTERM, on_term)
    if not http.started:
        raise RuntimeError(f"the HTTP server did not start on {host}:{port} (see the log above)")


def _serve_process(engine: ProcessEngine, config: ServerConfig) -> None:
    import uvicorn

    app = create_app(engine, config)
    host, port, log_level = config.host, config.port, config.log_level
    http = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                         access_log=log_level in ("info", "debug", "trace")))
    # uvicorn drains on SIGINT / SIGTERM, then raises the signal again: as KeyboardInterrupt here
    on_term = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        with contextlib.suppress(KeyboardInterrupt, SystemExit):  # SystemExit: it could not start (said below)
            http.run()
    finally:
        engine.close()
        signal.signal(signal.SIGTERM, on_term)
    if not http.started:
        raise RuntimeError(f"the HTTP server did not start on {host}:{port} (see the log above)")
