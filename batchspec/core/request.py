"""The request record: the source of truth for one sequence.

Tokens, the prompt length and each model's committed KV length live here. Everything a
model runner feeds (input ids, masks, positions) is derived from these numbers each round.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ..sampling import SamplingParams


class FinishReason(str, Enum):
    STOP = "stop"  # an EOS / stop token (included in the output) or a stop string (cut from the text)
    LENGTH = "length"  # max_new_tokens were generated
    ABORT = "abort"  # aborted by the caller (e.g. its client went away)


@dataclass
class RequestStats:
    rounds: int = 0  # target forward passes this request took part in (prefill excluded)
    drafted: int = 0  # draft tokens proposed for it
    accepted: int = 0  # draft tokens the target accepted
    first_drafted: int = 0  # rounds in which it drafted at least one token
    first_accepted: int = 0  # ... and the first draft was accepted
    looked_up: int = 0  # rounds in which a hybrid drafter's lookup, not its draft model, drafted for it
    later_reached: int = 0  # its drafts after the first that were verified with every draft before them accepted
    later_accepted: int = 0  # ... and were accepted
    # the lookup's part of first_accepted, later_reached and later_accepted (its drafts are judged apart)
    looked_accepted: int = 0
    looked_later_reached: int = 0
    looked_later_accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def count_drafts(self, a: int, n: int, looked: bool) -> None:
        """A round in which the request verified n >= 1 drafts and accepted a of them; `looked`: a
        hybrid drafter's lookup drafted them. (A round verifying none changes none of these.)"""
        self.drafted += n
        self.accepted += a
        self.first_drafted += 1
        self.first_accepted += a > 0
        self.later_reached += min(a + 1, n) - 1  # d_2.. reached: the drafts before the first rejected one
        self.later_accepted += max(0, a - 1)
        if looked:
            self.looked_up += 1
            self.looked_accepted += a > 0
            self.looked_later_reached += min(a + 1, n) - 1
            self.looked_later_accepted += max(0, a - 1)


@dataclass(eq=False)
class Request:
    """One sequence in flight. `token_ids` holds prompt + generated tokens.

    kv_len[model] counts the leading tokens whose KV entries that model has committed; tokens
    after it are fed on the model's next forward pass. At a round boundary the target has
    kv_len == len(token_ids) - 1 (the newest token is always unfed) and the draft lags by 1 or 2.
    A request is `prefilled` once the target holds all but its newest token; before that it is
    resident but still being prefilled (in chunks). `reported` counts the output tokens already
    handed out by `SpecEngine.step()`.
    """

    index: int
    token_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    prompt: str | None = None
    kv_len: dict[str, int] = field(default_factory=dict)
    finish_reason: FinishReason | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    generator: Any = None  # torch.Generator for sampled requests, None for greedy ones
    text: Any = None  # core.detok.TextStream when the engine has a tokenizer
    slot: int | None = None  # its row in every model's KV buffer while resident (core/rows.py)
    prompt_len: int = 0
    reported: int = 0

    def __post_init__(self) -> None:
        self.prompt_len = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - self.num_generated

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilled(self) -> bool:
        return self.kv_len.get("target", 0) >= self.num_tokens - 1

    def append(self, tokens: list[int]) -> int:
        """Append verified tokens, stopping at the first stop token, stop string or at max_new_tokens.

        Returns how many were appended; sets finish_reason when the request is complete.
        Nothing after the first stop token (or the token that completes a stop string) is appended.
        """
        taken = 0
        for tok in tokens[: self.remaining]:
            self.token_ids.append(tok)
            taken += 1
            stop_string = self.text is not None and self.text.push(tok)
            if tok in self.stop_ids or stop_string:
                self.finish_reason = FinishReason.STOP
                return taken
        if self.remaining <= 0:
            self.finish_reason = FinishReason.LENGTH
        return taken


@dataclass
class StepOutput:
    """What one `SpecEngine.step()` reports for a request that advanced or ended.

    new_token_ids / new_text are this round's additions (text is released once it is complete
    UTF-8 and cannot be the start of a stop string); `output` is the whole result once finished.
    """

    index: int
    new_token_ids: list[int]
    new_text: str | None
    finish_reason: str | None = None
    output: Output | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Output:
    """What `SpecEngine.generate` returns per prompt, in input order."""

    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    stats: RequestStats
