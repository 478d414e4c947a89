"""Prompt lookup (`--drafter ngram[:min_n,max_n,k]`): copy what followed the newest n-gram last time.

Each round, for each row, the longest suffix of the request's tokens (prompt + generated, n from
max_n down to min_n) that occurred earlier is looked up, and the tokens that followed its most
recent earlier occurrence are proposed, at most min(k, γ) of them. No model runs, so drafting
costs a few dictionary operations per row, and proposals are point masses: the target accepts
d_j with probability p(d_j), which keeps sampling exact (see verify/rejection.py).

The index is incremental: per request a dict from each n-gram to the end of its latest
occurrence, extended with only the tokens appended since the last round, so a round costs
O((new tokens + 1) x (max_n - min_n + 1)) whatever the context length; the prompt is indexed
once, during prefill. Memory: one dict entry per position and n.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..core.request import Request
from ..sampling import BatchSampling
from .base import DraftProposal

MIN_N, MAX_N, K = 2, 4, 16  # defaults: bigrams are the weakest match worth a verify column


class NgramIndex:
    """Where each n-gram (min_n <= n <= max_n) of one growing token sequence last occurred.

    last[g] = e means the n-gram g = tokens[e - n : e] has a token after it (at position e) and e
    is the largest such end. The newest n-gram (ending at len(tokens)) enters the table only once
    a token follows it, so looking up the sequence's own suffix finds an earlier occurrence,
    possibly one that overlaps the suffix.

    Worked example, min_n 1, max_n 3, tokens  a b c d a b c  (positions 0..6, L = 7):
        indexed ends e = 1..6, e.g. (a, b, c) -> 3, (b, c) -> 3, (c,) -> 3, (a,) -> 5, (d, a, b) -> 6
        suffix (a, b, c) -> e = 3: the continuation is tokens[3:7] = d a b c, period L - e = 4;
        with k = 5 it runs past the known tokens by copying itself: d a b c d.
    Overlapping, tokens a a a a (L = 4), max_n 2: (a, a) -> 3 (tokens[1:3]); period 1: a a a ...
    No match, tokens a b c d: no earlier (c, d), (d,) -> nothing proposed.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.last: dict[tuple[int, ...], int] = {}
        self.upto = 0  # ends e < upto are indexed

    def extend(self, tokens: list[int], end: int | None = None) -> None:
        """Index the n-grams that end before `end` (default len(tokens)) and have a token after them."""
        end = len(tokens) if end is None else end
        lo, hi, last = self.min_n, self.max_n, self.last
        for e in range(max(self.upto, lo), end):
            window = tokens[max(0, e - hi):e]
            for n in range(lo, min(hi, e) + 1):
                last[tuple(window[len(window) - n:])] = e
        self.upto = max(self.upto, end)

    def match(self, tokens: list[int]) -> tuple[int, int]:
        """(n, e): the longest suffix length n with an earlier occurrence ending at e; (0, -1) if none.
        Call `extend(tokens)` first."""
        length = len(tokens)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            e = self.last.get(tuple(tokens[length - n:]))
            if e is not None:
                return n, e
        return 0, -1

    @staticmethod
    def continuation(tokens: list[int], e: int, count: int) -> list[int]:
        """`count` tokens copied from position e on; past the end they repeat with period len - e."""
        period = len(tokens) - e
        return [tokens[e + j % period] for j in range(count)]


def cut_at_stop(tokens: list[int], stop_ids: frozenset[int]) -> list[int]:
    """Keep tokens up to and including the first stop token: nothing after it could be emitted."""
    for j, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[: j + 1]
    return tokens


def match_confidence(shares: list[float], m: int) -> list[float]:
    """How likely each token a lookup copies is to be accepted, from the match it follows: token j
    (0-based) continues a match of m + j tokens, and shares[j] is its share of what followed that
    context before (count / (total + 1)). A long match makes any continuation likely, a short one
    only a well-attested one: 1 - (1 - share) x 2 / (m + j). It orders drafts; the policy learns
    what each level of it is worth (`sched/adaptive.py`, `Calibration`).

    Measured (suffix lookups at batch 1, 48 bundled prompts, first drafts): accepted 0.40 after a
    match of 2 tokens, 0.6 after 3-4, 0.85-0.92 after 5 or more; after m = 2, 0.14-0.27 for shares
    below 0.4 and 0.6-0.8 above 0.6; after m >= 6, 0.9-1.0 whatever the share.
    Example: m = 2, share 1/2 (seen once) -> 0.5, 0.67, 0.75 for j = 0, 1, 2; m = 6 -> 0.83."""
    return [1.0 - (1.0 - q) * 2.0 / (m + j) for j, q in enumerate(shares)]


def padded(rows: list[list], width: int, fill, device, dtype=None) -> torch.Tensor:
    """Ragged rows as a [B, width] tensor, each filled out with `fill`."""
    return torch.tensor([r + [fill] * (width - len(r)) for r in rows], dtype=dtype, device=device)


def point_proposal(rows: list[list[int]], device, confidence: list[list[float]] | None = None) -> DraftProposal:
    """Ragged rows of proposed tokens as a deterministic proposal: tokens [B, longest row], padded
    with 0 (never verified), q one-hot, lengths the rows' lengths; `confidence` each row's
    `match_confidence` (padded with NaN)."""
    width = max(len(r) for r in rows)
    tokens = padded(rows, width, 0, device, torch.long)
    conf = padded(confidence, width, float("nan"), device) if confidence is not None and width else None
    return DraftProposal(tokens, None, [len(r) for r in rows], confidence=conf)


class LookupDrafter:
    """What model-free drafters share: each row's proposal is what `find(req, cap)` copies from
    context (a point mass), and there is nothing to learn from what the target accepted.

    Indexes are brought up to date lazily, when a row is looked up, so rounds that look nothing
    up (an adaptive policy's plain rounds) never pay for them. The first lookup after such a
    stretch, or of a new prompt, then does many rounds' indexing at once: `catch_up_s` totals the
    seconds of that beyond the tokens a round adds (1 + its drafts, at most 1 + the row's cap),
    pro rata of tokens, and the shared trie's intake of finished requests. A policy reads it as a
    one-off, not as what drafting costs (`decode/round.py`): counted in, the round that explores
    speculation after 100 plain ones at batch 8 measured 2.5x its predicted time (22 ms of
    indexing), and the guard kept every later round plain."""

    synthetic = False
    device = None
    catch_up_s = 0.0  # seconds of indexing beyond a round's own tokens, in total (see above)
    token_s: float | None = None  # seconds to index one token, measured (see `index_s`)

    def _catch_up(self, extend: Callable[[], None], new: int, normal: int) -> None:
        """Run `extend`, which indexes `new` tokens; the share beyond `normal` counts as catch-up."""
        start = time.perf_counter()
        extend()
        if new > normal:
            spent = time.perf_counter() - start
            self._indexed(spent, new)
            self.catch_up_s += spent * (new - normal) / new

    def _indexed(self, seconds: float, tokens: int) -> None:
        """`tokens` indexed at once took `seconds`: the per-token cost `index_s` prices, an
        exponential average (calls of a few tokens are mostly overhead, and are not timed)."""
        if tokens >= 16:
            rate = seconds / tokens
            self.token_s = rate if self.token_s is None else self.token_s + 0.2 * (rate - self.token_s)

    def unindexed(self, req: Request) -> int:
        """Tokens of `req` its index has not seen (the next lookup indexes them)."""
        raise NotImplementedError

    def shared_unindexed(self) -> int:
        """Tokens waiting for an index every greedy row reads (suffix's shared trie), 0 if none."""
        return 0

    def index_s(self, reqs: list[Request], shares: list[float], intake: float) -> float:
        """Seconds of indexing that looking up `reqs` now would start with. A row's own index is a
        one-off that serves its later lookups too: weighted by `shares[i]`, the share of it one
        round is charged (`AdaptivePolicy.index_shares`). The shared index (suffix's trie of
        finished requests, read by greedy rows) is charged at most `intake` tokens, what finished
        requests bring it per round (`AdaptivePolicy.intake`): whenever it is taken in, every
        finished token is indexed once, so a round that looks up pays only what a lookup every
        round would, not the backlog plain rounds left. 0 until a catch-up was timed.

        Example, suffix (~5 us a token into a trie of depth 20): 32 rows just admitted, 124-token
        prompts, 16 rounds left each: 32 x 124 x 5 us / 16 = 1.2 ms, 5 % of a 25 ms plain round at
        32 rows. (Measured unpriced: lookups ran whenever free drafting might pay, and their
        indexing, prompts and finished requests into the shared trie, took 2-3 % of runs at 32
        rows in which speculation then gained nothing: plain prompts, 64 x 32 tokens.) The shared
        backlog was charged whole, at the rows' mean share: at batch 4 on the bundled prompts a
        stretch of plain rounds let it grow to ~60 ms a round against 12 ms plain rounds, which
        kept every later round plain, so it grew on (in-process, 64 x 32, 3 repeats: the adaptive
        default 0.99-1.01 of `autoregressive` at batch 2, 1.10-1.13 charged the intake, 1.15-1.16
        with `gain_scale`'s longer average too; at batch 4, 0.98-1.00 against 0.97-1.07)."""
        if self.token_s is None:
            return 0.0
        own = sum(self.unindexed(r) * share for r, share in zip(reqs, shares))
        greedy = any(r.params.greedy for r in reqs)  # (who reads the shared index)
        shared = min(self.shared_unindexed(), intake) if greedy else 0.0
        return self.token_s * (own + shared)

    def find(self, req: Request, limit: int) -> tuple[list[int], list[float]]:
        """(tokens proposed for `req`, at most `limit`; each one's `match_confidence`)."""
        raise NotImplementedError

    def propose(self, reqs: list[Request], gamma: int, uniforms: torch.Tensor | None,
                sampling: BatchSampling, lengths: list[int] | None = None) -> DraftProposal:
        caps = lengths if lengths is not None else [gamma] * len(reqs)
        found = [self.find(r, c) if c > 0 else ([], []) for r, c in zip(reqs, caps)]
        return point_proposal([f[0] for f in found], self.device, [f[1] for f in found])

    def observe(self, reqs: list[Request], accepted: list[int]) -> None:
        pass

    def forget(self) -> None:
        pass  # by default a lookup reads the request alone


class NgramDrafter(LookupDrafter):

    def __init__(self, device, min_n: int = MIN_N, max_n: int = MAX_N, k: int = K) -> None:
        self.device, self.min_n, self.max_n, self.k = device, min_n, max_n, k
        self.label = f"ngram:{min_n},{max_n},{k}"
        self._index: dict[int, NgramIndex] = {}  # request id -> its index

    def index(self, req: Request) -> NgramIndex:
        idx = self._index.get(req.index)
        if idx is None:
            idx = self._index[req.index] = NgramIndex(self.min_n, self.max_n)
        return idx

    def find(self, req: Request, limit: int) -> tuple[list[int], list[float]]:
        """(proposed tokens, each one's `match_confidence`) for one request: at most min(k, limit)
        tokens, cut after a stop token; ([], []) without a match. One occurrence says nothing of
        how often the continuation follows: each token counts as once seen (share 1/2)."""
        idx, tokens = self.index(req), req.token_ids
        self._catch_up(lambda: idx.extend(tokens), len(tokens) - idx.upto, limit + 1)
        n, e = idx.match(req.token_ids)
        if n == 0:
            return [], []
        out = cut_at_stop(idx.continuation(req.token_ids, e, min(self.k, limit)), req.stop_ids)
        return out, match_confidence([0.5] * len(out), n)

    def unindexed(self, req: Request) -> int:
        idx = self._index.get(req.index)
        return len(req.token_ids) - (idx.upto if idx is not None else 0)

    def prefill(self, reqs: list[Request], ends: list[int]) -> None:
        for r, e in zip(reqs, ends):  # index the prompt here, outside the decoding rounds
            self.index(r).extend(r.token_ids, e)

    def release(self, req: Request) -> None:
        self._index.pop(req.index, None)
