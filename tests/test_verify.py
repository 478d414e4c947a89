"""The verifiers with per-row draft lengths: row i verifies only its first lengths[i] drafts."""

from __future__ import annotations

import torch

from batchspec.verify import greedy_verify, rejection_verify

V = 8


def one_hot(tokens: list[list[int]]) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).float()


def test_greedy_per_row_lengths():
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    logits = one_hot([[1, 2, 3, 4], [1, 6, 3, 4], [5, 2, 3, 4]])  # the target agrees at every column but two
    res = greedy_verify(logits, drafts, torch.tensor([3, 3, 0]))
    assert res.accepted.tolist() == [3, 1, 0]
    assert [row[: a + 1] for row, a in zip(res.tokens.tolist(), res.accepted.tolist())] == [[1, 2, 3, 4], [1, 6],
                                                                                            [5]]
    res = greedy_verify(logits, drafts, torch.tensor([1, 2, 2]))  # shorter rows stop at their length
    assert res.accepted.tolist() == [1, 1, 0]
    assert res.tokens[0, 1].item() == 2  # the target's own token after d_1: the bonus at position 1


def test_rejection_per_row_lengths_take_the_bonus_at_the_row_length():
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3]])
    p = one_hot([[1, 2, 5, 6], [7, 2, 3, 6]])  # row 0 agrees with d_1, d_2; row 1 rejects d_1
    q = one_hot([[1, 2, 3], [1, 2, 3]])
    u = torch.full((2, 3), 0.5, dtype=torch.float64)
    res = rejection_verify(p, q, drafts, u, torch.full((2,), 0.5, dtype=torch.float64), torch.tensor([2, 3]))
    assert res.accepted.tolist() == [2, 0]
    assert res.tokens[0, 2].item() == 5  # all of row 0's 2 drafts accepted: bonus from p at position 2
    assert res.tokens[1, 0].item() == 7  # row 1: recovered from the residual max(0, p - q) at position 0
    res = rejection_verify(p, q, drafts, u, torch.full((2,), 0.5, dtype=torch.float64), torch.tensor([0, 0]))
    assert res.accepted.tolist() == [0, 0] and res.tokens[:, 0].tolist() == [1, 7]  # γ_i = 0: a plain step
