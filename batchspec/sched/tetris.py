"""TETRIS: which draft tokens to verify across the whole batch, under a token budget.

Pure Python over estimated acceptance probabilities. Row i's draft d_i1, d_i2, ... is accepted up
to its first rejection, so verifying d_ij adds P(d_i1..d_ij all accepted) = G_ij expected tokens:
the *cumulative* acceptance probability, a product of per-token rates, non-increasing along a row.
Taking the budget's worth of largest G_ij over the flattened batch therefore takes prefixes only
(ties are broken toward the earlier position), and it maximises the expected committed tokens for
that many verified drafts: any other choice of C prefix tokens swaps some G for a smaller one.

Worked example, two rows, cumulative gains
    row 0: [0.9, 0.72, 0.36]      (rates 0.9, 0.8, 0.5)
    row 1: [0.5, 0.25, 0.125]
budget 3 -> 0.9, 0.72, 0.5 -> lengths [2, 1], expected 2.12 accepted drafts (the other splits
of 3: [3, 0] 1.98, [1, 2] 1.65, [0, 3] 0.875); budget 4 adds 0.36 -> [3, 1].

`best_budget` picks the budget itself: the prefix of that ranking with the most expected tokens
per second under a cost function of the per-row lengths (the policy's cost model).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .drain import Additive, Tail


def cumulative(rates: Sequence[float]) -> list[float]:
    """Per-token acceptance rates along a row -> cumulative gains G_j = rates_1 ... rates_j."""
    out, run = [], 1.0
    for r in rates:
        run *= r
        out.append(run)
    return out


def ranking(gains: Sequence[Sequence[float]], cost: Sequence[float] | None = None,
            free: Sequence[bool] | None = None) -> list[tuple[float, int, int]]:
    """Every (gain, row, position) in the order TETRIS takes them: largest gain first (per unit of
    cost[i], row i's price per token, when given), on ties a row no draft step feeds (free[i])
    first, then the earlier position, so every prefix of the ranking is a set of per-row prefixes.
    Gains never grow along a row (cumulative acceptance), so sorting the flattened batch gives that
    order: O(C log C) for C drafts."""
    cost = cost or [1.0] * len(gains)
    free = free or [False] * len(gains)
    flat = [(-g / cost[i], not free[i], j, i) for i, row in enumerate(gains) for j, g in enumerate(row)]
    flat.sort()
    return [(gains[i][j], i, j) for _, _, j, i in flat]


def select(gains: Sequence[Sequence[float]], budget: int, held: Sequence[int] | None = None) -> list[int]:
    """Per-row draft lengths verifying the `budget` drafts of largest cumulative gain. held[i]
    (default 0) drafts of row i are verified whatever their gain and count against the budget
    first; the budget is exceeded only when they alone exceed it."""
    lengths = list(held) if held is not None else [0] * len(gains)
    rest = [row[n:] for row, n in zip(gains, lengths)]
    for _, i, _ in ranking(rest)[:max(0, budget - sum(lengths))]:
        lengths[i] += 1
    return lengths


def best_budget(gains: Sequence[Sequence[float]], seconds: Callable[[int, list[float]], float],
                base_tokens: float, model_rows: Sequence[bool] | None = None,
                held: Sequence[int] | None = None, tail: Tail | None = None) -> tuple[list[int], float]:
    """The prefix of the ranking with the most (base_tokens + Σ gains) / seconds, where base_tokens
    is what the round commits with no draft verified (one token per row; with `tail`, a draining
    batch's, what the round takes off the job's rest instead: `drain.py`) and seconds(total, fed)
    the round's cost for `total` drafts verified, fed[j] being the rows a model's draft step feeds
    at depth j (model_rows[i], default True: row i is drafted by a model step; False: a lookup
    drafts it, at no step, so fed[j] may be 0 and no step runs there). Kept up to date as the
    ranking is walked, so a cost is O(γ), not O(rows); on ties a lookup row comes first. held[i]
    (default 0): the first held[i] drafts of row i are taken before the walk, whatever they are
    worth (rows whose length must not depend on the batch); the walk ranks what follows them.
    Returns (lengths, tokens per second).

    Example: gains [[0.9, 0.72, 0.36], [0.5, 0.25, 0.125]], held [0, 3]: the walk starts from
    row 1's three drafts (0.875 expected tokens, fed [1, 1, 1], 3 verified) and ranks only row 0's
    0.9, 0.72, 0.36; the result is [k, 3] for the k with the best rate."""
    lengths = list(held) if held is not None else [0] * len(gains)
    model = list(model_rows) if model_rows is not None else [True] * len(gains)
    fed: list[float] = []

    def take(i: int, j: int) -> float:  # row i verifies its draft j: the step at depth j feeds it; its gain
        if j == len(fed):
            fed.append(0)
        fed[j] += model[i]
        return gains[i][j]

    value = tail or Additive(base_tokens)
    tokens = value.start([[take(i, j) for j in range(n)] for i, n in enumerate(lengths)])
    start = sum(lengths)
    order = ranking([row[n:] for row, n in zip(gains, lengths)], None, [not m for m in model])
    best_total, best_rate = 0, tokens / seconds(start, fed)
    for total, (_, i, j) in enumerate(order, start=1):
        gain = take(i, j + lengths[i])
        if gain <= 0:  # (all that follows is worth nothing too)
            break
        tokens = value.add(i, gain)
        rate = tokens / seconds(start + total, fed)
        if rate > best_rate:
            best_total, best_rate = total, rate
    for _, i, _ in order[:best_total]:
        lengths[i] += 1
    return lengths, best_rate


def rate_of(gains: Sequence[Sequence[float]], seconds: Callable[[int, list[float]], float], base_tokens: float,
            lengths: Sequence[int], model_rows: Sequence[bool] | None = None, tail: Tail | None = None) -> float:
    """What `best_budget` rates `lengths` at: (base_tokens + each row's first lengths[i] gains) /
    seconds(total, fed), fed[j] the model rows verifying more than j drafts (`tail`: as there).

    Example: gains [[0.9, 0.72], [0.5]], lengths [2, 1], seconds = 1 + total / 10: (2 + 0.9 +
    0.72 + 0.5) / 1.3 = 3.17."""
    model = model_rows if model_rows is not None else [True] * len(gains)
    fed = [sum(1 for n, m in zip(lengths, model) if m and n > j) for j in range(max(lengths, default=0))]
    tokens = (tail or Additive(base_tokens)).start([g[:n] for g, n in zip(gains, lengths)])
    return tokens / seconds(sum(lengths), fed)
