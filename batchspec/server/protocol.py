"""The OpenAI wire format: request models (pydantic) and the JSON the server answers with.

Request models are strict, as OpenAI is: a string or a boolean is never taken for a number (nor
a number for a boolean); `max_tokens` >= 1; `stream_options` only with `stream`; no text with
lone surrogates anywhere. Those, like malformed JSON, are 400 answers naming the field. Other
ranges are checked by `SamplingParams` and the engine, whose ValueError messages become 400
answers with the reason, so a client learns what to change. Fields that OpenAI defines but
batchspec does not implement are accepted only at their neutral value (`unsupported()` names the
others, which become 400).

Extensions beyond OpenAI's schema (as vLLM accepts them): `top_k` (0 or -1: off) and `ignore_eos`.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..sampling import SamplingParams
from .chat import parse_tool_calls
from .guard import check_texts

MAX_CHOICES = 16  # n x prompts per HTTP request
SEED_RANGE = (-(2**63), 2**63 - 1)


STRICT = ConfigDict(strict=True, extra="ignore")
TEXT_ONLY = '{"type": "text"}'


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class GenerationRequest(BaseModel):
    """The fields /v1/completions and /v1/chat/completions share."""

    model_config = STRICT

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
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
    response_format: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, value in data.items():
                check_texts(value, str(key))
        return data

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> GenerationRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def unsupported(self) -> list[str]:
        """Fields set to something batchspec does not implement, each with what it supports."""
        neutral = {"presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {}),
                   "logprobs": (None, False, 0), "top_logprobs": (None, 0), "best_of": (None, 1),
                   "echo": (None, False), "suffix": (None, "")}
        bad = [name for name, ok in neutral.items() if getattr(self, name) not in ok]
        if self.response_format not in (None, {"type": "text"}):
            kind = self.response_format.get("type")
            bad.append(f"response_format of type {kind!r} (supported: {TEXT_ONLY}: plain text, no JSON mode or "
                       "schema-constrained decoding)")
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
    model_config = ConfigDict(strict=True, extra="allow")

    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string


class ToolCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    id: str
    type: str = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One message, kept whole: every field the client sent reaches the chat template."""

    model_config = ConfigDict(strict=True, extra="allow")

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def for_template(self, where: str = "message") -> dict[str, Any]:
        """The message as chat templates expect it (as transformers' and vLLM's do): text content
        parts joined into one string, each tool call's JSON arguments parsed into a dict; every
        other field as sent."""
        message = self.model_dump(exclude_none=True)
        content = self.content
        if isinstance(content, list):
            kinds = sorted({p.type for p in content if p.type != "text"})
            if kinds:
                raise ValueError(f"only text content is supported, got content parts of type {', '.join(kinds)}")
            content = "".join(p.text or "" for p in content)
        message["content"] = content or ""
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
            for i, call in enumerate(message["tool_calls"]):
                args = call["function"]["arguments"]
                if isinstance(args, str):
                    try:
                        call["function"]["arguments"] = json.loads(args or "{}")
                    except ValueError:
                        raise ValueError(f"{where}.tool_calls[{i}].function.arguments is not valid JSON: "
                                         f"{args[:80]!r}") from None
        return message


class ChatCompletionRequest(GenerationRequest):
    """POST /v1/chat/completions. max_tokens (or max_completion_tokens) defaults to what the
    context and the KV budget leave after the prompt. `tools` reach templates that take them;
    `tool_choice` may be "auto" (the default) or "none"."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.tool_choice not in (None, "auto", "none"):
            bad.append('tool_choice other than "auto" or "none" (batchspec serve does not force tool calls)')
        return bad

    @property
    def wants_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

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
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class ResponseFormat:
    """Builds one endpoint's JSON objects: the whole response and the streamed chunks. With
    `tools` (chat with tools), answers are parsed for tool calls (server/chat.py), and a streamed
    answer comes whole in its last chunk, since a call is known only once it is complete."""

    def __init__(self, chat: bool, model: str, tools: bool = False) -> None:
        self.chat = chat
        self.tools = chat and tools
        self.model = model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def message(self, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The assistant message of an answer and its finish reason ("tool_calls" when it calls one)."""
        if not self.tools:
            return {"role": "assistant", "content": text}, reason
        content, calls = parse_tool_calls(text)
        if not calls:
            return {"role": "assistant", "content": text}, reason
        return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"

    def response(self, choices: list[tuple[str, str]], usage_: dict[str, int]) -> dict[str, Any]:
        """choices: (text, finish_reason) in choice order."""
        if self.chat:
            items = []
            for i, (text, reason) in enumerate(choices):
                message, reason = self.message(text, reason)
                items.append({"index": i, "message": message, "logprobs": None, "finish_reason": reason})
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

    def whole_chunk(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        """With tools: a whole answer as one streamed chunk (content and/or tool calls, and the end)."""
        message, reason = self.message(text, finish_reason)
        delta = {k: v for k, v in message.items() if k != "role" and v is not None}
        if "tool_calls" in delta:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(delta["tool_calls"])]
        return self._chunk([{"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}])

    def usage_chunk(self, usage_: dict[str, int]) -> dict[str, Any]:
        return {**self._chunk([]), "usage": usage_}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": None}
