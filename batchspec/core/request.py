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


class AcceptanceRecord:
    """Per draft position j (0-based): how many drafts at j were verified with every draft before
    them accepted (`reached[j]`), and how many of those were accepted (`accepted[j]`). The rate
    accepted[j] / reached[j] is P(d_{j+1} accepted | d_1..d_j accepted): acceptance comes in runs,
    so later positions are judged given the earlier ones (sched/policy.py).

    Example: a round verifying 4 drafts and accepting 2 reaches positions 0, 1, 2 (position 3
    follows a rejection) and accepts at 0 and 1: reached [1, 1, 1, 0], accepted [1, 1, 0, 0]."""

    __slots__ = ("reached", "accepted")

    def __init__(self) -> None:
        self.reached: list[int] = []
        self.accepted: list[int] = []

    def add(self, a: int, n: int) -> None:
        """A round that verified n drafts and accepted a of them."""
        reach = min(a + 1, n)
        if len(self.reached) < n:
            grow = n - len(self.reached)
            self.reached += [0] * grow
            self.accepted += [0] * grow
        for j in range(reach):
            self.reached[j] += 1
            self.accepted[j] += j < a

    def expect(self, j: int, chance: float) -> None:
        """A draft at position j reached (every earlier one accepted) and not verified, counted at
        its chance of acceptance (a draft a gate dropped: sched/gate.py), so that the record stays
        what drafting there accepts, not what the drafts the gate kept did."""
        if len(self.reached) <= j:
            grow = j + 1 - len(self.reached)
            self.reached += [0] * grow
            self.accepted += [0] * grow
        self.reached[j] += 1
        self.accepted[j] += chance


@dataclass
class RequestStats:
    rounds: int = 0  # target forward passes this request took part in (prefill excluded)
    drafted: int = 0  # draft tokens proposed for it
    accepted: int = 0  # draft tokens the target accepted
    looked_up: int = 0  # rounds in which a lookup (not a model) drafted for it
    # its record per source of drafts: a lookup's (True) and a model's (False), judged apart
    records: dict[bool, AcceptanceRecord] = field(default_factory=dict, repr=False)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def count_drafts(self, a: int, n: int, looked: bool) -> None:
        """A round in which the request verified n >= 1 drafts and accepted a of them; `looked`: a
        lookup drafted them. (A round verifying none changes none of these.)"""
        self.drafted += n
        self.accepted += a
        self.looked_up += looked
        self.record(looked).add(a, n)

    def record(self, looked: bool) -> AcceptanceRecord:
        rec = self.records.get(looked)
        if rec is None:
            rec = self.records[looked] = AcceptanceRecord()
        return rec


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
    job: bool = False  # one of a closed set of prompts (`SpecEngine.submit`): its batch can drain

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
