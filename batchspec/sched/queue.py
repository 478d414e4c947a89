"""The request queue shared by every scheduler: waiting requests, resident ones, admission.

Admission is first come, first served (or shortest first with `sort_by_length`): the head of
the queue waits, and everything behind it, while `can_admit` says there is no room for it.

`refill` decides when rows freed by finished requests are filled:
    "continuous"  at the next round boundary (what a server wants);
    "none"        only when every resident request has finished: the founding paper's fixed
                  batches.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable


def admit_all(req) -> bool:
    return True


class RequestQueue:
    def __init__(self, capacity: int, sort_by_length: bool = False, refill: str = "continuous") -> None:
        self.capacity = capacity  # resident requests at most
        self.sort_by_length = sort_by_length
        self.refill = refill
        self.pending: deque = deque()
        self.resident: list = []
        self._sorted = True

    def add(self, req) -> None:
        self.pending.append(req)
        self._sorted = False

    def __len__(self) -> int:
        return len(self.pending)

    def admit(self, can_admit: Callable[[object], bool] = admit_all) -> list:
        """Move requests from the queue into the resident set while there is room; returns them.
        `can_admit(req)` says whether there is room for it (and takes that room)."""
        if self.sort_by_length and not self._sorted:
            self.pending = deque(sorted(self.pending, key=lambda r: r.num_tokens))
            self._sorted = True
        admitted = []
        if self.refill == "continuous" or not self.resident:
            while self.pending and len(self.resident) < self.capacity and can_admit(self.pending[0]):
                req = self.pending.popleft()  # the head waits while it does not fit, and everyone behind it
                self.resident.append(req)
                admitted.append(req)
                self.on_admit(req)
        return admitted

    def on_admit(self, req) -> None:
        pass

    def next_batch(self) -> list:
        raise NotImplementedError

    def schedule(self, can_admit: Callable[[object], bool] = admit_all) -> tuple[list, list]:
        """(requests admitted now, the batch to run this round)."""
        return self.admit(can_admit), self.next_batch()

    def finish(self, req) -> None:
        """The request left (finished or aborted), wherever it was."""
        for where in (self.resident, self.pending):
            if req in where:
                where.remove(req)
                return
