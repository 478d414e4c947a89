"""Incremental detokenization of one request's output, with stop strings.

Tokens arrive a few at a time (one verification round's worth). Each is decoded once by
`tokenizers.decoders.DecodeStream`, which holds back bytes that do not yet form a complete
UTF-8 character, so text is never re-decoded from the start and a multi-byte character split
across tokens appears whole.

Stop strings: after each token the new text is searched for every stop string (only the tail
that could contain a new match is searched). On a match the text is cut just before the stop
string and the token that completed it is the request's last token, so the token ids are
exactly those whose decoding contains the text up to and including the stop string.

Streaming holds back the shortest tail that could still grow into a stop string: with stop
"\\n\\n", text "a = 1\\n" releases "a = 1" and keeps "\\n" until the next token shows whether
it starts the stop string.

Example, stop ["END"], tokens decoding to "x", " E", "ND", " y":
    push("x") -> release "x";  push(" E") -> release " " (holds "E");  push("ND") -> stopped,
    text "x ", and " y" is never pushed (the engine stops the request at the "ND" token).
"""

from __future__ import annotations

from collections.abc import Sequence


class TextStream:
    def __init__(self, tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True) -> None:
        from tokenizers.decoders import DecodeStream

        self._backend = getattr(tokenizer, "_tokenizer", tokenizer)  # the Rust tokenizer under an HF fast one
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.stop = tuple(s for s in stop if s)
        self._longest = max((len(s) for s in self.stop), default=0)
        self.text = ""  # all text so far (cut before the stop string once stopped)
        self.stopped = False
        self._released = 0  # characters of `text` handed out by `take`

    def push(self, token_id: int) -> bool:
        """Decode one more token. Returns True when a stop string completed with it."""
        if self.stopped:
            raise RuntimeError("push after a stop string was matched")
        chunk = self._stream.step(self._backend, int(token_id))
        if not chunk:
            return False
        start = max(0, len(self.text) - self._longest + 1)  # a new match must overlap the chunk
        self.text += chunk
        if not self.stop:
            return False
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
        return self.stopped

    def take(self, final: bool = False) -> str:
        """Text not handed out before. Unless `final`, a tail that could start a stop string waits."""
        end = len(self.text)
        if not final and not self.stopped:
            end -= self._held_tail()
        end = max(end, self._released)
        out = self.text[self._released:end]
        self._released = end
        return out

    def _held_tail(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        text, best = self.text, 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
