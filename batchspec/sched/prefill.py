"""Chunked prefill: which prompt tokens go into the next prefill forward.

A prefill forward over n rows feeds W columns to every row (the runner's layout is
rectangular: a row with fewer new tokens re-feeds committed ones or is padded), so its cost is
n x W token slots. Given the tokens each prefilling request still needs, in arrival order, the
plan takes the first n requests and a width W with n x W <= budget that feed the most real
tokens; each of them gets min(remaining, W). Later requests wait for the next forward, and a
long prompt is spread over several forwards with decoding rounds in between.

Example, budget 8, remaining [10, 2, 3]:
    n = 1: W = 8, feeds 8;   n = 2: W = 4, feeds 4 + 2 = 6;   n = 3: W = 2, feeds 2 + 2 + 2 = 6
    -> [8, 0, 0]  (the first request's next 8 tokens; the others wait one forward)
"""

from __future__ import annotations


def plan_prefill(remaining: list[int], budget: int) -> list[int]:
    """Tokens to feed each request (0: not in this forward); at least one token overall."""
    if not remaining:
        return []
    if budget < 1 or any(r < 1 for r in remaining):
        raise ValueError("plan_prefill needs a positive budget and requests with tokens left")
    best, best_n, best_w = -1, 1, 1
    longest = 0
    for n in range(1, min(len(remaining), budget) + 1):
        longest = max(longest, remaining[n - 1])
        width = min(budget // n, longest)
        fed = sum(min(r, width) for r in remaining[:n])
        if fed > best:
            best, best_n, best_w = fed, n, width
    return [min(r, best_w) if i < best_n else 0 for i, r in enumerate(remaining)]
