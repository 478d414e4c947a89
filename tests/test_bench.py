"""The benchmark: JSON schema, honest accounting, the analytic limit, and the transformers peers."""

from __future__ import annotations

import doctest
import json
import math
import statistics
import time

import pytest
import tiny
import torch
from typer.testing import CliRunner

from batchspec import EngineConfig, SamplingParams, SpecEngine, load_pair
from batchspec.bench import Cell, ideal_speedup, markdown_table, plan, run_bench, summarize
from batchspec.bench import report as report_module
from batchspec.bench import runner as runner_module
from batchspec.bench.peers import count_tokens
from batchspec.bench.report import noise_floor, scheduling_table
from batchspec.bench.runner import Run, warmup
from batchspec.cli import app
from batchspec.core import stats as stats_module
from batchspec.core.stats import RunStats, round_gain
from batchspec.harness import check_reference_against_hf, reference_outputs

PROMPTS = ["def add(a, b):", "class Stack:\n    def push(self, item):", "return", "self.items.append("]


@pytest.fixture(scope="module")
def report(tiny_dirs):
    pair = load_pair(tiny_dirs["target"], tiny_dirs["draft"])
    ids = [pair.tokenizer(p)["input_ids"] for p in PROMPTS]
    params = [SamplingParams(max_new_tokens=10)] * len(ids)
    return run_bench(pair, ids, params, methods=["autoregressive", "eqspec", "exspec"], batch_sizes=[1, 2],
                     gammas=[2], drafters=["draft_model", "oracle:0.5"], peers=True, repeat=2,
                     adaptives=[False])  # fixed γ: the step costs and the analytic limit are about it


def test_json_schema(report):
    assert set(report) >= {"machine", "config", "results", "notes"}
    json.dumps(report)  # serialisable
    keys = {"method", "batch_size", "gamma", "tokens_per_s", "speedup", "acceptance_rate", "time_share",
            "ideal_speedup", "efficiency", "speedup_vs_bs1", "peak_memory_mb", "tokens_per_round", "accept_hist",
            "siblings", "siblings_verified", "sibling_hits"}
    ours = [r for r in report["results"] if not r["method"].startswith("hf_")]
    assert {r["method"] for r in ours} == {"autoregressive", "eqspec", "exspec"}
    for r in ours:
        assert keys <= set(r), keys - set(r)
        assert r["repeats"] == 2 and r["tokens_per_s_min"] <= r["tokens_per_s"] <= r["tokens_per_s_max"]
    spec = [r for r in ours if r["method"] != "autoregressive"]
    assert all(r["c"] > 0 and r["v"] > 0 and r["efficiency"] == pytest.approx(r["speedup"] / r["ideal_speedup"])
               for r in spec)
    assert any(r["synthetic"] for r in spec) and any(not r["synthetic"] for r in spec)
    assert "| method |" in markdown_table(report["results"])
    assert all({"round_gain", "round_gain_coverage"} <= set(r["adaptive"]) for r in spec)
    assert "speculative rounds' gain (coverage)" in scheduling_table(report["results"])


def test_round_gain_weighs_speculative_rounds_against_plain_rounds_of_their_batch_size():
    assert doctest.testmod(stats_module).failed == 0  # round_gain's own example
    # speculative rounds at 4 rows made 8 tokens in 0.2 s where plain ones make 8 in 0.1 s: half as fast
    assert round_gain({(4, True): [1, 8, 0.2], (4, False): [2, 8, 0.1]})["round_gain"] == pytest.approx(0.5)
    # no plain round at the speculative rounds' batch size: nothing to weigh them against
    assert round_gain({(4, True): [2, 10, 0.1], (2, False): [5, 10, 0.2]}) == \
        {"round_gain": None, "round_gain_coverage": 0.0}
    assert round_gain({(2, False): [5, 10, 0.2]}) == {"round_gain": None, "round_gain_coverage": None}
    run, step = RunStats(), RunStats()
    run.count_round(4, True, 8, 0.2)
    step.count_round(4, True, 4, 0.1)
    step.count_round(4, False, 4, 0.05)
    run.merge(step)
    assert run.round_time[(4, True)] == [2, 12, pytest.approx(0.3)] and run.round_time[(4, False)] == [1, 4, 0.05]


def test_every_round_is_counted_as_speculative_exactly_when_it_verified_drafts():
    """At one row a round verified drafts iff its row did (gamma_hist): an n-gram drafter that
    finds no match, or a row with one token left, makes a plain round although the drafter ran."""
    p = tiny.pair("llama", None)
    ids = [[5, 6, 7, 8] * 6, [9, 10, 11] * 5, list(range(20, 40))]
    engine = SpecEngine(p, EngineConfig(method="eqspec", batch_size=1, gamma=3, drafter="ngram:1,3", adaptive=False))
    engine.generate(ids, SamplingParams(max_new_tokens=24))
    stats = engine.stats
    kinds = {verified: [sum(c[i] for (_, v), c in stats.round_time.items() if v == verified) for i in range(3)]
             for verified in (False, True)}
    # (a request's first round, which prefills its prompt in the same pass, is no measure of decoding
    # and is left out: one per request at one row, a plain round that emitted one token)
    fused = stats.fused_prefills
    assert fused == len(ids)
    assert kinds[True][0] == sum(n for g, n in stats.gamma_hist.items() if g > 0) > 0
    assert kinds[False][0] == stats.gamma_hist[0] - fused > 0
    assert kinds[True][0] + kinds[False][0] == stats.rounds - fused
    assert kinds[True][1] + kinds[False][1] == stats.emitted - fused
    assert 0 < kinds[True][2] + kinds[False][2] <= stats.wall
    decided = stats.summary()["adaptive"]
    assert decided["round_gain"] > 0 and decided["round_gain_coverage"] == 1.0  # (one row: always comparable)


def test_time_shares_sum_to_one(report):
    for r in report["results"]:
        if r.get("time_share") is not None:
            assert set(r["time_share"]) == {"prefill", "draft", "verify", "align", "other"}
            assert sum(r["time_share"].values()) == pytest.approx(1.0)
            assert all(v >= 0 for v in r["time_share"].values())
            if r["method"] == "autoregressive":
                assert r["time_share"]["draft"] == 0


def test_token_counting_is_identical_across_methods(report):
    """Greedy outputs are identical, so every method (and the peers) must count the same tokens."""
    counts = {r["tokens"] for r in report["results"]}
    assert len(counts) == 1


def paired(row: dict, base: dict) -> float:
    """The median of a row's tokens/s over its baseline's, repeat by repeat."""
    return statistics.median(a / b for a, b in zip(row["tokens_per_s_runs"], base["tokens_per_s_runs"]))


def test_speedups_are_same_run_ratios(report):
    rows = report["results"]
    ar = {r["batch_size"]: r for r in rows if r["method"] == "autoregressive"}
    hf = {r["batch_size"]: r for r in rows if r["method"] == "hf_generate"}
    for r in rows:
        assert len(r["tokens_per_s_runs"]) == 2 and r["tokens_per_s"] == statistics.median(r["tokens_per_s_runs"])
        if r["method"] in ("autoregressive", "eqspec", "exspec"):
            assert r["speedup"] == pytest.approx(paired(r, ar[r["batch_size"]]))
            assert r["speedup_vs_bs1"] == pytest.approx(paired(r, ar[1]))
            assert r["vs_hf_generate"] == pytest.approx(paired(r, hf[r["batch_size"]]))


def test_speedups_pair_the_runs_of_each_repeat():
    """The module doc's example: autoregressive 400 / 300 / 410 tok/s, a cell 420 / 330 / 400 in
    the same repeats: speed-up 1.05, the median of 1.05, 1.10, 0.98 (the medians' ratio: 1.00)."""
    ar, spec = Cell("autoregressive", 8), Cell("eqspec", 8, 4, "draft_model")
    runs = {ar: [Run(400, 1.0, None, 0.0), Run(300, 1.0, None, 0.0), Run(410, 1.0, None, 0.0)],
            spec: [Run(420, 1.0, None, 0.0), Run(330, 1.0, None, 0.0), Run(400, 1.0, None, 0.0)]}
    rows = {r["method"]: r for r in summarize(runs, {}, None)}
    assert rows["eqspec"]["speedup"] == pytest.approx(1.05)
    assert rows["eqspec"]["tokens_per_s"] == 400 and rows["autoregressive"]["speedup"] == 1.0
    runs[ar] = runs[ar][:2]  # no run in every repeat alike: the medians' ratio
    rows = {r["method"]: r for r in summarize(runs, {}, None)}
    assert rows["eqspec"]["speedup"] == pytest.approx(400 / 350)


def test_a_twin_measures_the_noise_floor_and_is_never_a_baseline():
    """`--twin`: a second autoregressive engine at the end of each batch size's cells; every ratio
    still divides by the first, and the twin's own ratio to it is reported as the noise floor."""
    cells, _ = plan(["autoregressive", "eqspec"], [1, 8], [4], ["draft_model"], peers=False, twin=True)
    assert [(c.method, c.batch_size, c.twin) for c in cells] == [
        ("autoregressive", 1, False), ("eqspec", 1, False), ("autoregressive", 1, True),
        ("autoregressive", 8, False), ("eqspec", 8, False), ("autoregressive", 8, True)]
    with pytest.raises(ValueError, match="add autoregressive"):
        plan(["eqspec"], [1], [4], ["draft_model"], peers=False, twin=True)
    ar, twin, spec = Cell("autoregressive", 8), Cell("autoregressive", 8, twin=True), Cell("eqspec", 8, 4)
    runs = {twin: [Run(380, 1.0, None, 0.0), Run(330, 1.0, None, 0.0), Run(400, 1.0, None, 0.0)],  # first:
            ar: [Run(400, 1.0, None, 0.0), Run(300, 1.0, None, 0.0), Run(410, 1.0, None, 0.0)],  # not a baseline
            spec: [Run(420, 1.0, None, 0.0), Run(330, 1.0, None, 0.0), Run(400, 1.0, None, 0.0)]}
    rows = {r["method"]: r for r in summarize(runs, {}, None)}
    assert rows["eqspec"]["speedup"] == pytest.approx(1.05)
    assert rows["eqspec"]["speedup_runs"] == pytest.approx([1.05, 1.10, 400 / 410])
    assert rows["autoregressive"]["speedup"] == 1.0
    assert rows["autoregressive[twin]"]["speedup"] == pytest.approx(400 / 410)  # of 0.95, 1.10, 0.98
    notes = noise_floor(list(rows.values()))
    assert notes == ["noise floor at batch size 8: a second, identical autoregressive engine made 0.98x the first "
                     "(per repeat 0.95-1.10): speed-ups within that of 1.0 do not tell the cells apart"]
    assert doctest.testmod(report_module).failed == 0  # noise_floor's own example


def test_step_pairing_runs_the_engines_in_turn_each_timed_by_its_own_steps(tiny_dirs, monkeypatch):
    """`--pairing steps`: the engines of one batch size take one step each in turn until each is
    done, and a cell's seconds are its own steps' only, so the cells' seconds add up to no more
    than the whole; every engine makes the tokens it makes on its own."""
    pair = load_pair(tiny_dirs["target"], tiny_dirs["draft"])
    ids = [pair.tokenizer(p)["input_ids"] for p in PROMPTS]
    bench = runner_module.Bench(pair, ids, [SamplingParams(max_new_tokens=6)] * len(ids))
    cells = [Cell("autoregressive", 2), Cell("eqspec", 2, 2, "draft_model"), Cell("autoregressive", 2, twin=True)]
    cell_of = {id(bench.engine(c)): c for c in cells}
    log, real_step = [], SpecEngine.step

    def step(engine):
        start = time.perf_counter()
        out = real_step(engine)
        log.append((cell_of[id(engine)], time.perf_counter() - start))
        return out

    monkeypatch.setattr(SpecEngine, "step", step)
    start = time.perf_counter()
    runs = bench.run_together(cells)
    total = time.perf_counter() - start
    order = [c for c, _ in log]
    turns = min(order.count(c) for c in cells)  # until the first is done, every engine in every turn
    assert turns > 2 and order[:3 * turns] == cells * turns
    for c in cells:
        own = sum(t for cc, t in log if cc == c)
        assert 0.8 * own <= runs[c].seconds <= own
    assert sum(runs[c].seconds for c in cells) <= total
    log.clear()
    alone = {c: bench.run(c) for c in cells}
    assert all(runs[c].tokens == alone[c].tokens > 0 for c in cells)
    assert runs[cells[1]].stats["rounds"] == alone[cells[1]].stats["rounds"]


def test_step_pairing_runs_peers_on_their_own_after_our_engines_then_before_them(monkeypatch):
    cells, _ = plan(["autoregressive", "eqspec"], [1, 2], [2], ["draft_model"], peers=True, adaptives=[False])
    calls = []
    bench = runner_module.Bench(None, [[1]], [SamplingParams(max_new_tokens=2)])
    monkeypatch.setattr(runner_module, "warmup", lambda prompts, params, kind: (prompts, params))
    monkeypatch.setattr(bench, "pair", type("P", (), {"target": type("T", (), {"device": torch.device("cpu")})}))
    monkeypatch.setattr(bench, "run", lambda cell, *a: calls.append(cell.label) or Run(1, 1.0, None, 0.0))
    monkeypatch.setattr(bench, "run_together", lambda group: calls.append([c.label for c in group]) or
                        {c: Run(1, 1.0, None, 0.0) for c in group})
    runs = bench.measure(cells, 2, pairing="steps")
    assert all(len(r) == 2 for r in runs.values())
    timed = calls[len(cells):]  # after one warm-up run per cell
    assert timed == [["autoregressive bs=1", "eqspec bs=1 γ=2"], "hf_generate bs=1", "hf_assisted bs=1 γ=2",
                     ["autoregressive bs=2", "eqspec bs=2 γ=2"], "hf_generate bs=2",
                     # the second repeat in reverse: batch size 2 first, its peer before our engines
                     "hf_generate bs=2", ["eqspec bs=2 γ=2", "autoregressive bs=2"],
                     "hf_assisted bs=1 γ=2", "hf_generate bs=1", ["eqspec bs=1 γ=2", "autoregressive bs=1"]]
    calls.clear()
    bench.measure(cells, 1, pairing="runs")
    assert calls[len(cells):] == [c.label for c in cells]
    with pytest.raises(ValueError, match="pairing"):
        bench.measure(cells, 1, pairing="cells")


def test_the_warm_up_runs_the_whole_workload_on_cuda_only():
    """A CPU is warmed by two short prompts; CUDA sets kernels and memory up per shape, so there the
    untimed run is the timed one's workload (prompts and sampling parameters, unchanged)."""
    params = [SamplingParams(max_new_tokens=n, temperature=t) for n, t in ((32, 0.0), (4, 0.7), (16, 1.0))]
    prompts = [[1, 2], [3], [4, 5, 6]]
    assert warmup(prompts, params, "cuda") == (prompts, params)
    cpu_prompts, cpu_params = warmup(prompts, params, "cpu")
    assert cpu_prompts == prompts[:2]
    assert [(p.max_new_tokens, p.temperature) for p in cpu_params] == [(8, 0.0), (4, 0.7)]
    assert doctest.testmod(runner_module).failed == 0


@pytest.mark.slow
def test_peak_memory_is_the_peak_inside_the_block_with_no_thread_beside_it():
    """On Linux the kernel's high water mark, reset on entry: a larger peak before the block does
    not count, one inside it does even once freed, and no sampling thread runs beside the timed code."""
    import threading

    import numpy as np
    import psutil

    from batchspec.bench.machine import PeakMemory

    before = np.ones(400 * 2**20 // 8)  # 400 MB touched, then freed before the block
    del before
    threads = threading.active_count()
    with PeakMemory("cpu") as mem:
        assert threading.active_count() == threads or mem.sampled
        base = psutil.Process().memory_info().rss / 2**20
        inside = np.ones(150 * 2**20 // 8)  # 150 MB touched and freed inside
        del inside
    if mem.sampled:
        pytest.skip("/proc/self/clear_refs cannot be written here: PeakMemory samples instead")
    assert base + 140 < mem.peak_mb < base + 300


def test_peak_memory_samples_where_the_kernel_peak_cannot_be_reset(monkeypatch, tmp_path):
    import threading

    import numpy as np
    import psutil

    from batchspec.bench.machine import PeakMemory

    monkeypatch.setattr(PeakMemory, "CLEAR_REFS", str(tmp_path / "missing" / "clear_refs"))
    threads = threading.active_count()
    with PeakMemory("cpu") as mem:
        assert mem.sampled and threading.active_count() == threads + 1
        base = psutil.Process().memory_info().rss / 2**20
        inside = np.ones(150 * 2**20 // 8)
        time.sleep(0.05)  # (the thread samples every 10 ms)
        del inside
    assert mem.peak_mb > base + 140 and threading.active_count() == threads


def test_cli_twin_without_autoregressive_is_refused_before_any_model_loads(tmp_path):
    result = CliRunner().invoke(app, ["bench", "--methods", "eqspec", "--twin", "--target", str(tmp_path / "none")])
    assert result.exit_code != 0 and "add autoregressive to --methods" in " ".join(result.output.split())


def test_peer_rows(report):
    rows = report["results"]
    assert {r["batch_size"] for r in rows if r["method"] == "hf_generate"} == {1, 2}
    assisted = [r for r in rows if r["method"] == "hf_assisted"]
    assert assisted and all(r["batch_size"] == 1 for r in assisted)
    for r in rows:
        if r["method"] in ("eqspec", "exspec"):
            if r["batch_size"] == 1:
                assert r["vs_hf_assisted"] == pytest.approx(paired(r, assisted[0]))
            else:
                assert r["vs_hf_assisted"] is None
    assert any("batch size 1 only" in n for n in report["notes"])


def test_plan_says_when_assisted_cannot_run():
    cells, notes = plan(["eqspec"], [4, 8], [5], ["draft_model"], peers=True)
    assert not any(c.method == "hf_assisted" for c in cells)
    assert any("not run" in n for n in notes)


def test_peers_without_a_draft_model_run_generate_and_say_why_not_assisted(tiny_dirs):
    """A target alone (a model-free drafter): --peers hf at batch 1 runs transformers' generate and
    leaves assisted generation out with a note, instead of failing for want of an assistant."""
    pair = load_pair(tiny_dirs["target"], None, need_draft=False)
    ids = [pair.tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    report = run_bench(pair, ids, [SamplingParams(max_new_tokens=4)] * 2, methods=["autoregressive", "eqspec"],
                       batch_sizes=[1], gammas=[2], drafters=["ngram"], peers=True, adaptives=[False])
    assert {r["method"] for r in report["results"]} == {"autoregressive", "eqspec", "hf_generate"}
    assert any("needs a draft model" in n for n in report["notes"])


def test_plan_runs_each_draft_window_for_the_speculative_cells_only():
    """--draft-window 128,0: every eqspec cell twice, named apart where the window is not the
    default; autoregressive once."""
    cells, _ = plan(["autoregressive", "eqspec"], [4], [3], ["draft_model"], peers=False,
                    draft_windows=[EngineConfig.draft_window, None])
    assert [c.name for c in cells] == ["autoregressive", "eqspec[adaptive]", "eqspec[adaptive,draft-window=all]"]
    assert [c.draft_window for c in cells[1:]] == [EngineConfig.draft_window, None]


def test_forward_rows_compare_within_their_forward(tiny_dirs):
    """--forward auto,hf: each method twice; a row's speed-up is over autoregressive through the same
    forward, the peers' over our default one, and the step costs are measured per forward."""
    pair = load_pair(tiny_dirs["target"], tiny_dirs["draft"])
    ids = [pair.tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    params = [SamplingParams(max_new_tokens=6)] * len(ids)
    report = run_bench(pair, ids, params, methods=["autoregressive", "eqspec"], batch_sizes=[2], gammas=[2],
                       peers=True, forwards=["auto", "hf"], adaptives=[False])
    rows = {r["method"]: r for r in report["results"]}
    assert set(rows) == {"autoregressive", "autoregressive[hf]", "eqspec", "eqspec[hf]", "hf_generate"}
    for name, base in (("eqspec", "autoregressive"), ("eqspec[hf]", "autoregressive[hf]"),
                       ("hf_generate", "autoregressive")):
        assert rows[name]["speedup"] == pytest.approx(paired(rows[name], rows[base]))
    assert rows["autoregressive[hf]"]["vs_hf_generate"] == pytest.approx(
        paired(rows["autoregressive[hf]"], rows["hf_generate"]))
    assert set(report["config"]["step_costs"]) == {"bs=2,gamma=2,forward=auto", "bs=2,gamma=2,forward=hf"}
    assert "eqspec[hf]" in markdown_table(report["results"])


def test_ideal_speedup_formula():
    # α = 0.5, γ = 2, c = 0.1, v = 1.2: (1 - 0.125) / (0.5 * (0.2 + 1.2)) = 1.25
    assert ideal_speedup(0.5, 2, 0.1, 1.2) == pytest.approx(1.25)
    # α = 0.8, γ = 5, c = 0.2, v = 1.5: (1 - 0.8^6) / (0.2 * 2.5)
    assert ideal_speedup(0.8, 5, 0.2, 1.5) == pytest.approx((1 - 0.262144) / 0.5)
    assert ideal_speedup(1.0, 3, 0.0, 1.0) == pytest.approx(4.0)  # limit α -> 1
    assert math.isclose(ideal_speedup(0.0, 4, 0.25, 1.0), 0.5)


def test_count_tokens_stops_at_eos_and_caps():
    assert count_tokens([5, 6, 2, 7], (2,), 10) == [5, 6, 2]
    assert count_tokens([5, 6, 7, 8], (2,), 3) == [5, 6, 7]


def test_reference_check_against_transformers(tiny_dirs):
    pair = load_pair(tiny_dirs["target"], None, need_draft=False)
    ids = [pair.tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    params = SamplingParams(max_new_tokens=12)
    refs = reference_outputs(pair, ids, params)
    assert check_reference_against_hf(pair, ids, refs, params)["identical"]
    broken = [refs[0][:-1] + [(refs[0][-1] + 1) % pair.vocab_size], refs[1]]
    result = check_reference_against_hf(pair, ids, broken, params)
    assert not result["identical"] and result["exact_match"] == 0.5


@pytest.mark.slow
def test_cli_bench_and_verify(tiny_dirs, tmp_path):
    runner = CliRunner()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    common = ["--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"], "--prompts", str(prompts),
              "--max-new-tokens", "6"]
    out = tmp_path / "bench.json"
    result = runner.invoke(app, ["bench", *common, "--methods", "autoregressive,eqspec", "--batch-sizes", "1,2",
                                 "--gamma", "2", "--peers", "hf", "--twin", "--json", str(out),
                                 "--plots", str(tmp_path / "pl")])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert {r["method"] for r in data["results"]} == {"autoregressive", "eqspec[adaptive]", "hf_generate",
                                                      "hf_assisted", "autoregressive[twin]"}  # adaptive by default
    assert result.output.count("noise floor at batch size") == 2 and data["config"]["twin"]
    assert {p.name for p in (tmp_path / "pl").iterdir()} == {"throughput.png", "speedup.png", "time_share.png",
                                                             "acceptance.png"}
    vout = tmp_path / "verify.json"
    result = runner.invoke(app, ["verify", *common, "--methods", "eqspec,exspec", "--batch-sizes", "1,3",
                                 "--draft-window", "2", "--json", str(vout)])
    assert result.exit_code == 0, result.output
    verified = json.loads(vout.read_text())
    assert verified["config"]["draft_window"] == 2
    rows = verified["results"]
    assert verified["divergence_note"] is None and "note: divergence" not in result.output
    assert all({"method", "batch_size", "num_prompts", "exact_match", "partial_match"} <= set(r) for r in rows)
    assert all(r["exact_match"] == 1.0 and r["partial_match"] == 1.0 for r in rows)
    assert "identical" in result.output
