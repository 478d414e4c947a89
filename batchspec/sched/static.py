"""Fixed batches (autoregressive, eqspec): B requests run together until all have finished;
finished rows leave at once, and the next B are admitted only when the batch is empty."""

from __future__ import annotations

from collections import deque


class StaticBatcher:
    def __init__(self, batch_size: int, sort_by_length: bool = False) -> None:
        self.batch_size = batch_size
        self.sort_by_length = sort_by_length
        self.pending: deque = deque()
        self.running: list = []

    def add(self, req) -> None:
        self.pending.append(req)

    def has_work(self) -> bool:
        return bool(self.pending or self.running)

    def schedule(self) -> tuple[list, list]:
        """(requests to admit now, the batch to run this round)."""
        admit = []
        if not self.running and self.pending:
            if self.sort_by_length:
                self.pending = deque(sorted(self.pending, key=lambda r: r.num_tokens))
            while self.pending and len(admit) < self.batch_size:
                admit.append(self.pending.popleft())
            self.running = list(admit)
        return admit, list(self.running)

    def finish(self, req) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.pending:
            self.pending.remove(req)
