"""Step costs for the analytic speed-up limit, measured at a given batch size and context.

With a one-token target step at batch size B as the unit:
    c = cost of one draft step (one token per row)
    v = cost of one verify step (γ + 1 tokens per row)
and acceptance α, a round emits (1 - α^(γ+1)) / (1 - α) tokens per row for γ·c + v units, so

    ideal_speedup = (1 - α^(γ+1)) / ((1 - α) (γ·c + v)).

Everything a real method loses beyond these costs (alignment, bookkeeping, idle rows) shows as
efficiency = speedup / ideal_speedup < 1.
"""

from __future__ import annotations

from ..core.timing import step_time

__all__ = ["ideal_speedup", "step_costs", "step_time"]


def ideal_speedup(alpha: float, gamma: int, c: float, v: float) -> float:
    tokens = gamma + 1 if alpha >= 1.0 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return tokens / (gamma * c + v)


def step_costs(target, draft, batch: int, context: int, gamma: int, forward: str = "auto") -> dict:
    """{"c": draft step / target step, "v": (γ+1)-token verify / target step, "target_step_s": ...}."""
    t1 = step_time(target, batch, context, 1, forward=forward)
    tv = step_time(target, batch, context, gamma + 1, forward=forward)
    td = step_time(draft, batch, context, 1, forward=forward) if draft is not None else 0.0
    return {"c": td / t1, "v": tv / t1, "target_step_s": t1, "draft_step_s": td, "verify_step_s": tv}
