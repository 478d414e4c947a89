"""Count tries of bounded depth over token sequences, for the suffix drafter (suffix.py).

Inserting a sequence inserts every window tokens[s : s + D] (shorter at the end) as a path from
the root and adds 1 to each node on it, so a node's count is how often its path occurs as a
substring, and its children are the tokens that followed those occurrences:

    depth 3 over  a b a b c  (windows aba, bab, abc, bc, c):
        a:2 ─ b:2 ─┬─ a:1          the path a b occurs twice; after it came a once and c once
                   └─ c:1
        b:2 ─┬─ a:1 ─ b:1
             └─ c:1
        c:1

Storage: a node is an int id into three parallel lists (its token, its count, its children);
children are None, the only child's id, or a dict token -> id. Ints and dicts of ints are not
tracked by Python's garbage collector, so a trie of a million nodes costs no collection passes
(a node object per trie node made full collections walk them all: several times slower to
build), and about 60 bytes a node. Removed nodes' ids are reused.

Costs: add / remove a sequence O(len x D); extend a request's own trie by one token O(D);
find a path of m tokens O(m). Up to D nodes per token, fewer where text repeats.
"""

from __future__ import annotations

from collections import deque

ROOT = 0


class CountTrie:
    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.token: list[int] = [-1]
        self.count: list[int] = [0]
        self.kids: list[int | dict[int, int] | None] = [None]
        self.free: list[int] = []  # ids of removed nodes

    @property
    def nodes(self) -> int:
        return len(self.token) - len(self.free)

    def child(self, node: int, token: int) -> int | None:
        kids = self.kids[node]
        if kids is None or kids.__class__ is int:
            return kids if kids is not None and self.token[kids] == token else None
        return kids.get(token)

    def children(self, node: int) -> list[int]:
        kids = self.kids[node]
        return [] if kids is None else [kids] if kids.__class__ is int else list(kids.values())

    def advance(self, active: list[int], token: int) -> list[int]:
        """The nodes of the suffixes ending in `token`, lengths 1, 2, ...: the root's child for it
        and the child of each node in `active` (the suffixes before it, lengths 1, 2, ...),
        created where missing, each count raised by one. Adding a sequence or a token is this, once
        per token. Written out in one loop (no call per node), it indexes a token in 5.3 us at
        depth 20 where a call per node took 8.8 (4000 random tokens, the EPYC; 2.9 against 4.7
        on text that repeats itself); with node creation written out too (on novel text most
        suffixes are new: ~15 nodes a token), the 64 bundled prompts index at 3.4-4.7 us a token
        where a call per new node took 6.2-7.9."""
        token_of, count, kids_of, free = self.token, self.count, self.kids, self.free
        out = []
        for node in (ROOT, *active):
            kids = kids_of[node]
            if kids is not None:
                if kids.__class__ is int:
                    if token_of[kids] == token:
                        count[kids] += 1
                        out.append(kids)
                        continue
                    single = kids
                    kids = kids_of[node] = {token_of[single]: single}
                else:
                    child = kids.get(token)
                    if child is not None:
                        count[child] += 1
                        out.append(child)
                        continue
            # a new child, count 1 (a removed node's id first)
            if free:
                child = free.pop()
                token_of[child], count[child], kids_of[child] = token, 1, None
            else:
                child = len(token_of)
                token_of.append(token)
                count.append(1)
                kids_of.append(None)
            if kids is None:
                kids_of[node] = child
            else:
                kids[token] = child
            out.append(child)
        return out

    def add(self, tokens: list[int]) -> None:
        """Every window tokens[s : s + D]: token by token, the suffixes ending there (the windows
        that reach it), at most D long."""
        active, keep = [], self.depth - 1
        for t in tokens:
            active = self.advance(active, t)[:keep]

    def remove(self, tokens: list[int]) -> None:
        """Undo `add(tokens)`; a node whose count drops to 0 goes, with its subtree."""
        for s in range(len(tokens)):
            node = ROOT
            for t in tokens[s:s + self.depth]:
                child = self.child(node, t)
                self.count[child] -= 1
                if self.count[child] == 0:
                    self._unlink(node, t)
                    self._free(child)
                    break
                node = child

    def find(self, pattern: list[int]) -> int | None:
        node = ROOT
        for t in pattern:
            if (node := self.child(node, t)) is None:
                return None
        return node

    def _unlink(self, node: int, token: int) -> None:
        kids = self.kids[node]
        if kids.__class__ is int:
            self.kids[node] = None
        else:
            del kids[token]
            if len(kids) == 1:
                self.kids[node] = next(iter(kids.values()))

    def _free(self, node: int) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(self.children(n))
            self.kids[n] = None
            self.free.append(n)


class RequestTrie(CountTrie):
    """The trie of one growing sequence; `active[m - 1]` is the node of its newest m tokens."""

    def __init__(self, depth: int) -> None:
        super().__init__(depth)
        self.active: list[int] = []  # suffixes of lengths 1 .. D - 1 (longer ones cannot grow)
        self.upto = 0  # tokens [0, upto) are in the trie

    def extend(self, tokens: list[int], end: int | None = None) -> None:
        end = len(tokens) if end is None else end
        advance, keep, active = self.advance, self.depth - 1, self.active
        for t in tokens[self.upto:end]:
            active = advance(active, t)[:keep]
        self.active = active
        self.upto = max(self.upto, end)


class SharedTrie(CountTrie):
    """Finished requests' tokens, at most `max_tokens` of them: the oldest requests go first."""

    def __init__(self, depth: int, max_tokens: int) -> None:
        super().__init__(depth)
        self.max_tokens = max_tokens
        self.sequences: deque[list[int]] = deque()
        self.tokens = 0

    def add(self, tokens: list[int]) -> None:
        """Add a sequence (only its newest max_tokens), evicting the oldest ones to make room."""
        tokens = list(tokens[max(0, len(tokens) - self.max_tokens):]) if self.max_tokens else []
        if not tokens:
            return
        while self.sequences and self.tokens + len(tokens) > self.max_tokens:
            old = self.sequences.popleft()
            self.tokens -= len(old)
            super().remove(old)
        super().add(tokens)
        self.sequences.append(tokens)
        self.tokens += len(tokens)
