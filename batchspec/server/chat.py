"""Chat requests to prompt text and answers back to messages.

Messages reach the model's chat template whole (`ChatMessage.for_template`); `tools` reach it
too when the template takes them (its source names `tools`), else the request is a 400 saying
so. Tool calls are parsed back out of the answer only in the one format batchspec knows, the
Hermes / Qwen convention that the bundled pair's template also uses:

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

A template that takes tools but writes no `<tool_call>` is refused with tools (400): its calls
could not be returned as `tool_calls`. Text before the first call is the message's content.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
FORMAT = '<tool_call>{"name": ..., "arguments": {...}}</tool_call>'


def template_of(tokenizer) -> str:
    """The tokenizer's chat template source; ValueError when it has none."""
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if isinstance(template, dict):  # named templates: the default one
        template = template.get("default") or next(iter(template.values()), None)
    if not template:
        raise ValueError("this model's tokenizer has no chat template, so /v1/chat/completions cannot build a "
                         "prompt from messages; use /v1/completions with the prompt text")
    return template


def check_tools(template: str) -> None:
    """ValueError unless tools can be rendered by `template` and its calls parsed back."""
    if "tools" not in template:
        raise ValueError("this model's chat template takes no tools; leave tools unset (or use /v1/completions)")
    if "<tool_call>" not in template:
        raise ValueError(f"this model's chat template takes tools but writes no tool-call format batchspec can "
                         f"parse back (it parses {FORMAT}); leave tools unset")


def render(tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """The prompt text; ValueError for the template's own refusals (roles must alternate, ...)."""
    template = template_of(tokenizer)
    if tools:
        check_tools(template)
    try:
        return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # the template's raise_exception or a Jinja error
        raise ValueError(f"the chat template could not render these messages: {exc}") from None


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls in OpenAI's shape) of an answer; no calls when none parses."""
    calls = []
    for match in TOOL_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        args = call.get("arguments", {})
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"],
                                   "arguments": args if isinstance(args, str) else json.dumps(args)}})
    if not calls:
        return text, []
    content = text[: text.find("<tool_call>")].strip()
    return content or None, calls
