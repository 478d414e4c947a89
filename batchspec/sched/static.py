"""Fixed-size batches (autoregressive, eqspec): every prefilled resident request runs each round.

With refill "continuous" a finished row is refilled at the next round boundary; with "none"
the next B requests are admitted only once the whole batch has finished (the founding paper's
EQSPEC), so a batch with one long request runs at batch size 1 until it ends.
"""

from __future__ import annotations

from .queue import RequestQueue


class StaticBatcher(RequestQueue):
    def __init__(self, batch_size: int, sort_by_length: bool = False, refill: str = "continuous") -> None:
        super().__init__(batch_size, sort_by_length, refill)
        self.batch_size = batch_size

    runs_every_resident = True  # (the engine may prefill a request inside a round: `SpecEngine._fusable`)

    @property
    def running(self) -> list:
        return self.resident

    def next_batch(self) -> list:
        """The batch to run this round: every prefilled resident request."""
        return [r for r in self.resident if r.prefilled]
