"""Siblings in a verify pass (which to verify: `sched/siblings.py`): fed after the chain, resolved
into a chain after the pass.

Row i is fed its newest token t, its chain d_1..d_n, then its siblings, each after its depth's
parent: a sibling of d_j has parent column j - 1 (t for j = 1), d_j's position, and sees the row's
committed columns and its ancestors' only (`ModelRunner.feed(..., parents=)`). Every column is
written at the row's own next columns in fed order, as any pass writes them.

After the pass, where the chain's first rejection is at depth a + 1 and a sibling s there equals
the target's token y (the argmax at column a), s is committed in d_{a+1}'s place: its KV column is
copied to column a + 1 (the rejected d_{a+1}'s), its features to column a + 1 of the pass's
hidden states, and the bonus is the argmax at s's column. The round then reads the row as a chain
of a + 1 accepted drafts; nothing downstream knows siblings existed.

Example, chain [7, 4] and siblings 5 (of depth 1) and 9, 3 (of depth 2): fed [t, 7, 4, 5, 9, 3],
parents [-1, 0, 1, 0, 1, 1], positions p + [0, 1, 2, 1, 2, 2]. Argmax [7, 3, 8, 2, 6, 1]: d_1 = 7
accepted, d_2 = 4 rejected for 3; the sibling 3 at column 5 is of depth 2: accepted, KV column 5
copied to column 2, bonus 1 (column 5's argmax). Committed: 7, 3, 1 (t's KV and 7's, then 3's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Siblings:
    """A round's siblings: per row, (depth index j, token) in fed order after its chain."""

    rows: list[list[tuple[int, int]]]

    @classmethod
    def pick(cls, chosen: list[list[tuple[int, int]]], alternatives: torch.Tensor) -> Siblings:
        """From `choose`'s (j, rank) per row and the drafter's runner-ups [B, g, w]."""
        alts = alternatives.tolist()
        return cls([[(j, alts[i][j][k]) for j, k in row] for i, row in enumerate(chosen)])

    def count(self, i: int) -> int:
        return len(self.rows[i])

    def fed(self, i: int) -> list[int]:
        return [token for _, token in self.rows[i]]

    def parents(self, lengths: list[int], leads: list[int]) -> list[list[int] | None]:
        """Per row, the parent column of each fed column (None: a chain, as every row without
        siblings). Columns counted from the row's first fed one (a joining prompt's leads first)."""
        out: list[list[int] | None] = []
        for row, n, lead in zip(self.rows, lengths, leads):
            if not row:
                out.append(None)
                continue
            chain = list(range(-1, lead + n))  # (prompt,) newest and drafts: each after the one before
            out.append(chain + [lead + j for j, _ in row])  # a sibling of d_{j+1}: after column lead + j
        return out

    def resolve(self, rows: list[list[int]], accepted: list[int], lengths: list[int],
                leads: list[int]) -> list[tuple[int, int, int] | None]:
        """rows [B][W]: the argmax at each fed column past the row's leads. Per row, where a sibling
        is taken: (its column, the column it moves to, the bonus token); else None."""
        out: list[tuple[int, int, int] | None] = []
        for i, (row, a, n) in enumerate(zip(self.rows, accepted, lengths)):
            hit = None
            if row and a < n:
                y = rows[i][a]  # the target's token after the accepted drafts
                for k, (j, token) in enumerate(row):
                    if j == a and token == y:
                        col = 1 + n + k
                        hit = (leads[i] + col, leads[i] + a + 1, rows[i][col])
                        break
            out.append(hit)
        return out
