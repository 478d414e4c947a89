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


def padded(rows: list[list], width: int, fill, device, dtype=None) -> torch.Tensor:
    """Ragged rows as a [B, width] tensor, each filled out with `fill`."""
    return torch.tensor([r + [fill] * (width - len(r)) for r in rows], dtype=dtype, device=device)


def point_proposal(rows: list[list[int]], device) -> DraftProposal:
    """Ragged rows of proposed tokens as a deterministic proposal: tokens [B, longest row], padded
    with 0 (never verified), q one-hot, lengths the rows' lengths, every row a lookup's."""
    width = max(len(r) for r in rows)
    return DraftProposal(padded(rows, width, 0, device, torch.long), None, [len(r) for r in rows],
                         looked=[True] * len(rows))


class LookupDrafter:
    """What model-free drafters share: each row's proposal is what `find(req, cap)` copies from
    context (a point mass), drafting costs no model step (`step_probe` None), and there is nothing
    to learn from what the target accepted. `offer` looks every row up before the plan; the next
    `propose` for the same rows and lengths reuses those lookups, each cut to its planned length.
    Indexes are brought up to date lazily, when a row is looked up, so rounds that look nothing
    up (a policy's plain rounds) never pay for them."""

    synthetic = False
    features = None
    sources = (True,)
    confident = False
    runner_ups = 0
    device = None
    _found: tuple[tuple, list[list[int]]] | None = None  # the last offer: (its rows, what it found)

    def step_probe(self, rows: int, context: int):
        return None

    def offer(self, reqs: list[Request], caps: list[int]) -> list[int | None]:
        found = [self.find(r, c) if c > 0 else [] for r, c in zip(reqs, caps)]
        self._found = (_key(reqs), found)
        return [len(f) for f in found]

    def lookups(self, reqs: list[Request], lengths: list[int]) -> list[list[int]]:
        """Each row's proposal at most lengths[i] long: the last offer's, if it was for these rows."""
        found, self._found = self._found, None
        if found is not None and found[0] == _key(reqs):
            return [f[:n] for f, n in zip(found[1], lengths)]
        return [self.find(r, n) if n > 0 else [] for r, n in zip(reqs, lengths)]

    def find(self, req: Request, limit: int) -> list[int]:
        """The tokens proposed for `req`, at most `limit` ([]: no match)."""
        raise NotImplementedError

    def propose(self, reqs: list[Request], lengths: list[int], uniforms: torch.Tensor | None,
                sampling: BatchSampling) -> DraftProposal:
        return point_proposal(self.lookups(reqs, lengths), self.device)

    def observe(self, reqs: list[Request], outcome) -> None:
        pass

    def prefill(self, reqs: list[Request], ends: list[int], hidden=None, counts=None) -> None:
        pass

    def forget(self) -> None:
        pass  # by default a lookup reads the request alone


def _key(reqs: list[Request]) -> tuple:
    """The rows and how long each is: an offer is reused only for the same rows at the same length."""
    return tuple((r.index, r.num_tokens) for r in reqs)


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

    def find(self, req: Request, limit: int) -> list[int]:
        """The proposed tokens for one request: at most min(k, limit), cut after a stop token; []
        without a match."""
        idx = self.index(req)
        idx.extend(req.token_ids)
        n, e = idx.match(req.token_ids)
        if n == 0:
            return []
        return cut_at_stop(idx.continuation(req.token_ids, e, min(self.k, limit)), req.stop_ids)

    def prefill(self, reqs: list[Request], ends: list[int], hidden=None, counts=None) -> None:
        for r, e in zip(reqs, ends):  # index the prompt here, outside the decoding rounds
            self.index(r).extend(r.token_ids, e)

    def release(self, req: Request) -> None:
        self._index.pop(req.index, None)
