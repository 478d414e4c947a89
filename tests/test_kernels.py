"""Which kernel a linear over a few tokens takes (`core/kernels.py`): measured, not hard-coded."""

from __future__ import annotations

import json

import pytest
import torch

from batchspec.core import kernels
from batchspec.core.linear import matmul


class Clock:
    """The clock `kernel_plan` reads while a test runs: it moves only when a fake kernel says so."""
    now = 0.0

    @classmethod
    def perf_counter(cls) -> float:
        return cls.now


@pytest.fixture()
def fresh(monkeypatch, tmp_path):
    monkeypatch.setattr(kernels, "_CHOSEN", {})
    monkeypatch.setattr(kernels, "time", Clock)
    monkeypatch.setenv("BATCHSPEC_CACHE", str(tmp_path))
    return tmp_path


def pads(seconds):
    """The same padding cost at every count."""
    return dict.fromkeys(kernels.COUNTS, seconds)


def weights(*shapes):
    return [torch.randn(*shape) for shape in shapes]


def kernel(seconds):
    """A fake kernel taking `seconds(count)` over each matrix by the test's clock (real kernels over
    these small matrices take microseconds, and a real sleep jitters by more than a plan's margin)."""
    def run(x, w):
        Clock.now += seconds(x.shape[0])
        return x.new_empty(x.shape[0], w.shape[0])
    return run


def test_the_faster_kernel_is_chosen_per_token_count(fresh):
    """A W @ x^T that wins only at 1 and 2 tokens is taken there and nowhere else."""
    mm = kernel(lambda n: 0 if n <= 2 else 0.001 * (2 + n / 8))
    linear = kernel(lambda n: 0.001 * (1 + n / 8))  # more tokens take longer: no count is fed more
    plan = kernels.kernel_plan(weights((512, 512), (256, 512)), mm, linear, packed=None, repeats=2)
    assert plan.mm == {1, 2} and plan.fed[2:] == tuple(range(2, kernels.COUNTS[-1] + 1))
    assert kernels.kernel_plan(weights((512, 512), (256, 512)), linear, mm, packed=None, repeats=2) == plan
    # (the second call measured nothing: the same shapes, threads and torch were decided above)


def test_a_count_both_kernels_run_slowly_is_fed_as_a_larger_one(fresh):
    """Both kernels slow up to 16 tokens, W @ x^T fast at 16 (as the EPYC at 12 against 16): every
    count up to 16 is fed as 16 rows of W @ x^T, the counts above as themselves under F.linear (those
    between ladder counts too: F.linear's time interpolated there is below the next count's)."""
    mm = kernel(lambda n: 0 if n == 16 else 0.001 * (2 + n / 8))
    linear = kernel(lambda n: 0.001 * (1 + n / 8))
    plan = kernels.kernel_plan(weights((512, 512)), mm, linear, packed=None, repeats=2)
    assert plan.fed == (0, *[16] * 16, *range(17, kernels.COUNTS[-1] + 1))
    assert plan.mm == set(range(1, 17))


def test_rows_are_added_only_where_they_pay_for_themselves():
    """`plan_from_times`: 12 is fed as 16 when 16 costs less than 12 by more than adding the rows (at
    16) and the margin (PAD_MARGIN)."""
    def times(at_16):
        seconds = {(n, name): 7.0 for n in kernels.COUNTS for name in ("linear", "mm")}
        seconds[(16, "mm")] = at_16
        return seconds
    assert kernels.plan_from_times(times(5.0), pad_s=pads(0.5)).fed[12] == 16
    assert kernels.plan_from_times(times(6.8), pad_s=pads(0.5)).fed[12] == 12
    assert kernels.plan_from_times(times(6.8), pad_s=pads(0.0)).fed[12] == 12  # 3 % faster: noise, not a kernel
    assert kernels.plan_from_times(times(6.8), pad_s=pads(0.5)).fed[16] == 16
    # 6.0 x 1.05 = 6.3: with adding the rows at 0.5 (6.8) it pays, at 1.0 (7.3) it does not; the cost
    # is the one of the count the rows are added up to (a copy of 16 rows, not of 12)
    assert kernels.plan_from_times(times(6.0), pad_s=pads(0.5)).fed[12] == 16
    assert kernels.plan_from_times(times(6.0), pad_s=pads(1.0)).fed[12] == 12
    assert kernels.plan_from_times(times(6.0), pad_s={**pads(0.5), 16: 1.0}).fed[12] == 12


def test_every_count_a_verify_pass_feeds_is_timed(fresh):
    """Decoding feeds every count from 1 to 32 (4 rows verifying 2 draft tokens: 12): each is timed
    under both kernels, none is inferred from its neighbours; above 32 the ladder's counts are."""
    seen = {"mm": set(), "linear": set()}
    kernels.kernel_plan(weights((64, 32)), lambda x, w: seen["mm"].add(x.shape[0]),
                        lambda x, w: seen["linear"].add(x.shape[0]), packed=None, repeats=1)
    assert seen["mm"] == seen["linear"] == set(range(1, 33)) | set(kernels.LADDER)


def test_a_count_between_ladder_counts_runs_as_the_cheaper_of_the_next_and_itself():
    """`plan_from_times` above 32 (the EPYC's numbers, in ms): W @ x^T at 40 beats F.linear at 36
    as interpolated between 33 and 40, so 36 runs as 40 rows of W @ x^T; where W @ x^T at 40 is
    slow, 36 stays 36 rows under F.linear, untimed but no worse than before the ladder."""
    def times(mm_at_40):
        seconds = {(n, name): 20.0 for n in kernels.COUNTS for name in ("linear", "mm")}
        seconds.update({(32, "linear"): 14.7, (33, "linear"): 14.7, (40, "linear"): 16.5, (32, "mm"): 10.1,
                        (40, "mm"): mm_at_40})
        return seconds
    plan = kernels.plan_from_times(times(12.5), pad_s=pads(0.1))
    assert plan.fed[36] == 40 and 36 in plan.mm
    plan = kernels.plan_from_times(times(16.0), pad_s=pads(0.1))
    assert plan.fed[36] == 36 and 36 not in plan.mm  # 15.7 interpolated against 16.0 x 1.05 + 0.1
    assert plan.fed[32] == 32 and 32 in plan.mm  # a timed count: as timed


def test_f_linear_is_interpolated_from_the_count_after_a_step_not_the_step():
    """A kernel blocked for 32 tokens is slow from 33 on (the EPYC: F.linear 13.7 ms at 33, 13.0 at
    40; W @ x^T 9.1 at 32, 12.7 at 33, 11.4 at 40): the ladder times the count after each step, and
    a count in between is interpolated from there. Interpolated from a fast 32 (11 ms here), 34 to
    39 would run unpadded under F.linear at 11.5-12.8 ms "predicted", 13.5 or so in fact, where 40
    rows of W @ x^T take 12.2."""
    assert {33, 41, 65, 225} <= set(kernels.LADDER) and 257 not in kernels.COUNTS
    seconds = {(n, name): 30.0 for n in kernels.COUNTS for name in ("linear", "mm")}
    seconds.update({(32, "linear"): 11.0, (33, "linear"): 13.7, (40, "linear"): 13.0,
                    (32, "mm"): 9.1, (33, "mm"): 12.7, (40, "mm"): 11.4})
    plan = kernels.plan_from_times(seconds, pad_s=pads(0.2))
    assert all(plan.fed[n] == 40 and n in plan.mm for n in range(34, 40))  # 12.2 against 13.1-13.6
    assert plan.fed[33] == 40 and 33 in plan.mm  # timed: 12.7 as itself, 12.2 as 40 rows


def test_every_matrix_is_timed_not_one_per_shape(fresh):
    """A forward streams all its matrices through the caches; one per shape stays in cache and
    misjudges the kernels (see core/kernels.py). Five matrices of two shapes: all five are timed."""
    seen = set()

    def mm(x, w):
        seen.add(id(w))

    matrices = weights((64, 32), (64, 32), (32, 64), (64, 32), (32, 64))
    kernels.kernel_plan(matrices, mm, packed=None, repeats=1)
    assert seen == {id(w) for w in matrices}


def test_a_choice_is_kept_on_disk_and_read_back(fresh, monkeypatch):
    calls = []

    def instant(x, w):
        calls.append(1)

    shapes = ((256, 256), (128, 256))
    slow = kernel(lambda n: 0.001)
    plan = kernels.kernel_plan(weights(*shapes), instant, slow, packed=None, repeats=2)
    assert plan.mm == set(range(1, kernels.COUNTS[-1] + 1))  # (between ladder counts: padded, W @ x^T)
    measured = len(calls)
    files = list((fresh / "kernels").iterdir())
    assert measured > 0 and len(files) == 1
    monkeypatch.setattr(kernels, "_CHOSEN", {})  # a new process on the same machine
    assert kernels.kernel_plan(weights(*shapes), instant, slow, packed=None, repeats=2) == plan
    assert len(calls) == measured  # read back, not measured
    files[0].write_text("{not json")  # unreadable: measured again
    monkeypatch.setattr(kernels, "_CHOSEN", {})
    kernels.kernel_plan(weights(*shapes), instant, slow, packed=None, repeats=2)
    assert len(calls) == 2 * measured
    files[0].write_text(json.dumps({"fed": [0, 1, 2], "mm": [1]}))  # another version's plan: measured again
    monkeypatch.setattr(kernels, "_CHOSEN", {})
    kernels.kernel_plan(weights(*shapes), instant, slow, packed=None, repeats=2)
    assert len(calls) == 3 * measured


def test_a_packed_kernel_is_taken_where_it_is_fastest(fresh, monkeypatch):
    """A kernel on packed copies of the weights (oneDNN's, `kernels.ONEDNN`) fast from 3 to 32
    tokens: taken there and, with zero rows added, at 1 and 2; W @ x^T above 32. Each timed matrix
    is packed once, and the plan read back from disk keeps the packed kernel's counts."""
    packs = []

    def pack(w):
        packs.append(id(w))
        return w

    dnn = kernels.Packed(pack, kernel(lambda n: 0.001 * (1 + n / 64) if 3 <= n <= 32 else 0.01))
    matrices = weights((64, 32), (32, 64))
    plan = kernels.kernel_plan(matrices, kernel(lambda n: 0.002), kernel(lambda n: 0.003), packed=dnn, repeats=2)
    assert plan.dnn == set(range(1, 33)) and plan.mm == set(range(33, kernels.COUNTS[-1] + 1))
    assert plan.fed[1:5] == (3, 3, 3, 4)
    assert sorted(packs) == sorted(id(w) for w in matrices)
    monkeypatch.setattr(kernels, "_CHOSEN", {})  # a new process on the same machine
    assert kernels.kernel_plan(matrices, kernel(lambda n: 0.002), kernel(lambda n: 0.003), packed=dnn) == plan
    assert len(packs) == 2  # read back, not measured


def test_only_float32_on_a_cpu_is_measured(fresh):
    def never(x, w):
        raise AssertionError("not to be measured")

    linear_only = kernels.Plan.everywhere(mm=False)
    assert kernels.kernel_plan([torch.randn(8, 8, dtype=torch.float64)], never, never) == linear_only
    assert kernels.kernel_plan([torch.randn(8, 8, dtype=torch.bfloat16)], never, never) == linear_only
    assert kernels.kernel_plan([], never, never) == linear_only


@pytest.mark.parametrize("rows", [1, 3, 12, 40, 300])
def test_matmul_takes_either_kernel_over_any_rows_with_the_same_numbers(rows):
    """Either kernel, over x's rows or with zero rows added (up to 256; 300 rows: past any plan),
    gives F.linear's numbers."""
    x, w, b = torch.randn(rows, 24), torch.randn(40, 24), torch.randn(40)
    linear = torch.nn.functional.linear(x, w, b)
    counts = range(kernels.COUNTS[-1] + 1)
    padded = tuple(min(n + 5, kernels.COUNTS[-1]) if n else 0 for n in counts)
    for plan in (kernels.Plan.everywhere(False), kernels.Plan.everywhere(True), kernels.Plan(padded, frozenset()),
                 kernels.Plan(padded, frozenset(counts))):
        out = matmul(x, w, b, plan)
        assert out.shape == linear.shape and out.is_contiguous()
        torch.testing.assert_close(out, linear)


def test_a_large_model_is_measured_within_the_budget_over_a_stride_of_its_matrices(fresh):
    """60 matrices at 10 ms a kernel call (by the test's clock): timed whole, 3 ladder sweeps would
    take 3 x 2 x 68 x 0.6 s; the untimed pass says so and a stride of them is timed, the whole
    measurement inside the budget (plus the pass and one sweep), every count timed."""
    seen = []

    def slow(x, w):
        seen.append(id(w))
        Clock.now += 0.01

    matrices = weights(*[(8, 8)] * 60)
    start = Clock.now
    plan = kernels.kernel_plan(matrices, slow, kernel(lambda n: 0.01), packed=None, repeats=7)
    assert Clock.now - start < kernels.BUDGET_S + 3
    timed = set(seen[60:])  # after the untimed pass over all of them
    strides = [k for k in range(2, 61) if timed == {id(w) for w in matrices[::k]}]
    assert len(strides) == 1, (len(timed), [matrices.index(w) for w in matrices if id(w) in timed])
    assert len(plan.fed) == kernels.COUNTS[-1] + 1


def test_one_sweep_is_always_whole_even_past_the_budget(fresh):
    """A single matrix whose every call takes 1 s: the first sweep (136 calls) runs whole, no second."""
    calls = []

    def slow(x, w):
        calls.append(x.shape[0])
        Clock.now += 1.0

    kernels.kernel_plan(weights((8, 8)), slow, slow, packed=None, repeats=7)
    assert len(calls) == 2 + 2 * len(kernels.COUNTS)  # the untimed pass, then one sweep of both kernels


def test_the_packed_kernel_is_left_out_where_its_copies_would_not_fit(monkeypatch):
    """A second copy of a model's matrices is made only where it takes at most half the memory
    available (else a model that fits once would not fit twice), and never with
    BATCHSPEC_ONEDNN=off; a lean forward planned without it holds no packed copy."""
    if kernels.ONEDNN is None:
        pytest.skip("this torch has no oneDNN linear")
    assert kernels.available_bytes() > 0  # (Linux: MemAvailable)
    monkeypatch.setattr(kernels, "available_bytes", lambda: 1000)
    assert kernels.packed_kernel(500) is kernels.ONEDNN and kernels.packed_kernel(501) is None
    monkeypatch.setattr(kernels, "available_bytes", lambda: None)  # not known: no limit
    assert kernels.packed_kernel(10 ** 12) is kernels.ONEDNN
    monkeypatch.setenv(kernels.ONEDNN_ENV, "off")
    assert kernels.packed_kernel(1) is None
    monkeypatch.delenv(kernels.ONEDNN_ENV)

    from tiny import make_model

    from batchspec.core.forward import LeanForward

    monkeypatch.setattr(kernels, "available_bytes", lambda: 1000)
    lean = LeanForward(make_model("llama", 64, 2, seed=0))
    assert not lean.plan.dnn and all(m.packed is None for layer in lean.layers for m in (layer[1], layer[2]))
