"""Which kernel a linear over a few tokens takes (`core/kernels.py`): measured, not hard-coded."""

from __future__ import annotations

import time

import pytest
import torch

from batchspec.core import kernels
from batchspec.core.forward import matmul


@pytest.fixture()
def fresh(monkeypatch, tmp_path):
    monkeypatch.setattr(kernels, "_CHOSEN", {})
    monkeypatch.setenv("BATCHSPEC_CACHE", str(tmp_path))
    return tmp_path


def weights(*shapes):
    return [torch.randn(*shape) for shape in shapes]


def test_the_faster_kernel_is_chosen_per_token_count(fresh):
    """A W @ x^T that wins only at 1 and 2 tokens is taken there and nowhere else."""
    def mm(x, w):
        if x.shape[0] > 2:
            time.sleep(0.002)  # F.linear over these small matrices takes microseconds
        return x.new_empty(x.shape[0], w.shape[0])

    assert kernels.skinny_counts(weights((512, 512), (256, 512)), mm, repeats=2) == {1, 2}
    assert kernels.skinny_counts(weights((512, 512), (256, 512)), lambda x, w: time.sleep(0.002), repeats=2) == {1, 2}
    # (the second call measured nothing: the same shapes, threads and torch were decided above)


def test_every_count_a_verify_pass_feeds_is_timed(fresh):
    """Up to 12 tokens each count is measured (a pass at 4 rows by 2 tokens feeds 8): a W @ x^T that
    loses at 4 and 8 but wins at 5 to 7 is taken at 5 to 7. Above 12 a count follows the next
    measured one (13 to 15 follow 16)."""
    def mm(x, w):
        if x.shape[0] in (4, 8, 9, 10, 11, 12, 24, 32):
            time.sleep(0.002)
        return x.new_empty(x.shape[0], w.shape[0])

    chosen = kernels.skinny_counts(weights((512, 512)), mm, repeats=2)
    assert chosen == {1, 2, 3, 5, 6, 7, 13, 14, 15, 16}


def test_every_matrix_is_timed_not_one_per_shape(fresh):
    """A forward streams all its matrices through the caches; one per shape stays in cache and
    misjudges the kernels (see core/kernels.py). Five matrices of two shapes: all five are timed."""
    seen = set()

    def mm(x, w):
        seen.add(id(w))

    matrices = weights((64, 32), (64, 32), (32, 64), (64, 32), (32, 64))
    kernels.skinny_counts(matrices, mm, repeats=1)
    assert seen == {id(w) for w in matrices}


def test_a_choice_is_kept_on_disk_and_read_back(fresh, monkeypatch):
    calls = []

    def instant(x, w):
        calls.append(1)

    shapes = ((256, 256), (128, 256))
    assert kernels.skinny_counts(weights(*shapes), instant, repeats=2) == frozenset(range(1, 33))
    measured = len(calls)
    files = list((fresh / "kernels").iterdir())
    assert measured > 0 and len(files) == 1
    monkeypatch.setattr(kernels, "_CHOSEN", {})  # a new process on the same machine
    assert kernels.skinny_counts(weights(*shapes), instant, repeats=2) == frozenset(range(1, 33))
    assert len(calls) == measured  # read back, not measured
    files[0].write_text("{not json")  # unreadable: measured again
    monkeypatch.setattr(kernels, "_CHOSEN", {})
    kernels.skinny_counts(weights(*shapes), instant, repeats=2)
    assert len(calls) == 2 * measured


def test_only_float32_on_a_cpu_is_measured(fresh):
    def never(x, w):
        raise AssertionError("not to be measured")

    assert kernels.skinny_counts([torch.randn(8, 8, dtype=torch.float64)], never) == frozenset()
    assert kernels.skinny_counts([torch.randn(8, 8, dtype=torch.bfloat16)], never) == frozenset()
    assert kernels.skinny_counts([], never) == frozenset()


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_matmul_takes_either_kernel_with_the_same_numbers(rows):
    x, w, b = torch.randn(rows, 24), torch.randn(40, 24), torch.randn(40)
    linear = torch.nn.functional.linear(x, w, b)
    for skinny in (frozenset(), frozenset({rows}), frozenset(range(1, 33))):
        torch.testing.assert_close(matmul(x, w, b, skinny), linear)
