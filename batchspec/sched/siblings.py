"""Siblings: a greedy row's runner-up drafts, verified beside its chain in the same pass.

A drafter that scores every depth (an EAGLE head: its softmax q) knows, besides the draft d_j it
keeps, the tokens it ranked next there. Verified as siblings of d_j (children of d_{j-1}, at d_j's
position, seeing the row's committed tokens, its newest token and d_1..d_{j-1} only:
`decode/siblings.py`), they commit one more token when the chain's first rejection falls at
depth j and the target's token there is one of them: it takes d_j's place, and the target's
token after it (the sibling's own column) is the bonus.

    worth   sibling s at depth j of row i adds  c_i1 ... c_i,j-1 x f q_s  expected tokens: the
            chain reaches depth j (c: the chances the round prices its drafts at), and s is the
            target's token there (q_s: the drafter's probability of s; f: `SiblingRecord.factor`,
            hits over what their q promised, shrunk toward 1: a calibrated drafter's q is its
            chance). s is the target's token only where d_j is not, so nothing is counted twice.
    cost    the pass's extra tokens: the cost table prices a pass by its widest row and the tokens
            it is fed (`CostTable.verify`), siblings included.
    choice  candidates ranked by worth, and the prefix with the most expected tokens per second
            of the round taken (TETRIS's rule, `tetris.py`); none when no prefix beats the chains
            alone. With fixed γ (no cost table) every sibling offered is verified.

Why: on a CPU a pass over a few rows costs far less than a step per token fed (SmolLM2 at one row:
5 tokens 1.19x a plain pass, 9 tokens 1.57x, 17 tokens 1.96x), so at a few rows the round is paid
for by tokens per pass. On SmolLM2's
held-out chat and grounded answers, walking rounds as decoding walks them with the shipped head
at γ = 4: 1.55 tokens per pass with chains alone; with its next 3 tokens at depth 1, 1.77; at
depths 1 and 2, 1.85; at every depth, 1.88.

Greedy rows only: lossless sampling over several candidates needs multi-draft rejection
sampling (SpecInfer's), which is not built; a round with a sampled row verifies chains.

Example, one row, chain d_1 d_2 (chances 0.5, 0.5), siblings q = [0.3, 0.1] at depth 1 and [0.2] at
depth 2; the round costs 10 ms + 0.2 ms a token fed beyond the chain. Worths: 0.3, 0.1, and
0.5 x 0.2 = 0.1. Chains alone: (1 + 0.5 + 0.25) / 10 = 0.175 tokens/ms; + the first:
2.05 / 10.2 = 0.201; + both of worth 0.1: 2.25 / 10.6 = 0.212: all three are verified.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

PRIOR = 8.0  # siblings' worth of q (expected hits) that the factor f starts from, at 1


@dataclass
class SiblingRecord:
    """What verified siblings promised (Σ q of those the chain reached) and what they hit."""

    promised: float = 0.0
    hits: int = 0

    @property
    def factor(self) -> float:
        """f: hits over promised, shrunk toward 1. Example: 3 hits of 10.0 promised -> 11 / 18 = 0.61."""
        return (self.hits + PRIOR) / (self.promised + PRIOR)

    def add(self, promised: float, hits: int) -> None:
        self.promised += promised
        self.hits += hits


def promised(ranks: Sequence[Sequence[tuple[int, int]]], q: Sequence[Sequence[Sequence[float]]],
             accepted: Sequence[int]) -> float:
    """Σ q of the verified siblings (ranks[i]: `choose`'s (j, rank)) that row i's chain reached
    (depth index j <= accepted[i]): what they promised, for `SiblingRecord.add`."""
    return sum(q[i][j][k] for i, (row, a) in enumerate(zip(ranks, accepted)) for j, k in row if j <= a)


def choose(chances: Sequence[Sequence[float]], q: Sequence[Sequence[Sequence[float]]], lengths: Sequence[int],
           seconds: Callable[[list[int]], float], factor: float = 1.0) -> list[list[tuple[int, int]]]:
    """Per row, the siblings to verify: (depth index j, rank k), q[i][j][k] the probability of row
    i's k-th runner-up at draft position j (ranks by descending q), for j < lengths[i];
    chances[i][j] the chance of d_{i,j+1}; seconds(extra) the round's predicted seconds with row i
    fed extra[i] siblings beside its chain."""
    base = 0.0  # expected tokens of the chains alone
    candidates = []
    for i, n in enumerate(lengths):
        reach = 1.0
        base += 1.0
        for j in range(n):
            for k, p in enumerate(q[i][j] if j < len(q[i]) else ()):
                candidates.append((reach * factor * p, i, j, k))
            reach *= chances[i][j]
            base += reach
    if not candidates:
        return [[] for _ in lengths]
    candidates.sort(key=lambda c: (-c[0], c[1], c[2], c[3]))  # (ties: rows, depths, ranks in order)
    extra = [0] * len(lengths)
    best_rate, best, gain = base / seconds(extra), 0, 0.0
    for taken, (worth, i, _, _) in enumerate(candidates, 1):
        extra[i] += 1
        gain += worth
        rate = (base + gain) / seconds(extra)
        if rate > best_rate * (1 + 1e-9):
            best_rate, best = rate, taken
    out: list[list[tuple[int, int]]] = [[] for _ in lengths]
    for _, i, j, k in candidates[:best]:
        out[i].append((j, k))
    return [sorted(row) for row in out]
