"""batchspec on Ray: a local instance, two workers, the bundled pair.

Ordering, greedy equivalence with one process token for token, seeded sampling independent of
sharding, and a worker that dies mid-job: every prompt still answered exactly once.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # Ray starts processes: a minute or more

from typer.testing import CliRunner  # noqa: E402

from batchspec import EngineConfig, SamplingParams, SpecEngine  # noqa: E402
from batchspec.cli import app  # noqa: E402
from batchspec.prompts import load_prompts  # noqa: E402
from batchspec.ray import BatchSpecPredictor, JobIncomplete, predict, prompt_dataset, served_in_order  # noqa: E402
from batchspec.ray.job import InOrder  # noqa: E402
from batchspec.ray.output import COLUMNS, OutputFile  # noqa: E402
from batchspec.sampling import request_seed  # noqa: E402

NUM_PROMPTS, MAX_NEW = 8, 16
CONFIG = dict(method="eqspec", gamma=3, batch_size=4, drafter="draft_model",
              adaptive=False)  # per-request stats compared exactly (an adaptive plan reads the clock)


class DiesOnce(BatchSpecPredictor):
    """Generates its first batch, then kills its own process before returning it: exactly one
    actor does (the one that creates `marker`), so the block's work is lost and must be retried."""

    def __init__(self, *args, marker: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.marker = marker

    def __call__(self, batch):
        out = super().__call__(batch)
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return out
        os._exit(1)


@pytest.fixture(scope="module")
def local_ray():
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # DiesOnce lives in this test module
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def prompts():
    return load_prompts(limit=NUM_PROMPTS)


@pytest.fixture(scope="module")
def engine():
    return SpecEngine.from_pretrained(config=EngineConfig(**CONFIG))


@pytest.fixture(scope="module")
def greedy(engine, prompts):
    """One process, all prompts in one generate() call."""
    return engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))


def run(prompts, **kwargs):
    ds = predict(prompt_dataset(prompts), workers=2, max_new_tokens=MAX_NEW, **CONFIG, **kwargs)
    return list(served_in_order(ds, len(prompts)))


@pytest.mark.slow
def test_seeded_sampling_does_not_depend_on_sharding(local_ray, prompts, engine, greedy, tmp_path):
    """Through the command line: 2 workers, blocks of 3 rows, Parquet out; the same tokens as one
    process that seeds prompt i with request_seed(seed, i), as `generate --seed` does."""
    import pyarrow.parquet as pq

    path = tmp_path / "out.parquet"
    result = CliRunner().invoke(app, ["generate", "--ray", "local", "--workers", "2", "--cpus-per-worker", "1",
                                      "--rows-per-call", "3", "--num-prompts", str(NUM_PROMPTS), "--batch-size", "4",
                                      "--gamma", "3", "--drafter", "draft_model",
                                      "--max-new-tokens", str(MAX_NEW), "--temperature", "0.8", "--top-p", "0.95",
                                      "--seed", "7", "--output", str(path), "--quiet"])
    assert result.exit_code == 0, result.output
    table = pq.read_table(path).to_pylist()
    assert [r["id"] for r in table] == list(range(NUM_PROMPTS))
    params = [SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8, top_p=0.95, seed=request_seed(7, i))
              for i in range(NUM_PROMPTS)]
    want = engine.generate(prompts, params)
    assert [r["token_ids"] for r in table] == [o.token_ids for o in want]
    assert [r["token_ids"] for r in table] != [o.token_ids for o in greedy]  # it did sample


@pytest.mark.slow
def test_in_order_equal_to_one_process_and_a_dying_worker_is_retried(local_ray, prompts, greedy, tmp_path):
    """Blocks of 3, 3 and 2 rows over two workers, one of which dies after generating its first
    block: every prompt is answered once, in order, with what one process makes of it (tokens,
    text, finish reason and per-request stats alike). (One job for both: each starts two actors
    that load the models, ~15 s on a 2-core machine.)"""
    marker = tmp_path / "died"
    rows = run(prompts, rows=3, predictor=DiesOnce, marker=str(marker))
    assert marker.exists()  # one actor did die, after generating a block it never returned
    assert [r["id"] for r in rows] == list(range(NUM_PROMPTS))  # each prompt once, none lost
    assert [r["prompt"] for r in rows] == prompts
    assert [r["token_ids"] for r in rows] == [o.token_ids for o in greedy]
    assert [r["text"] for r in rows] == [o.text for o in greedy]
    assert [r["finish_reason"] for r in rows] == [o.finish_reason for o in greedy]
    assert [(r["rounds"], r["drafted"], r["accepted"]) for r in rows] == \
        [(o.stats.rounds, o.stats.drafted, o.stats.accepted) for o in greedy]
    assert sum(r["accepted"] for r in rows) > 0


@pytest.mark.slow
def test_an_eagle_head_drafts_on_the_workers_as_in_one_process(local_ray, prompts, greedy, tmp_path):
    """`--drafter eagle:<dir>`: each worker loads the head from its folder, and drafts with it what
    one process drafts (a random head: ragged, mostly rejected drafts), exactly."""
    from batchspec.eagle.formats import save_head
    from batchspec.eagle.head import new_head
    from batchspec.models import load_pair

    save_head(new_head(load_pair(need_draft=False).target, "eagle", seed=3), tmp_path)
    config = {**CONFIG, "drafter": f"eagle:{tmp_path}"}
    want = SpecEngine.from_pretrained(config=EngineConfig(**config)).generate(
        prompts, SamplingParams(max_new_tokens=MAX_NEW))
    ds = predict(prompt_dataset(prompts), workers=2, max_new_tokens=MAX_NEW, rows=4, **config)
    rows = list(served_in_order(ds, len(prompts)))
    assert [r["token_ids"] for r in rows] == [o.token_ids for o in greedy]
    assert [(r["rounds"], r["drafted"], r["accepted"]) for r in rows] == \
        [(o.stats.rounds, o.stats.drafted, o.stats.accepted) for o in want]
    assert sum(r["drafted"] for r in rows) > 0


@pytest.mark.slow
def test_prompts_not_served_are_named(local_ray, prompts):
    """A worker that raises (a prompt too long for max_kv_tokens) fails the job, naming the ids."""
    ds = predict(prompt_dataset(prompts[:2]), workers=1, max_new_tokens=MAX_NEW, max_kv_tokens=8, **CONFIG)
    with pytest.raises(JobIncomplete, match=r"2 prompts could not be served: ids 0, 1"):
        list(served_in_order(ds, 2))


@pytest.mark.parametrize("name", ["out.jsonl", "out.parquet"])
def test_output_file_keeps_the_order_given_and_nothing_on_failure(tmp_path, name):
    import pyarrow.parquet as pq

    rows = [{"id": i, "prompt": f"p{i}", "text": "t", "token_ids": list(range(i)), "finish_reason": "length",
             "prompt_tokens": 2, "rounds": 1, "drafted": 3, "accepted": i, "acceptance_rate": i / 3, "extra": 0}
            for i in range(3)]
    path = tmp_path / name
    with OutputFile(path) as out:
        out.write(rows[:2])
        out.write(rows[2:])
    read = pq.read_table(path).to_pylist() if name.endswith(".parquet") else \
        [json.loads(line) for line in path.read_text().splitlines()]
    assert read == [{k: v for k, v in r.items() if k in COLUMNS} for r in rows]
    path.unlink()
    with pytest.raises(RuntimeError), OutputFile(path) as out:
        out.write(rows)
        raise RuntimeError("the job failed")
    assert list(tmp_path.iterdir()) == []


def test_in_order_release_and_bookkeeping():
    order = InOrder(4)
    assert order.add({"id": 2}) == [] and order.add({"id": 0}) == [{"id": 0}]
    assert order.add({"id": 0}) == []  # a duplicate is not released twice
    assert order.add({"id": 1}) == [{"id": 1}, {"id": 2}]
    assert order.missing() == [3]
    with pytest.raises(JobIncomplete, match=r"ids 3;.*more than once: ids 0"):
        order.check()
    assert order.add({"id": 3}) == [{"id": 3}]
    with pytest.raises(ValueError, match="outside"):
        order.add({"id": 4})


def test_options_checked_before_any_actor_starts(local_ray, prompts):
    with pytest.raises(TypeError, match="unknown BatchSpecPredictor arguments"):
        predict(prompt_dataset(prompts), gama=3)
    with pytest.raises(ValueError, match="gamma"):
        predict(prompt_dataset(prompts), gamma=0)
    result = CliRunner().invoke(app, ["generate", "--workers", "2"])
    assert result.exit_code == 2 and "need --ray" in " ".join(result.output.split())


def test_batchspec_imports_ray_only_for_batchspec_ray():
    code = "import sys, batchspec, batchspec.cli, batchspec.server; assert 'ray' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_clear_error_without_ray(monkeypatch):
    for name in [m for m in sys.modules if m == "batchspec.ray" or m.startswith("batchspec.ray.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'batchspec\[ray\]'"):
        importlib.import_module("batchspec.ray")
