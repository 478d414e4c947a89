"""The command line: options derived once from dataclasses, --help in 80 columns, verify's report."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

import pytest
import typer
from typer.testing import CliRunner

from batchspec.cli import app
from batchspec.cli.options import dataclass_options, derive, field_docs, grid_default
from batchspec.config import EngineConfig

runner = CliRunner()
COMMANDS = ("generate", "verify", "bench", "serve", "loadtest")
PROMPTS = ["def add(a, b):", "class Stack:", "    def push(self, item):"]


def command(name: str):
    return typer.main.get_command(app).commands[name]


def params(name: str) -> dict:
    return {p.name: p for p in command(name).params}


def cli_fields() -> list[str]:
    return [f.name for f in dataclasses.fields(EngineConfig) if f.metadata.get("cli", True) is not False]


@pytest.mark.parametrize("name, left_out", [("generate", {"profile"}), ("serve", {"profile", "sort_by_length"}),
                                            ("verify", {"profile", "method", "batch_size"})])
def test_engine_options_take_engine_config_defaults(name, left_out):
    """Every engine option a command takes is EngineConfig's field, with its default (draft_window's
    None is spelled 0); none is missing but those the command leaves out on purpose."""
    taken = params(name)
    for f in dataclasses.fields(EngineConfig):
        if f.name not in cli_fields() or f.name in left_out:
            assert f.name not in taken or name == "verify", f.name  # verify's method/batch_size are lists
            continue
        assert taken[f.name].default == f.default, (name, f.name)
        assert f"--{f.name.replace('_', '-')}" in taken[f.name].opts


def test_bench_grid_defaults_are_engine_config_defaults():
    taken = params("bench")
    for name in ("gamma", "drafter", "adaptive", "forward", "refill", "budget", "draft_window"):
        assert taken[name].default == grid_default(getattr(EngineConfig, name)), name
    for name in ("sort_by_length", "max_kv_tokens", "max_prefill_tokens", "profile"):
        assert taken[name].default == getattr(EngineConfig, name), name
    assert taken["drafter"].opts == ["--drafters"] and taken["method"].opts == ["--methods"]


@pytest.mark.parametrize("name", ["generate", "serve"])
def test_no_engine_option_given_builds_engine_config_defaults(monkeypatch, name):
    """generate once hard-coded eqspec and batch 8 where serve took EngineConfig's: both now build
    exactly EngineConfig() when given no engine option."""
    seen = []

    def load_engine(target, draft, config, dtype, device):
        seen.append(config)
        raise ValueError("stop here")

    monkeypatch.setattr(f"batchspec.cli.{name}.load_engine", load_engine)
    result = runner.invoke(app, [name] + (["--prompt", "x"] if name == "generate" else ["--no-engine-process"]))
    assert result.exit_code == 2 and "error: stop here" in result.output, result.output
    assert seen == [EngineConfig()]


@dataclass(frozen=True)
class Toy:
    """A server's settings, as another frozen dataclass would declare them.

    port        where to listen,
                any free port.
    host        address to bind.
    """

    port: int = 8000
    host: str = field(default="127.0.0.1", metadata={"help": "Bind here", "panel": "Server"})
    verbose: bool = False
    cache: bool = True
    window: int | None = field(default=64, metadata={"none_as": 0})


def test_any_frozen_dataclass_derives_options_the_same_way():
    assert field_docs(Toy) == {"port": "where to listen, any free port.", "host": "address to bind."}
    options = {o.field: o for o in dataclass_options(Toy, panel="Toy")}
    assert options["port"].flags == ("--port",) and options["cache"].flags == ("--cache/--no-cache",)
    assert options["host"].panel == "Server" and options["port"].panel == "Toy"
    toy = typer.Typer()
    built = []

    @toy.command()
    @derive(options.values(), into="settings")
    def run(settings: dict | None = None):
        built.append(Toy(**settings))

    assert runner.invoke(toy, []).exit_code == 0 and built[-1] == Toy()
    result = runner.invoke(toy, ["--port", "9", "--host", "h", "--verbose", "--no-cache", "--window", "0"])
    assert result.exit_code == 0, result.output
    assert built[-1] == Toy(port=9, host="h", verbose=True, cache=False, window=None)
    help_text = runner.invoke(toy, ["--help"], env={"COLUMNS": "80"}).output
    assert "where to listen, any free port." in " ".join(help_text.replace("│", " ").split())
    with pytest.raises(ValueError, match="has no field nope"):
        dataclass_options(Toy, include=("nope",))


ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.mark.parametrize("name", ("",) + COMMANDS)
def test_help_fits_80_columns_without_truncation(name):
    result = runner.invoke(app, ([name] if name else []) + ["--help"], env={"COLUMNS": "80", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    text = ANSI.sub("", result.output)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "…" not in text  # rich's mark of a cell cut short
    words = set(re.findall(r"--[\w-]+", text))
    for p in (command(name).params if name else []):
        if not getattr(p, "hidden", False):
            assert set(p.opts + p.secondary_opts) <= words | {"-h"}, p.opts  # each flag shown whole


def test_engine_options_sit_in_their_panels():
    text = ANSI.sub("", runner.invoke(app, ["generate", "--help"], env={"COLUMNS": "80", "NO_COLOR": "1"}).output)
    panels = re.findall(r"╭─ (\w+) ─", text)
    assert panels == ["Options", "Engine", "Sampling", "Ray", "Expert"]
    expert = text[text.index("╭─ Expert"):]
    for flag in ("--forward", "--refill", "--max-kv-tokens", "--max-prefill-tokens", "--debug"):
        assert flag in expert
    bench = ANSI.sub("", runner.invoke(app, ["bench", "--help"], env={"COLUMNS": "80", "NO_COLOR": "1"}).output)
    benchmark = bench[bench.index("╭─ Benchmark"):bench.index("╭─ Sampling")]
    for flag in ("--pairing", "--twin", "--profile", "--prompt-tokens"):
        assert flag in benchmark


def test_errors_are_one_line_with_exit_2():
    for args, message in ((["generate", "--method", "nope", "--prompt", "x"], "unknown method 'nope'"),
                          (["bench", "--batch-sizes", "1,x"], "--batch-sizes must be a comma-separated list"),
                          (["verify", "--methods", ","], "--methods is empty")):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, result.output
        assert result.output.strip().startswith(f"error: {message}") and result.output.strip().count("\n") == 0


@pytest.mark.slow  # a fresh interpreter imports everything
def test_python_dash_m_runs_the_same_app():
    out = subprocess.run([sys.executable, "-m", "batchspec", "--help"], capture_output=True, text=True, check=True)
    assert "verify" in out.stdout and "loadtest" in out.stdout


@pytest.fixture(scope="module")
def chat_dirs(tiny_dirs, tmp_path_factory):
    """The tiny target and draft with a chat template, and a short prompt file."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("chat")
    dirs = {}
    for name in ("target", "draft"):
        dirs[name] = str(shutil.copytree(tiny_dirs[name], root / name))
        tok = AutoTokenizer.from_pretrained(dirs[name])
        tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                             "{% if add_generation_prompt %}assistant:{% endif %}")
        tok.save_pretrained(dirs[name])
    dirs["prompts"] = str(root / "p.jsonl")
    (root / "p.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return dirs


def test_verify_chat_reports_dtype_and_drafts(chat_dirs, tiny_dirs, tmp_path):
    out = tmp_path / "v.json"
    base = ["verify", "--draft", chat_dirs["draft"], "--prompts", chat_dirs["prompts"], "--max-new-tokens", "6",
            "--methods", "autoregressive,eqspec", "--batch-sizes", "1,2", "--gamma", "2", "--drafter",
            "draft_model", "--no-adaptive", "--hf-check", "1", "--chat"]
    result = runner.invoke(app, base + ["--target", tiny_dirs["target"]])  # its tokenizer has no template
    assert result.exit_code == 2 and "no chat template" in result.output, result.output
    result = runner.invoke(app, base + ["--target", chat_dirs["target"], "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["config"]["dtype"] == "float32" and report["config"]["chat"] is True  # not "auto"
    assert report["reference_check"]["identical"]
    rows = report["results"]
    assert all(r["exact_match"] == 1.0 for r in rows)
    for r in rows:
        if r["method"] == "autoregressive":
            assert r["drafted"] == 0 and r["accepted"] == 0
        else:
            assert r["drafted"] > 0 and 0 <= r["accepted"] <= r["drafted"]
            assert r["acceptance_rate"] == pytest.approx(r["accepted"] / r["drafted"])
    eqspec = next(r for r in rows if r["method"] == "eqspec")
    assert re.search(rf"│ eqspec +│ +1 │ +2 │ +1\.000 │ +1\.000 │ +{eqspec['accepted']}/{eqspec['drafted']} │",
                     result.output), result.output  # the table's cell, in 80 columns


def test_bench_chat(chat_dirs, tmp_path):
    out = tmp_path / "b.json"
    result = runner.invoke(app, ["bench", "--target", chat_dirs["target"], "--prompts", chat_dirs["prompts"],
                                 "--methods", "autoregressive", "--batch-sizes", "1", "--max-new-tokens", "4",
                                 "--chat", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["config"]["chat"] is True


def test_serve_keeps_max_batch_size_as_a_hidden_alias(monkeypatch):
    seen = []

    def load_engine(target, draft, config, dtype, device):
        seen.append(config)
        raise ValueError("stop here")

    monkeypatch.setattr("batchspec.cli.serve.load_engine", load_engine)
    assert runner.invoke(app, ["serve", "--no-engine-process", "--max-batch-size", "3"]).exit_code == 2
    assert seen[-1].batch_size == 3
    assert "--max-batch-size" in params("serve")["max_batch_size"].opts and params("serve")["max_batch_size"].hidden


def test_derived_groups_stack_on_one_command():
    """serve can take EngineConfig's options and a server dataclass's alike, each into its own dict."""
    toy = typer.Typer()
    built = []

    @toy.command()
    @derive(dataclass_options(Toy, panel="Server"), into="server")
    @derive(dataclass_options(EngineConfig, include=("gamma", "adaptive")), into="engine")
    def run(name: str = "x", engine: dict | None = None, server: dict | None = None):
        built.append((name, EngineConfig(**engine), Toy(**server)))

    result = runner.invoke(toy, ["--gamma", "3", "--no-adaptive", "--port", "1", "--name", "y"])
    assert result.exit_code == 0, result.output
    assert built == [("y", EngineConfig(gamma=3, adaptive=False), Toy(port=1))]


def test_trace_records_and_replays_a_walk(tiny_dirs, tmp_path):
    """`trace record --walk` writes a walk; `trace replay` reads it beside a trace, a row per view."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    base = ["trace", "record", "--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"], "--prompts",
            str(prompts), "--num-prompts", "4", "--max-new-tokens", "6", "--batch-size", "2", "--gamma", "2",
            "--drafter", "draft_model"]
    walk, trace = tmp_path / "w.json", tmp_path / "t.json"
    for args in (base + ["--walk", "--out", str(walk)], base + ["--out", str(trace)]):
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
    assert json.loads(walk.read_text())["kind"] == "walk"
    result = runner.invoke(app, ["trace", "replay", str(walk), str(trace)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "w as model" in result.output and "│ t " in result.output
    (tmp_path / "x.json").write_text("[1, 2]")
    result = runner.invoke(app, ["trace", "replay", str(tmp_path / "x.json")])
    assert result.exit_code == 2 and "not a trace" in result.output, result.output
