"""TETRIS selection (sched/tetris.py): pure Python, checked against brute force."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchspec.sched.tetris import best_budget, cumulative, ranking, select

EXAMPLE = [cumulative([0.9, 0.8, 0.5]), cumulative([0.5, 0.5, 0.5])]


def expected(gains, lengths) -> float:
    return sum(sum(row[:n]) for row, n in zip(gains, lengths))


def test_docstring_example():
    assert EXAMPLE[0] == pytest.approx([0.9, 0.72, 0.36])
    assert select(EXAMPLE, 3) == [2, 1]
    assert expected(EXAMPLE, [2, 1]) == pytest.approx(2.12)
    assert select(EXAMPLE, 4) == [3, 1]
    assert select(EXAMPLE, 0) == [0, 0] and select(EXAMPLE, 99) == [3, 3]


def test_ties_take_the_earlier_position_so_only_prefixes_are_taken():
    gains = [[1.0, 1.0, 1.0], [1.0, 1.0]]  # every draft certain: any order of equal gains
    order = [(i, j) for _, i, j in ranking(gains)]
    seen = {0: -1, 1: -1}
    for i, j in order:
        assert j == seen[i] + 1  # each row's positions come in order
        seen[i] = j


rows = st.lists(st.lists(st.floats(0.01, 1.0), min_size=0, max_size=4), min_size=1, max_size=4)


@settings(max_examples=200, deadline=None)
@given(rates=rows, budget=st.integers(0, 10))
def test_select_is_optimal_respects_the_budget_and_takes_prefixes(rates, budget):
    gains = [cumulative(r) for r in rates]
    lengths = select(gains, budget)
    assert sum(lengths) == min(budget, sum(len(g) for g in gains))
    assert all(0 <= n <= len(g) for n, g in zip(lengths, gains))  # a prefix of each row
    best = max(expected(gains, c) for c in itertools.product(*[range(len(g) + 1) for g in gains])
               if sum(c) <= budget)
    assert expected(gains, lengths) == pytest.approx(best)


@settings(max_examples=100, deadline=None)
@given(rates=rows, fixed=st.floats(0.001, 0.05), per_token=st.floats(0.0001, 0.01))
def test_best_budget_is_the_best_rate_of_all_choices(rates, fixed, per_token):
    """With a cost linear in verified tokens (the verify pass once drafting is done), the best
    prefix of the ranking is the best of every possible per-row choice."""
    gains = [cumulative(r) for r in rates]

    def seconds(total, depth_rows):
        return fixed + per_token * total

    lengths, rate = best_budget(gains, seconds, len(gains))
    brute = max((len(gains) + expected(gains, c)) / seconds(sum(c), None)
                for c in itertools.product(*[range(len(g) + 1) for g in gains]))
    assert rate == pytest.approx(brute)
    assert (len(gains) + expected(gains, lengths)) / seconds(sum(lengths), None) == pytest.approx(rate)


def test_best_budget_keeps_the_depth_counts():
    seen = []
    best_budget(EXAMPLE, lambda total, depth_rows: seen.append((total, list(depth_rows))) or 1.0, 2)
    assert seen[:4] == [(0, []), (1, [1]), (2, [1, 1]), (3, [2, 1])]  # 0.9, 0.72 of row 0, then 0.5 of row 1


def test_best_budget_feeds_no_step_for_a_row_a_lookup_drafts():
    """model_rows[i] False: row i's drafts cost no draft step (a lookup has them), so they are
    ranked by gain alone and never counted in fed."""
    seen = []
    best_budget(EXAMPLE, lambda total, fed: seen.append((total, list(fed))) or 1.0, 2, model_rows=[False, True])
    # gains taken 0.9, 0.72 (row 0), 0.5 (row 1), 0.36 (row 0), 0.25 (row 1): only row 1 feeds a step
    assert seen[:6] == [(0, []), (1, [0]), (2, [0, 0]), (3, [1, 0]), (4, [1, 0, 0]), (5, [1, 1, 0])]


def test_among_equal_gains_a_row_no_step_feeds_comes_first():
    """Two rows, one draft each worth 0.5: row 1's lookup drafts it (no model step), row 0 needs a
    draft step (0.5 s). Taken first, row 1's draft pays on its own (2.5 tokens in 1.1 s against 2 in
    1); row 0's first, the step made both drafts look worse than none."""
    def seconds(total, fed):
        return 1 + 0.1 * total + 0.5 * sum(1 for f in fed if f)

    assert best_budget([[0.5], [0.5]], seconds, 2, model_rows=[True, False])[0] == [0, 1]
    assert best_budget([[0.5], [0.5]], seconds, 2, model_rows=[False, True])[0] == [1, 0]


@settings(max_examples=200, deadline=None)
@given(rates=rows, budget=st.integers(0, 10), data=st.data())
def test_held_drafts_are_taken_first_and_the_rest_is_optimal(rates, budget, data):
    """Held drafts (rows whose length must not depend on the batch) are always verified and count
    against the budget; what the budget has left goes to the best of the other drafts."""
    gains = [cumulative(r) for r in rates]
    held = [data.draw(st.integers(0, len(g))) for g in gains]
    lengths = select(gains, budget, held)
    assert all(h <= n <= len(g) for h, n, g in zip(held, lengths, gains))
    assert sum(lengths) == max(sum(held), min(budget, sum(len(g) for g in gains)))
    choices = [c for c in itertools.product(*[range(h, len(g) + 1) for h, g in zip(held, gains)])
               if sum(c) <= max(budget, sum(held))]
    assert expected(gains, lengths) == pytest.approx(max(expected(gains, c) for c in choices))


@settings(max_examples=100, deadline=None)
@given(rates=rows, fixed=st.floats(0.001, 0.05), per_token=st.floats(0.0001, 0.01), data=st.data())
def test_best_budget_with_held_drafts_is_the_best_rate_of_the_choices_that_keep_them(rates, fixed, per_token,
                                                                                    data):
    gains = [cumulative(r) for r in rates]
    held = [data.draw(st.integers(0, len(g))) for g in gains]

    def seconds(total, fed):
        return fixed + per_token * total

    lengths, rate = best_budget(gains, seconds, len(gains), held=held)
    assert all(h <= n for h, n in zip(held, lengths))
    brute = max((len(gains) + expected(gains, c)) / seconds(sum(c), None)
                for c in itertools.product(*[range(h, len(g) + 1) for h, g in zip(held, gains)]))
    assert rate == pytest.approx(brute)


def test_best_budget_docstring_example_with_held_drafts():
    seen = []
    lengths, _ = best_budget(EXAMPLE, lambda total, fed: seen.append((total, list(fed))) or 1.0 + total, 2,
                             held=[0, 3])
    assert seen[:2] == [(3, [1, 1, 1]), (4, [2, 1, 1])]  # the walk starts from row 1's three drafts
    assert lengths[1] == 3


def test_a_draft_worth_nothing_is_never_taken():
    """A round that verifies drafts can be priced below a plain one (by a cost function that says
    so); drafts that add no expected token are still not taken for what the pass is priced at."""
    def seconds(total, fed):
        return 0.010 if total else 0.020  # any speculative round "cheaper" than a plain one

    assert best_budget([[0.0, 0.0], [0.0, 0.0]], seconds, 2.0, [False, False]) == ([0, 0], 100.0)
    lengths, _ = best_budget([[0.5, 0.0], [0.0, 0.0]], seconds, 2.0, [False, False])
    assert lengths == [1, 0]


def rate_of(gains, seconds, base_tokens, lengths, model_rows) -> float:
    """(base_tokens + each row's first lengths[i] gains) / seconds(total, fed), fed[j] the model
    rows verifying more than j drafts: what `best_budget` rates lengths at."""
    fed = [sum(1 for n, m in zip(lengths, model_rows) if m and n > j) for j in range(max(lengths, default=0))]
    return (base_tokens + expected(gains, lengths)) / seconds(sum(lengths), fed)


@settings(max_examples=60, deadline=None)
@given(rates=rows, fixed=st.floats(0.001, 0.05), per_token=st.floats(0.0001, 0.01), data=st.data())
def test_best_budget_rates_its_lengths_as_they_cost(rates, fixed, per_token, data):
    """best_budget's rate is that of its lengths, fed per depth by the model rows only."""
    gains = [cumulative(r) for r in rates]
    model_rows = data.draw(st.lists(st.booleans(), min_size=len(gains), max_size=len(gains)))

    def seconds(total, fed):
        return fixed + per_token * total + 0.003 * sum(1 for f in fed if f)

    lengths, rate = best_budget(gains, seconds, len(gains), model_rows)
    assert rate_of(gains, seconds, len(gains), lengths, model_rows) == pytest.approx(rate)
