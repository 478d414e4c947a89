"""Bad input gets a clear error and loses nothing; model pairs are checked before speculating."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from batchspec import EngineConfig, SamplingParams, SpecEngine, load_pair
from batchspec.cli import app

runner = CliRunner()


def test_mismatched_tokenizers_are_refused(tiny_dirs):
    with pytest.raises(ValueError, match="tokenizers differ"):
        load_pair(tiny_dirs["target"], tiny_dirs["other_tokenizer"])


def test_draft_with_padded_embeddings_is_fine(tiny_dirs):
    pair = load_pair(tiny_dirs["target"], tiny_dirs["padded_draft"])
    engine = SpecEngine(pair, EngineConfig(method="eqspec", batch_size=2, gamma=2))
    ref = SpecEngine(pair, EngineConfig(method="autoregressive", batch_size=1))
    sp = SamplingParams(max_new_tokens=8)
    prompts = ["def add(a, b):", "class Stack:\n"]
    assert [o.token_ids for o in engine.generate(prompts, sp)] == [ref.generate([p], sp)[0].token_ids
                                                                   for p in prompts]
    assert all(t < pair.vocab_size for o in engine.generate(prompts, sp) for t in o.token_ids)


def test_pad_token_never_collides(tiny_dirs):
    pair = load_pair(tiny_dirs["target"], tiny_dirs["draft"])
    tok = pair.tokenizer
    assert tok.pad_token_id is not None
    assert tok.pad_token_id != tok.eos_token_id
    assert tok.pad_token_id >= pair.vocab_size  # a new token: no content id can equal it


@pytest.fixture(scope="module")
def engine(tiny_dirs):
    return SpecEngine.from_pretrained(tiny_dirs["target"], tiny_dirs["draft"], EngineConfig(batch_size=2))


def test_empty_prompt(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.generate(["def f():", ""], SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], SamplingParams(max_new_tokens=4))
    assert not engine.has_unfinished()  # nothing was queued


def test_prompt_longer_than_context(engine):
    long_prompt = "x = 1\n" * 200
    with pytest.raises(ValueError, match="longer than the model context"):
        engine.generate(["def f():", long_prompt], SamplingParams(max_new_tokens=4))
    fits = "x = 1\n" * 20
    with pytest.raises(ValueError, match="lower max_new_tokens"):
        engine.generate([fits], SamplingParams(max_new_tokens=120))
    assert not engine.has_unfinished()


@pytest.mark.parametrize("kwargs, message", [
    (dict(gamma=0), "gamma must be"), (dict(batch_size=0), "batch_size must be"),
    (dict(method="beam"), "unknown method"), (dict(method="eqspec", window=4), "window applies"),
    (dict(method="exspec", batch_size=8, window=4), "must be >= batch_size"),
    (dict(draft_window=0), "draft_window must be"), (dict(draft_window=2.5), "draft_window must be"),
])
def test_invalid_engine_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_new_tokens=-1), "max_new_tokens must be"), (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_k=-1), "top_k"),
])
def test_invalid_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_zero_new_tokens_finishes_at_once(engine):
    out = engine.generate(["def f():"], SamplingParams(max_new_tokens=0))[0]
    assert out.token_ids == [] and out.finish_reason == "length"


@pytest.mark.parametrize("args, message", [
    (["--gamma", "0"], "gamma must be"), (["--batch-size", "0"], "batch_size must be"),
    (["--max-new-tokens", "-3"], "max_new_tokens must be"), (["--prompt", ""], "empty"),
    (["--prompt", "x = 1\n" * 200], "longer than the model context"),
])
def test_cli_errors_write_nothing(tiny_dirs, tmp_path, args, message):
    out = tmp_path / "out.jsonl"
    base = ["generate", "--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"], "--output", str(out)]
    if "--prompt" not in args:
        base += ["--prompt", "def f():"]
    result = runner.invoke(app, base + args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not out.exists()


def test_cli_mismatched_tokenizer(tiny_dirs, tmp_path):
    result = runner.invoke(app, ["generate", "--target", tiny_dirs["target"], "--draft", tiny_dirs["other_tokenizer"],
                                 "--prompt", "def f():"])
    assert result.exit_code == 2 and "tokenizers differ" in result.output


def test_cli_generate_writes_jsonl(tiny_dirs, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):"}) + "\n"
                       + json.dumps({"question_id": 7, "category": "code", "turns": ["class Stack:", "more"]}) + "\n")
    out = tmp_path / "out.jsonl"
    result = runner.invoke(app, ["generate", "--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"],
                                 "--prompts", str(prompts), "--max-new-tokens", "6", "--output", str(out),
                                 "--method", "exspec", "--batch-size", "2"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["def add(a, b):", "class Stack:"]
    assert all(set(r) >= {"prompt", "text", "token_ids", "finish_reason"} for r in rows)
    assert all(len(r["token_ids"]) <= 6 for r in rows)
    assert "tokens/s" in result.output and "acceptance" in result.output


def test_random_init_from_config(tiny_dirs):
    """random:<dir> builds the architecture with fresh weights (overhead studies without weights)."""
    pair = load_pair(f"random:{tiny_dirs['target']}", f"random:{tiny_dirs['draft']}")
    trained = load_pair(tiny_dirs["target"], tiny_dirs["draft"])
    assert type(pair.target) is type(trained.target)
    assert not all((a == b).all() for a, b in zip(pair.target.parameters(), trained.target.parameters()))
    engine = SpecEngine(pair, EngineConfig(batch_size=2, gamma=2))
    outs = engine.generate(["def f():"], SamplingParams(max_new_tokens=4))
    assert len(outs[0].token_ids) == 4 or outs[0].finish_reason == "stop"


@pytest.mark.parametrize("args,message", [(["--max-waiting", "-1"], "--max-waiting must be >= 0"),
                                          (["--single-thread-rows", "-1"], "--single-thread-rows must be >= 0")])
def test_cli_serve_refuses_bad_options_before_serving(tiny_dirs, args, message):
    result = runner.invoke(app, ["serve", "--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"], *args])
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_a_target_alone_loads_no_draft_and_the_default_drafter_runs_its_lookup(tiny_dirs):
    from batchspec.models import default_draft

    assert load_pair(tiny_dirs["target"]).draft is None
    assert load_pair().draft_name == default_draft()  # neither given: the bundled pair
    assert load_pair(need_draft=False).draft is None
    engine = SpecEngine.from_pretrained(tiny_dirs["target"], None, EngineConfig(batch_size=2, max_kv_tokens=512))
    assert engine.pair.draft is None and engine.draft_runner is None
    assert engine.drafter.label.startswith("suffix")  # the hybrid's lookup alone
    result = runner.invoke(app, ["generate", "--target", tiny_dirs["target"], "--prompt", "def f():", "--quiet",
                                 "--max-new-tokens", "4"])
    assert result.exit_code == 0 and "eqspec" in result.output, result.output


@pytest.mark.parametrize("args, words", [
    (["--drafter", "draft_model"], ["--draft", "--drafter ngram", "--drafter suffix", "--method autoregressive"]),
    (["--target", "/no/such/model/dir"], ["does not exist", "a .gguf file", "smollm2-135m"]),
    (["--target", "no_such_dir/model.gguf"], ["does not exist"]),
    (["--prompts", "chatty"], ["does not exist", "bundled, chat, grounded"]),
])
def test_cli_model_and_prompt_errors_are_one_line(tiny_dirs, args, words):
    base = ["generate", "--target", tiny_dirs["target"], "--max-new-tokens", "2", "--quiet"]
    if "--prompts" not in args:
        base += ["--prompt", "hi"]
    result = runner.invoke(app, base + args)
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    assert all(w in result.output for w in words), result.output


def test_named_prompt_sets():
    from batchspec.prompts import PROMPT_SETS, load_prompts

    sets = {name: load_prompts(name) for name in PROMPT_SETS}
    assert len(sets["chat"]) == len(sets["grounded"]) == 32
    assert sets["bundled"] == load_prompts()
    assert all(len(p) > 300 and "\n\n" in p for p in sets["grounded"])  # a task, then the text it works on
    assert len(set(sets["chat"])) == 32
