"""The drafter seam: one protocol every drafter implements, and the small records that cross it.

A round asks a drafter four things, in the order of the paper's loop (decode/round.py):

    offer(reqs, caps)                  before the plan: per row, how many drafts a lookup already
                                       has for it (free), or None where a model step would draft
    propose(reqs, lengths, u, s)       draft lengths[i] tokens for row i (fewer where it has fewer)
    observe(reqs, outcome)             what the target accepted (and, for drafters that read the
                                       target's features, the target's hidden states of the round)
    step_probe(rows, context)          once, for the cost table: one draft step of `rows` rows,
                                       timed (None: a model-free drafter, whose drafts cost no step)

The policy (sched/policy.py) prices a row by what its offer says: an int row is drafted by a
lookup and costs no draft step; a None row costs the drafter's step D(rows) per depth. Nothing
else is read off a drafter: no hasattr checks, no attributes set by the engine.

Drafters that draft from the target's hidden states (EAGLE heads) name the layers they need in
`features`; the engine then asks the target for those layers on the passes whose tokens the
drafter must see, and hands them over in `prefill(..., hidden)` and `observe(..., outcome.hidden)`.
Every other drafter has `features = None` and the target computes no extra output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ..core.request import Request
from ..sampling import BatchSampling


@dataclass
class DraftProposal:
    tokens: torch.Tensor  # [B, g] long: drafted tokens d_1..d_g per row (g = max lengths asked)
    probs: torch.Tensor | None  # [B, g, V] the q each d_j was drawn from; None: deterministic (q one-hot)
    # row i proposes only its first lengths[i] tokens (a lookup with a short or no match); the rest
    # of its row is padding and is never verified. None: every row all it was asked for.
    lengths: list[int] | None = None
    # rows a lookup drafted (a hybrid's lookup rows, or every row of a lookup drafter): their records
    # are kept apart from a model's (core/request.py, `RequestStats.record`)
    looked: list[bool] | None = None
    # [B, g] a confident drafter's confidence in each draft (max q_ij, read before d_ij is drawn;
    # 0 where it drafted nothing): what a gate steers by and a walk records. None: not known
    confidence: torch.Tensor | None = None
    # [B, g, w] a greedy drafter's runner-ups at each depth (its next-best tokens after d_j, by
    # descending q) and [B, g, w] their q: siblings a round may verify beside d_j
    # (sched/siblings.py). None: none known (a lookup, a sampled round)
    runner_ups: torch.Tensor | None = None
    runner_up_q: torch.Tensor | None = None


@dataclass
class RoundOutcome:
    """What the target did with a round's drafts, for `Drafter.observe`."""

    accepted: list[int]  # per row: drafts accepted (its bonus or recovered token follows them)
    lengths: list[int]  # per row: drafts verified
    # [B, n, F] the target's features (`Drafter.features`) at each row's fed columns of the verify
    # pass: column 0 the row's newest token, then its verified drafts; None unless asked for
    hidden: torch.Tensor | None = None
    # per row: columns fed before the newest token in the same pass (a prompt joining the round);
    # hidden then holds those columns first
    leads: list[int] | None = None


class Drafter(Protocol):
    label: str  # how outputs and reports name it
    synthetic: bool  # True for drafters that cheat (know the answer); reports must say so
    features: tuple[int, ...] | None  # target layers whose hidden states it drafts from; None: none
    sources: tuple[bool, ...]  # what `offer` may name: True, a lookup's rows; False, rows a model step drafts
    # True: `propose` reports each draft's confidence and takes `gate` (sched/gate.py), which stops
    # the rows it steers where their next draft is not worth its price, before its step is paid
    confident: bool
    # runner-up tokens per depth its greedy proposals carry (`DraftProposal.runner_ups`); 0: none
    runner_ups: int

    def step_probe(self, rows: int, context: int) -> Callable[[], float] | None:
        """A function that runs one draft step of `rows` rows (one token each, over `context`
        keys) and returns its seconds, for the cost table (sched/costs.py); None: drafting
        costs no model step (a lookup)."""

    def offer(self, reqs: list[Request], caps: list[int]) -> list[int | None]:
        """Before the plan: per row, the drafts a lookup has for it now (at most caps[i]; 0: none,
        the row goes undrafted), or None where a model step drafts it (up to caps[i]). The next
        `propose` for the same rows reuses what was looked up."""

    def prefill(self, reqs: list[Request], ends: list[int], hidden: torch.Tensor | None = None,
                counts: list[int] | None = None) -> None:
        """Cover tokens [0, ends[i]) of each request (a prefill chunk; the last chunk ends at
        len - 1). `hidden` [b, n, F]: the target's features of the chunk's columns, for a drafter
        with `features`; row i's chunk is tokens [ends[i] - counts[i], ends[i]) (a re-prefilled row's
        chunk may start before what the drafter holds: its features replace those). The engine may
        skip this; `propose` must then catch up on whatever it has not seen."""

    def propose(self, reqs: list[Request], lengths: list[int], uniforms: torch.Tensor | None,
                sampling: BatchSampling, gate=None) -> DraftProposal:
        """Draft up to lengths[i] tokens for row i (`reqs` in slot order); uniforms [B, max
        lengths] drive sampling (None when every row is greedy). `gate` (only for a `confident`
        drafter): lengths[i] is row i's most, and at each depth the gate is told the confidence of
        the rows it steers and says which go on (sched/gate.py)."""

    def observe(self, reqs: list[Request], outcome: RoundOutcome) -> None:
        """The target verified outcome.lengths[i] of row i's drafts and accepted outcome.accepted[i]."""

    def release(self, req: Request) -> None:
        """The request left the engine."""

    def forget(self) -> None:
        """Drop what finished requests taught the drafter (the suffix drafter's shared trie), so a
        benchmark's repeats each start from the same history; requests in flight are untouched."""
