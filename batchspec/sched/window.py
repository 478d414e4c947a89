"""EXSPEC's sliding window: up to W requests resident, refilled as soon as any finishes, and
each round a batch of up to B of them chosen by `pick_batch` from their lengths."""

from __future__ import annotations

from collections import deque

from .grouping import pick_batch


class WindowScheduler:
    def __init__(self, batch_size: int, window: int, sort_by_length: bool = False) -> None:
        if window < batch_size:
            raise ValueError(f"window ({window}) must be >= batch size ({batch_size})")
        self.batch_size, self.window = batch_size, window
        self.sort_by_length = sort_by_length
        self.pending: deque = deque()
        self.resident: list = []
        self.waits: dict[int, int] = {}  # rounds since each resident request last ran
        self._sorted = False

    def add(self, req) -> None:
        self.pending.append(req)
        self._sorted = False

    def has_work(self) -> bool:
        return bool(self.pending or self.resident)

    def schedule(self) -> tuple[list, list]:
        if self.sort_by_length and not self._sorted:
            self.pending = deque(sorted(self.pending, key=lambda r: r.num_tokens))
            self._sorted = True
        admit = []
        while self.pending and len(self.resident) < self.window:
            req = self.pending.popleft()
            admit.append(req)
            self.resident.append(req)
            self.waits[req.index] = 0
        if not self.resident:
            return admit, []
        # target KV length (tokens - 1) is what decides padding
        chosen = pick_batch(
            [r.num_tokens for r in self.resident],
            [self.waits[r.index] for r in self.resident],
            self.batch_size,
            max_wait=2 * -(-len(self.resident) // self.batch_size),
        )
        batch = [self.resident[i] for i in chosen]
        picked = {r.index for r in batch}
        for r in self.resident:
            self.waits[r.index] = 0 if r.index in picked else self.waits[r.index] + 1
        return admit, batch

    def finish(self, req) -> None:
        if req in self.resident:
            self.resident.remove(req)
            self.waits.pop(req.index, None)
        elif req in self.pending:
            self.pending.remove(req)
