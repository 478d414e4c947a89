"""Scheduling: which requests are resident, which form each round's batch, and how prompts are
cut into prefill chunks; and how far each row of a round drafts (`policy.py`, priced by the cost
table of `costs.py`, measured by `profile.py`, ranked by `tetris.py`; judged on recorded rounds
by `replay.py`, and on walks, where its plans move the rows, by `walk.py`).

Pure Python over request lengths and measured seconds; only `profile.py` runs models.
"""

from .grouping import pick_batch
from .prefill import plan_prefill
from .queue import RequestQueue
from .static import StaticBatcher
from .window import WindowScheduler

__all__ = ["RequestQueue", "StaticBatcher", "WindowScheduler", "make_scheduler", "pick_batch", "plan_prefill"]


def make_scheduler(config):
    if config.method == "exspec":
        return WindowScheduler(config.batch_size, config.effective_window, config.sort_by_length, config.refill)
    return StaticBatcher(config.batch_size, config.sort_by_length, config.refill)
