"""Row slots of the KV buffer: which row each resident request owns, and when to move rows.

Pure Python. A request takes the lowest free row when it is admitted and frees it when it ends.
A forward runs over the contiguous slot range that holds its batch; rows in that range that are
not in the batch are computed for nothing. `arrange` says which rows to move so that the range
stays tight: only batch rows outside the first b slots move, into the lowest slots that hold no
batch row (swapping with a resident row that is not in the batch, which then moves out).

Example, b = 2, batch rows at slots 1 and 6, slot 0 free, slots 2..5 resident:
    range [1, 7) holds 6 rows for a batch of 2 -> too loose
    slot 6 moves to slot 0 (free): moves [(6, 0)], range [0, 2)
"""

from __future__ import annotations

import heapq


def slack(b: int) -> int:
    """Idle rows a range may hold for a batch of b rows before rows are moved (or, for a
    prefill, gathered): a quarter of the batch, at least one."""
    return max(1, b // 4)


def is_tight(slots: list[int]) -> bool:
    return max(slots) - min(slots) + 1 <= len(slots) + slack(len(slots))


class SlotTable:
    def __init__(self, rows: int) -> None:
        self.rows = rows
        self._free = list(range(rows))
        heapq.heapify(self._free)

    def take(self) -> int:
        if not self._free:
            raise RuntimeError("no free row slot; the scheduler admitted more requests than there are rows")
        return heapq.heappop(self._free)

    def give(self, slot: int) -> None:
        heapq.heappush(self._free, slot)

    @property
    def free(self) -> int:
        return len(self._free)

    def moved(self, pairs: list[tuple[int, int]]) -> None:
        """Rows were copied src -> dst (see `arrange`): a free dst is now taken, and its src freed."""
        for src, dst in pairs:
            if dst in self._free:
                self._free.remove(dst)
                self._free.append(src)
        heapq.heapify(self._free)


def arrange(batch: list[int], resident: set[int]) -> list[tuple[int, int]]:
    """(src, dst) row copies, applied at once, that put a loose batch into slots [0, b).

    `batch` are the batch's slots, `resident` the slots of all resident requests (batch included).
    A swap with a resident row that is not in the batch appears as two pairs, (src, dst) and (dst, src).
    """
    if is_tight(batch):
        return []
    b = len(batch)
    inside = set(batch)
    outside = sorted(s for s in batch if s >= b)
    targets = [s for s in range(b) if s not in inside]
    pairs = []
    for src, dst in zip(outside, targets):
        pairs.append((src, dst))
        if dst in resident:
            pairs.append((dst, src))
    return pairs
