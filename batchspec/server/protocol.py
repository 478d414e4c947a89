"""The OpenAI wire format: request models (pydantic) and the JSON the server answers with.

Request models check only shapes and types (a wrong type is a 422). Ranges are checked by
`SamplingParams` and the engine, whose ValueError messages become 400 answers with the reason,
so a client learns what to change. Fields that OpenAI defines but batchspec does not implement
are accepted only at their neutral value (`unsupported()` names the others, which become 400).

Extensions beyond OpenAI's schema (as vLLM accepts them): `top_k` (0 or -1: off) and `ignore_eos`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict

from ..sampling import SamplingParams

MAX_CHOICES = 16  # n x prompts per HTTP request
SEED_RANGE = (-(2**63), 2**63 - 1)


class StreamOptions(BaseModel):
    include_usage: bool = False


class GenerationRequest(BaseModel):
    """The fields /v1/completions and /v1/chat/completions share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None  # OpenAI's default is 1.0 (sampling); 0 is greedy
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False  # null is accepted wherever a default exists: some clients send it for "unset"
    stream_options: StreamOptions | None = None
    n: int | None = 1
    ignore_eos: bool | None = False
    user: str | None = None
    # OpenAI fields without an implementation: only their neutral values are accepted
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None
    top_logprobs: int | None = None
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> list[str]:
        """Fields set to something batchspec does not implement."""
        neutral = {"presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {}),
                   "logprobs": (None, False, 0), "top_logprobs": (None, 0), "best_of": (None, 1),
                   "echo": (None, False), "suffix": (None, ""), "tools": (None, [])}
        bad = [name for name, ok in neutral.items() if getattr(self, name) not in ok]
        if self.response_format not in (None, {"type": "text"}):
            bad.append("response_format")
        return bad

    def max_new_tokens(self, default: int | None) -> int | None:
        return self.max_tokens if self.max_tokens is not None else default

    def sampling_params(self, max_new_tokens: int, choice: int, vocab_size: int) -> SamplingParams:
        """SamplingParams of choice `choice` (seed + choice when seeded); ValueError for bad values."""
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must be a 64-bit signed integer, got {self.seed}")
        top_k = 0 if self.top_k in (None, -1) else self.top_k
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=min(top_k, vocab_size),  # k >= vocabulary keeps every token, as k = vocabulary does
            seed=None if self.seed is None else self.seed + choice,
            max_new_tokens=max_new_tokens,
            stop=(self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()),
            ignore_eos=bool(self.ignore_eos),
        )

    @property
    def choices(self) -> int:
        return 1 if self.n is None else self.n

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(GenerationRequest):
    """POST /v1/completions. A prompt is text or token ids; a list of them gives n choices each.
    max_tokens defaults to 16, as OpenAI's legacy endpoint does."""

    prompt: str | list[int] | list[str] | list[list[int]]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template expects it: content flattened to text."""
        content = self.content
        if isinstance(content, list):
            kinds = sorted({p.type for p in content if p.type != "text"})
            if kinds:
                raise ValueError(f"only text content is supported, got content parts of type {', '.join(kinds)}")
            content = "".join(p.text or "" for p in content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(GenerationRequest):
    """POST /v1/chat/completions. max_tokens (or max_completion_tokens) defaults to what the
    context and the KV budget leave after the prompt."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None

    def max_new_tokens(self, default: int | None) -> int | None:
        if self.max_tokens is not None:
            return self.max_tokens
        return self.max_completion_tokens if self.max_completion_tokens is not None else default


# --------------------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def error_body(message: str, kind: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class ResponseFormat:
    """Builds one endpoint's JSON objects: the whole response and the streamed chunks."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def response(self, choices: list[tuple[str, str]], usage_: dict[str, int]) -> dict[str, Any]:
        """choices: (text, finish_reason) in choice order."""
        if self.chat:
            items = [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": reason} for i, (text, reason) in enumerate(choices)]
        else:
            items = [{"index": i, "text": text, "logprobs": None, "finish_reason": reason}
                     for i, (text, reason) in enumerate(choices)]
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": items, "usage": usage_}

    def chunk(self, index: int, text: str | None, finish_reason: str | None = None,
              role: bool = False) -> dict[str, Any]:
        """One streamed piece of choice `index`: text, the assistant role (chat's first chunk), or the end."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return self._chunk([choice])

    def usage_chunk(self, usage_: dict[str, int]) -> dict[str, Any]:
        return {**self._chunk([]), "usage": usage_}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": None}
