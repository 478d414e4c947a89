"""Suffix decoding (`--drafter suffix[:depth,k,min_prob,max_tokens]`): propose the most frequent
continuation of the request's newest tokens, counted over its own tokens and over the prompts and
outputs of requests that finished earlier.

Two count tries of depth D (trie.py) serve a row: its own, extended with each appended token
(O(D) per token, from the first round that drafts for it), and a shared one over finished
requests (prompt + output, learned when a request ends normally, not when it is aborted, and
added when a round next reads the trie; at most `max_tokens` tokens, the oldest requests
evicted first). Proposing for a row:

    1. match: the longest suffix of the row's tokens, 2 <= m <= D - s, that has an earlier
       occurrence with a following token in either trie (one token is too weak a match to
       spend a verify column on, as for ngram; s = min(k, γ, SEGMENT) is how deep one walk
       goes below it). In the row's own trie the node of each suffix is at hand (its newest
       windows); the suffix itself is counted there but has no child yet, so only earlier
       occurrences, overlapping ones included, count. In the shared trie each m costs a walk of
       m steps: O(D^2) per row at worst.
    2. continue: from the matched node(s), take the child with the highest count summed over
       both tries (ties: the smaller token id) while the running product of count / total (the
       continuation's empirical probability) stays >= min_prob, at most min(k, γ, 2m) tokens
       (`MATCH_FACTOR`): a continuation seen often, after a long match, is proposed further
       than one that the history disagrees about, or that follows a short match. After s
       tokens the walk is at the tries' depth: the row's tokens and the proposal so far are
       matched again (step 1 over both, by lookups from the root) and the walk goes on, the
       product carried over. It ends where the known tokens end (unlike ngram, which repeats
       a short period). With k 16 and D 20, a row copying text seen before proposes up to 16
       tokens (two walks of 8) from a match of 8 to 12, at the indexing cost of depth 20.

Worked example, depth 6, k 2, γ 2, own tokens  a b c a b c a b d a b  (no shared history):
    longest suffix with an earlier occurrence: (a, b), m = 2 (b d a b, d a b: none)
    after (a, b) came c twice and d once: c, 2/3;  after (a, b, c) came a twice: a, 2/3 x 1
    min_prob 0.5 -> [c, a];  min_prob 0.7 -> nothing

Proposals are point masses, so sampling stays exact. Everything is deterministic: the same
requests finishing in the same order give the same proposals. Only greedy rows read the shared
trie: a sampled row's draws depend on its proposals (not in distribution, but in which sample a
seed gives), so a seeded request drafts from its own tokens alone and samples the same text
whatever other requests did before it.
"""

from __future__ import annotations

from collections import deque

from ..core.request import FinishReason, Request
from .ngram import LookupDrafter, cut_at_stop
from .trie import CountTrie, RequestTrie, SharedTrie

DEPTH, K, MIN_PROB, MAX_TOKENS = 20, 16, 0.25, 1 << 16
MIN_MATCH = 2
MATCH_FACTOR = 2  # a proposal is at most this many times as long as its match
SEGMENT = 8  # tokens one walk goes below a match; a longer proposal matches again (`find`)


def most_frequent_path(at: list[tuple[CountTrie, int]], limit: int, min_prob: float,
                       score: float = 1.0) -> tuple[list[int], float]:
    """Greedy walk down from nodes (trie, node id) of several tries together, counts summed, at
    most `limit` tokens, while the product of count / total (from `score`) stays >= min_prob;
    returns the tokens and the product.

    Example, children {7: 3, 9: 1}, then under 7: {4: 2, 5: 2}, min_prob 0.25:
        7 scores 3/4 = 0.75; then 4 (a tie with 5: the smaller id) 0.75 x 2/4 = 0.375 -> [7, 4, ...]
    """
    out = []
    while len(out) < limit:
        counts: dict[int, int] = {}
        for trie, node in at:
            for child in trie.children(node):
                token = trie.token[child]
                counts[token] = counts.get(token, 0) + trie.count[child]
        if not counts:
            break
        best = min(counts, key=lambda t: (-counts[t], t))
        total = sum(counts.values())
        score *= counts[best] / total
        if score < min_prob:
            break
        out.append(best)
        at = [(trie, child) for trie, node in at if (child := trie.child(node, best)) is not None]
    return out, score


class SuffixDrafter(LookupDrafter):

    def __init__(self, device, depth: int = DEPTH, k: int = K, min_prob: float = MIN_PROB,
                 max_tokens: int = MAX_TOKENS) -> None:
        self.device, self.depth, self.k, self.min_prob = device, depth, k, min_prob
        self.label = f"suffix:{depth},{k},{min_prob:g},{max_tokens}"
        self.max_tokens = max_tokens
        self._tries: dict[int, RequestTrie] = {}  # request id -> its own trie
        self.forget()

    @property
    def shared(self) -> SharedTrie:
        """The trie over finished requests, first brought up to date. Adding a request is the
        costly part of finishing it (O(D) per token), so finished requests wait in `_finished`
        until a round reads the trie: where no round drafts (an adaptive policy running plain
        rounds at a large batch size) it is never paid. The result is the trie eager adding
        gives: the newest requests that fit in max_tokens, added in the order they finished."""
        if self._finished:
            if self._stale:
                self._shared, self._stale = SharedTrie(self.depth, self.max_tokens), False
            while self._finished:
                self._shared.add(self._finished.popleft())
            self._waiting = 0
        return self._shared

    def _learn(self, tokens: list[int]) -> None:
        """Queue a finished request's tokens for the shared trie (see `shared`). The queue holds
        at most max_tokens: a request that cannot fit with the newer ones waiting is one the
        trie would evict anyway, and so would be everything in the trie now."""
        tokens = list(tokens[max(0, len(tokens) - self.max_tokens):]) if self.max_tokens else []
        if not tokens:
            return
        self._finished.append(tokens)
        self._waiting += len(tokens)
        while self._waiting > self.max_tokens:
            self._waiting -= len(self._finished.popleft())
            self._stale = True

    def trie(self, req: Request) -> RequestTrie:
        trie = self._tries.get(req.index)
        if trie is None:
            trie = self._tries[req.index] = RequestTrie(self.depth)
        return trie

    def find(self, req: Request, limit: int) -> list[int]:
        """The proposed tokens for one request; [] without a match."""
        tokens, own = req.token_ids, self.trie(req)
        shared = self.shared if req.params.greedy else None  # a sampled row reads its own tokens only
        own.extend(tokens)
        limit = min(self.k, limit)
        segment = min(limit, SEGMENT)
        longest = min(self.depth - segment, len(tokens))
        shortest = MIN_MATCH - 1  # (exclusive)
        m = next((m for m in range(min(longest, len(own.active)), shortest, -1)
                  if own.kids[own.active[m - 1]] is not None), 0)
        found = None
        for n in range(longest, max(m, shortest), -1) if shared is not None else ():  # longer in the shared trie?
            node = shared.find(tokens[len(tokens) - n:])
            if node is not None and shared.kids[node] is not None:
                m, found = n, node
                break
        if m == 0:
            return []
        if found is None and shared is not None:
            found = shared.find(tokens[len(tokens) - m:])
        at = [(own, own.active[m - 1])]  # (m <= D - 1 and <= len(tokens): the node exists)
        if found is not None:
            at.append((shared, found))
        cap = min(limit, MATCH_FACTOR * m)
        out, score = most_frequent_path(at, min(cap, segment), self.min_prob)
        while out and len(out) < cap and len(out) % segment == 0:  # a whole segment walked: match again
            at = self._rematch(tokens + out, own, shared, longest)
            more, score = most_frequent_path(at, min(cap - len(out), segment), self.min_prob, score)
            if not more:
                break
            out += more
        out = cut_at_stop(out, req.stop_ids)
        return out

    @staticmethod
    def _rematch(tokens: list[int], own: CountTrie, shared: CountTrie | None, longest: int) -> list:
        """The nodes (trie, id) of the longest suffix of `tokens` (MIN_MATCH <= m <= longest) that
        some trie knows a continuation of, in each trie that has it: where a walk of `segment`
        tokens ended, the proposal so far is matched again (O(longest^2) lookups, only for a
        proposal longer than a segment)."""
        for m in range(min(longest, len(tokens)), MIN_MATCH - 1, -1):
            pattern = tokens[len(tokens) - m:]
            at = [(trie, node) for trie in (own, shared) if trie is not None
                  and (node := trie.find(pattern)) is not None and trie.kids[node] is not None]
            if at:
                return at
        return []


    def forget(self) -> None:
        self._shared, self._stale = SharedTrie(self.depth, self.max_tokens), False
        self._finished: deque[list[int]] = deque()
        self._waiting = 0  # tokens in _finished

    def release(self, req: Request) -> None:
        self._tries.pop(req.index, None)
        if req.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):  # not aborted
            self._learn(req.token_ids)
