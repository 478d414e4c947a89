"""Run statistics: stage timers and counters, returned as values (not only logged).

Stages nest exclusively: entering "align" inside "draft" pauses the draft clock, so the
shares {prefill, draft, verify, align, other} of a run's wall time sum to 1.

The engine keeps one `RunStats` over its whole life (`SpecEngine.stats`); each `step()` fills
a fresh one and merges it into that and into every open `generate()` run, so a run's numbers
are its own without resetting anything.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

STAGES = ("prefill", "draft", "verify", "align")


class StageTimer:
    """Exclusive wall-clock time per stage. With `sync` the device is synchronised at every
    stage boundary, which makes CUDA timings exact at the price of the overlap it prevents."""

    def __init__(self, device=None, sync: bool = False) -> None:
        self.totals: dict[str, float] = dict.fromkeys(STAGES, 0.0)
        self._stack: list[tuple[str, float]] = []
        self.sync = sync and device is not None and torch.device(device).type == "cuda"
        self.device = device

    def stage(self, name: str) -> _Stage:
        return _Stage(self, name)

    def _now(self) -> float:
        if self.sync:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _enter(self, name: str) -> None:
        now = self._now()
        if self._stack:
            outer, since = self._stack[-1]
            self.totals[outer] = self.totals.get(outer, 0.0) + now - since
        self._stack.append((name, now))

    def _exit(self) -> None:
        now = self._now()
        name, since = self._stack.pop()
        self.totals[name] = self.totals.get(name, 0.0) + now - since
        if self._stack:
            outer, _ = self._stack[-1]
            self._stack[-1] = (outer, now)

    def reset(self) -> None:
        self.totals = dict.fromkeys(STAGES, 0.0)

    def since(self, earlier: dict[str, float]) -> dict[str, float]:
        """Time per stage spent after `earlier` (a copy of `totals`)."""
        return {k: v - earlier.get(k, 0.0) for k, v in self.totals.items()}


class _Stage:
    __slots__ = ("timer", "name")

    def __init__(self, timer: StageTimer, name: str) -> None:
        self.timer, self.name = timer, name

    def __enter__(self):
        self.timer._enter(self.name)
        return self

    def __exit__(self, *exc):
        self.timer._exit()
        return False


@dataclass
class RunStats:
    """Counters of one engine run; `summary()` turns them into the numbers the bench reports."""

    rounds: int = 0  # target verification passes (one per batch per round)
    row_rounds: int = 0  # sum over rounds of rows in the batch
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens appended to outputs
    accept_hist: Counter = field(default_factory=Counter)  # accepted drafts per row-round -> count
    siblings: int = 0  # runner-ups verified beside chains (sched/siblings.py)
    sibling_hits: int = 0  # ... and taken in a rejected draft's place (their tokens count in emitted, not accepted)
    idle_rows: int = 0  # rows inside a verify pass's slot range that were not in its batch
    padding_tokens: int = 0  # query columns a verify pass computed for nothing (rows drafting fewer)
    prefill_forwards: int = 0  # prefill chunks run (one forward of each model)
    prefill_tokens: int = 0  # prompt tokens prefilled
    fused_prefills: int = 0  # prompts prefilled inside a decoding round's pass (no forward of their own)
    moved_rows: int = 0  # rows copied to another slot to keep a batch's rows together (exspec)
    recomputed_rows: int = 0  # rows re-prefilled on entering LongRoPE's long regime
    aborted: int = 0
    finished: int = 0  # requests that ended (aborted ones included)
    peak_kv_tokens: int = 0  # most target KV tokens committed at once
    gamma_hist: Counter = field(default_factory=Counter)  # drafts verified per row-round (γ_i) -> count
    predicted_s: float = 0.0  # adaptive: the cost table's predicted draft + verify seconds, summed
    measured_s: float = 0.0  # ... and what those stages took
    round_time: dict = field(default_factory=dict)  # (rows, verified drafts) -> [rounds, tokens, seconds]: `round_gain`
    wall: float = 0.0
    stage_time: dict[str, float] = field(default_factory=dict)

    def merge(self, other: RunStats) -> None:
        """Add `other` (one step's numbers) into these; peaks take the maximum."""
        for name in ("rounds", "row_rounds", "drafted", "accepted", "emitted", "idle_rows", "padding_tokens",
                     "prefill_forwards", "prefill_tokens", "fused_prefills", "moved_rows", "recomputed_rows", "aborted",
                     "finished", "siblings", "sibling_hits", "predicted_s", "measured_s", "wall"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.accept_hist.update(other.accept_hist)
        self.gamma_hist.update(other.gamma_hist)
        for k, v in other.stage_time.items():
            self.stage_time[k] = self.stage_time.get(k, 0.0) + v
        self.peak_kv_tokens = max(self.peak_kv_tokens, other.peak_kv_tokens)
        for key, counts in other.round_time.items():
            kept = self.round_time.setdefault(key, [0, 0, 0.0])
            for i, n in enumerate(counts):
                kept[i] += n

    def count_round(self, rows: int, speculative: bool, tokens: int, seconds: float) -> None:
        """One decoding round of `rows` rows, which verified drafts or not, emitted `tokens` in `seconds`."""
        kept = self.round_time.setdefault((rows, speculative), [0, 0, 0.0])
        kept[0] += 1
        kept[1] += tokens
        kept[2] += seconds

    def summary(self) -> dict:
        share = {k: self.stage_time.get(k, 0.0) / self.wall if self.wall else 0.0 for k in STAGES}
        share["other"] = max(0.0, 1.0 - sum(share.values()))
        rounds = max(1, self.rounds)
        return {
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
            "tokens_per_round": self.emitted / max(1, self.row_rounds),
            "accept_hist": {str(k): v for k, v in sorted(self.accept_hist.items())},
            "siblings": self.siblings,
            "sibling_hits": self.sibling_hits,
            "idle_rows_per_round": self.idle_rows / rounds,
            "padding_tokens_per_round": self.padding_tokens / rounds,
            "mean_batch_occupancy": self.row_rounds / rounds,
            "prefill_forwards": self.prefill_forwards,
            "prefill_tokens": self.prefill_tokens,
            "fused_prefills": self.fused_prefills,
            "moved_rows_per_round": self.moved_rows / rounds,
            "peak_kv_tokens": self.peak_kv_tokens,
            # per-row draft lengths verified (γ_i per row-round), the drafts verified per round (the
            # budget) and, with an adaptive policy, its predicted over measured draft + verify time
            "adaptive": {"gamma_hist": {str(k): v for k, v in sorted(self.gamma_hist.items())},
                         "verified_per_round": self.drafted / rounds,
                         "accepted_per_verified": self.accepted / self.drafted if self.drafted else None,
                         "predicted_over_measured": self.predicted_s / self.measured_s if self.measured_s else None,
                         **round_gain(self.round_time)}
            if self.gamma_hist else None,
            "time_share": share,
        }


def round_gain(round_time: dict) -> dict:
    """Whether speculating paid, measured inside one run: the rounds that verified drafts against
    the plain rounds of the same batch sizes, at their tokens per second. `round_gain` is the
    seconds plain rounds would have taken for the speculative rounds' tokens over what those took
    (above 1: speculating made tokens faster); `round_gain_coverage` the share of the speculative
    rounds' seconds it rests on (batch sizes with no plain round are left out). A round counts
    whole, drafting included; one whose drafter found or kept nothing to verify counts as plain
    (a lookup without a match costs microseconds). Rounds of one run interleave within
    milliseconds, so a machine that speeds up or slows down over seconds moves both sides alike,
    which a speed-up between runs (`bench`'s paired ratios) cannot promise; it leaves out what
    happens between rounds (prefill, the draft model's prefill with it) and how full the rounds
    were.

    Example: at 8 rows 10 plain rounds made 80 tokens in 1.0 s and 3 speculative rounds 50 in
    0.5 s (plain: 0.625 s for those 50, gain 1.25); speculative rounds at 3 rows took 0.1 s with no
    plain round at 3 rows to compare: coverage 0.5 / 0.6.

    >>> round_gain({(8, False): [10, 80, 1.0], (8, True): [3, 50, 0.5], (3, True): [1, 9, 0.1]})
    {'round_gain': 1.25, 'round_gain_coverage': 0.8333333333333334}
    """
    speculative = plain = total = 0.0
    for (rows, verified), (_, tokens, seconds) in round_time.items():
        if not verified:
            continue
        total += seconds
        _, base_tokens, base_s = round_time.get((rows, False), (0, 0, 0.0))
        if base_tokens > 0 and base_s > 0:
            speculative += seconds
            plain += tokens * base_s / base_tokens
    return {"round_gain": plain / speculative if speculative else None,
            "round_gain_coverage": speculative / total if total else None}
