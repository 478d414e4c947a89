"""EXSPEC's sliding window: up to W requests resident, refilled as soon as any finishes, and
each round a batch of up to B of them chosen by `pick_batch` from their lengths."""

from __future__ import annotations

from .grouping import pick_batch
from .queue import RequestQueue


class WindowScheduler(RequestQueue):
    def __init__(self, batch_size: int, window: int, sort_by_length: bool = False,
                 refill: str = "continuous") -> None:
        if window < batch_size:
            raise ValueError(f"window ({window}) must be >= batch size ({batch_size})")
        super().__init__(window, sort_by_length, refill)
        self.batch_size, self.window = batch_size, window
        self.waits: dict[int, int] = {}  # rounds since each resident request last ran

    runs_every_resident = False  # a batch is chosen among the prefilled rows of the window

    def on_admit(self, req) -> None:
        self.waits[req.index] = 0

    def next_batch(self) -> list:
        """Up to B prefilled resident requests, chosen by length (see `grouping.pick_batch`)."""
        ready = [r for r in self.resident if r.prefilled]  # still-prefilling rows cannot decode yet
        if not ready:
            return []
        # target KV length (tokens - 1) is what decides padding
        chosen = pick_batch(
            [r.num_tokens for r in ready],
            [self.waits[r.index] for r in ready],
            self.batch_size,
            max_wait=2 * -(-len(ready) // self.batch_size),
        )
        batch = [ready[i] for i in chosen]
        picked = {r.index for r in batch}
        for r in ready:
            self.waits[r.index] = 0 if r.index in picked else self.waits[r.index] + 1
        return batch

    def finish(self, req) -> None:
        super().finish(req)
        self.waits.pop(req.index, None)
