"""What a request must pass before anything costly runs: its body's size and encoding (an ASGI
middleware, before JSON is parsed), and its text's validity and length (before it is tokenized).

A body over the limit is read to its end and dropped chunk by chunk, never held, so the server's
memory does not grow and the keep-alive connection stays usable; the answer is 413 naming the
limit. A body that is not UTF-8 is 400, as malformed JSON is.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


class BodyGuard:
    """ASGI middleware over POST requests: 413 past `max_bytes`, 400 for a body that is not UTF-8;
    the app gets the whole body at once otherwise."""

    def __init__(self, app, max_bytes: int, on_refused=None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_refused = on_refused  # (path, outcome) -> None: the metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        size, chunks, more = 0, [], True
        too_big = declared.isdigit() and int(declared) > self.max_bytes
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            piece = message.get("body", b"")
            size += len(piece)
            more = message.get("more_body", False)
            too_big = too_big or size > self.max_bytes
            if not too_big:
                chunks.append(piece)
            elif chunks:
                chunks = []  # drop what was kept: the rest is only counted
        if too_big:
            await self._refuse(scope, receive, send, 413,
                               f"the request body has {size} bytes, more than this server's limit of "
                               f"{self.max_bytes} (max_body_bytes); send a shorter prompt")
            return
        body = b"".join(chunks)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as exc:
            await self._refuse(scope, receive, send, 400,
                               f"the request body is not valid UTF-8 (byte {exc.start}: {exc.reason}); "
                               "send JSON encoded as UTF-8")
            return
        await self.app(scope, _replay(body, receive), send)

    async def _refuse(self, scope, receive, send, status: int, message: str) -> None:
        if self.on_refused is not None:
            self.on_refused(scope["path"], "invalid")
        from .protocol import error_body  # (protocol checks text with this module's functions)

        await JSONResponse(error_body(message), status_code=status)(scope, receive, send)


def _replay(body: bytes, receive):
    given = False

    async def replay():
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: the disconnect, when it comes

    return replay


def check_text(value: str, where: str) -> None:
    """ValueError for text no tokenizer can take: lone surrogates (JSON's "\\ud800" escapes decode
    to them) cannot be encoded as UTF-8."""
    if value.isascii():
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{where} contains a lone surrogate (U+{ord(value[exc.start]):04X}) at character "
                         f"{exc.start}; send valid Unicode text") from None


def check_texts(data: Any, where: str) -> None:
    """check_text over every string inside `data` (dicts, lists), naming where it sits."""
    if isinstance(data, str):
        check_text(data, where)
    elif isinstance(data, dict):
        for key, item in data.items():
            if isinstance(key, str):
                check_text(key, f"{where} (a key)")
            check_texts(item, f"{where}.{key}")
    elif isinstance(data, list):
        for i, item in enumerate(data):
            check_texts(item, f"{where}[{i}]")


def text_chars(data: Any) -> int:
    """Characters of text in `data` (strings inside dicts and lists); token ids count nothing."""
    if isinstance(data, str):
        return len(data)
    if isinstance(data, dict):
        return sum(text_chars(v) for v in data.values())
    if isinstance(data, list):
        return sum(text_chars(v) for v in data)
    return 0
