"""`batchspec serve`'s settings: data, validated loudly when built (the CLI derives its options from it)."""

from __future__ import annotations

from dataclasses import dataclass, fields

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
    """

    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = "batchspec"
    api_key: str | None = None
    max_waiting: int | None = 256
    max_prompt_chars: int | None = None
    max_body_bytes: int | None = None
    tokenizer_threads: int = 2
    retry_after: int = 1
    few_rows: int = 0
    log_level: str = "warning"

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


def field_docs() -> dict[str, str]:
    """Each field's description, from the docstring (for CLI help)."""
    names = {f.name for f in fields(ServerConfig)}
    docs: dict[str, str] = {}
    current = None
    for line in (ServerConfig.__doc__ or "").splitlines()[2:]:
        stripped = line.strip()
        head = stripped.split(" ", 1)[0] if stripped else ""
        if head in names and line.startswith("    ") and not line.startswith("     "):
            current = head
            docs[current] = stripped[len(head):].strip()
        elif current and stripped:
            docs[current] += " " + stripped
    return docs
