"""The bundled default pair: loads through the public API, exact, and a useful drafter."""

from __future__ import annotations

import pytest

from batchspec import EngineConfig, SamplingParams, SpecEngine, load_pair
from batchspec.harness import reference_outputs, run_equivalence
from batchspec.models import default_draft, default_target
from batchspec.prompts import load_prompts

pytestmark = pytest.mark.slow  # the bundled pair's own checks: about a minute


@pytest.fixture(scope="module")
def pair():
    return load_pair()


@pytest.fixture(scope="module")
def prompt_ids(pair):
    return [pair.tokenizer(p)["input_ids"] for p in load_prompts(limit=8)]


def test_defaults_are_the_bundled_pair(pair):
    assert pair.target_name == default_target() and pair.draft_name == default_draft()
    assert pair.tokenizer.pad_token_id not in (None, pair.tokenizer.eos_token_id)
    engine = SpecEngine.from_pretrained()
    out = engine.generate(["def main():\n"], SamplingParams(max_new_tokens=8))[0]
    assert len(out.token_ids) <= 8 and out.text is not None


def test_verify_exact_on_the_bundled_pair(pair, prompt_ids):
    params = SamplingParams(max_new_tokens=32)
    refs = reference_outputs(pair, prompt_ids, params)
    rows = run_equivalence(pair, prompt_ids, ["eqspec"], [1, 8], 5, params, references=refs)
    assert [(r["batch_size"], r["exact_match"]) for r in rows] == [(1, 1.0), (8, 1.0)]


def test_bundled_draft_is_accepted_often(pair):
    """A regression guard on the shipped weights, not a benchmark: the model card's measurement
    (all bundled prompts, 128 new tokens, γ = 5)."""
    engine = SpecEngine(pair, EngineConfig(drafter="draft_model", method="eqspec", batch_size=16, gamma=5,
                                           adaptive=False))
    engine.generate(load_prompts(), SamplingParams(max_new_tokens=128))
    assert engine.stats.accepted / engine.stats.drafted > 0.5
