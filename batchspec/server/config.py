"""`batchspec serve`'s settings: data, validated loudly when built (the CLI derives its options from it)."""

from __future__ import annotations

from dataclasses import dataclass, field

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
BODY_OVERHEAD = 1 << 20  # bytes a request may hold besides its prompt text: fields, token-id lists, tools


@dataclass(frozen=True)
class ServerConfig:
    """How the HTTP side serves one engine.

    host          address to bind; loopback unless told otherwise.
    port          TCP port (0: any free one).
    model_name    the model id clients name in requests and GET /v1/models lists.
    api_key       require 'Authorization: Bearer KEY' on every endpoint but /health (None: no key).
    max_waiting   requests allowed to wait for an engine row; more get 429 with Retry-After (None: no limit).
    max_prompt_chars  characters of prompt text one request may carry (all its prompts or messages
                  together), checked before anything is tokenized; more get 400 naming the limit.
                  None: the model context times the longest token of the vocabulary, in characters
                  (a longer text cannot fit the context).
    max_body_bytes  bytes of request body; a longer body is read and dropped, never kept, and gets
                  413. None: 8 bytes per allowed prompt character (JSON escapes) plus 1 MiB.
    tokenizer_threads  threads that tokenize prompts, render chat templates and check requests, so
                  that the HTTP event loop never does (it only parses, queues and streams).
    retry_after   seconds a 429 (queue full) or 503 (engine stopped) answer tells the client to wait
                  (the Retry-After header).
    few_rows      on a CPU, run rounds on one torch thread while at most this many requests are in
                  the engine, leaving the other cores to the HTTP side (0: never; see AsyncEngine).
    log_level     uvicorn's log level (info and below log every request).
    engine_process  run the engine in its own process (`serve` only): its rounds and the HTTP event
                  loop share no GIL (1.2-1.4x the tokens/s of the engine on the server's main thread
                  at 1 and 8 clients on the bundled pair, 1.0-1.3x at 32); off: on that main thread.
    """

    # (metadata: how `batchspec serve` names and files each field's option; see cli/options.py)
    host: str = field(default="127.0.0.1", metadata={"metavar": "ADDRESS"})
    port: int = field(default=8000, metadata={"metavar": "N"})
    model_name: str = field(default="batchspec", metadata={"cli": False})  # serve: --served-model-name
    api_key: str | None = field(default=None, metadata={"metavar": "KEY", "envvar": "BATCHSPEC_API_KEY"})
    max_waiting: int | None = field(default=256, metadata={"metavar": "N"})
    max_prompt_chars: int | None = field(default=None, metadata={"metavar": "N", "panel": "Expert"})
    max_body_bytes: int | None = field(default=None, metadata={"metavar": "N", "panel": "Expert"})
    tokenizer_threads: int = field(default=2, metadata={"metavar": "N", "panel": "Expert"})
    retry_after: int = field(default=1, metadata={"metavar": "S", "panel": "Expert"})
    few_rows: int = field(default=0, metadata={"metavar": "N", "panel": "Expert", "flags": ("--single-thread-rows",)})
    log_level: str = field(default="warning", metadata={"metavar": "NAME"})
    engine_process: bool = field(default=True, metadata={"panel": "Expert"})

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host must not be empty (127.0.0.1 serves loopback only)")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not self.model_name:
            raise ValueError("model_name must not be empty")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be blank; leave it unset to serve without a key")
        for name, least in (("max_waiting", 0), ("max_prompt_chars", 1), ("max_body_bytes", 1)):
            value = getattr(self, name)
            if value is not None and value < least:
                raise ValueError(f"{name} must be >= {least} (or unset), got {value}")
        for name in ("tokenizer_threads", "retry_after"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.few_rows < 0:
            raise ValueError(f"few_rows must be >= 0, got {self.few_rows}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")

    def prompt_chars(self, context: int, longest_token: int) -> int:
        """The prompt-text limit in force for a model of this context and longest token."""
        if self.max_prompt_chars is not None:
            return self.max_prompt_chars
        return max(1, context) * max(1, longest_token)

    def body_bytes(self, prompt_chars: int) -> int:
        """The body limit in force, given the prompt-text limit."""
        return self.max_body_bytes if self.max_body_bytes is not None else 8 * prompt_chars + BODY_OVERHEAD

