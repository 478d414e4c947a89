"""Scheduling policy: which requests are resident and which form each round's batch.

Pure Python over request lengths; nothing here touches tensors or models.
"""

from .grouping import pick_batch
from .static import StaticBatcher
from .window import WindowScheduler

__all__ = ["StaticBatcher", "WindowScheduler", "pick_batch", "make_scheduler"]


def make_scheduler(config):
    if config.method == "exspec":
        return WindowScheduler(config.batch_size, config.effective_window, config.sort_by_length)
    return StaticBatcher(config.batch_size, config.sort_by_length)
