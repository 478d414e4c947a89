"""`batchspec serve` with the engine in its own process (`ProcessEngine`, issue 72): greedy answers
equal offline `SpecEngine.generate` (completions and chat, streaming or not), a client that leaves
frees its row in the child, /metrics reads the child's statistics, a dead child is a 503 while
/health keeps answering, SIGTERM drains the requests in flight, and no engine process outlives
its server. A real uvicorn server on a free loopback port; waits poll with a deadline.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from batchspec import EngineConfig, SamplingParams, SpecEngine, load_pair
from batchspec.server import create_app, serve
from batchspec.server.engine_process import ProcessEngine

pytestmark = pytest.mark.slow  # each test spawns an engine process that loads its models

torch.set_num_threads(1)  # the machine is shared: one thread per torch process (the child's: OMP_NUM_THREADS)

MODEL = "tiny-llama"
CONFIG = dict(method="eqspec", batch_size=8, gamma=3)
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
PROMPTS = [f"def {name}(self, {arg}):\n    " for name in ("add", "push", "pop", "init") for arg in ("a", "item")]


def start(tiny_dirs) -> ProcessEngine:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the spawned child
    engine = ProcessEngine.start(tiny_dirs["target"], tiny_dirs["draft"], EngineConfig(**CONFIG), timeout=120)
    engine.engine.pair.tokenizer.chat_template = CHAT_TEMPLATE  # the HTTP side renders chats
    return engine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def until(condition, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


@contextlib.contextmanager
def running(app):
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning",
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    until(lambda: server.started or not thread.is_alive(), "the test server started", 30)
    assert server.started
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(httpx.get(url + "/metrics").text) for s in family.samples}


@pytest.fixture(scope="module")
def offline(tiny_dirs) -> SpecEngine:
    pair = load_pair(tiny_dirs["target"], tiny_dirs["draft"])
    pair.tokenizer.chat_template = CHAT_TEMPLATE
    return SpecEngine(pair, EngineConfig(**CONFIG))


@pytest.fixture(scope="module")
def served(tiny_dirs):
    engine = start(tiny_dirs)
    try:
        with running(create_app(engine, model_name=MODEL)) as url:
            yield url, engine
    finally:
        engine.close()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def test_greedy_answers_equal_offline_generate(served, offline):
    url, engine = served
    refs = offline.generate(PROMPTS, SamplingParams(max_new_tokens=24))

    def completion(i: int) -> str:
        if i % 2:
            chunks = client(url).completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=24, temperature=0,
                                                    stream=True)
            return "".join(c.choices[0].text for c in chunks if c.choices)
        r = client(url).completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=24, temperature=0)
        return r.choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # all at once: rows join and leave the child's batch
        texts = list(pool.map(completion, range(len(PROMPTS))))
    assert texts == [r.text for r in refs]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def add(a, b):"}]
    text = offline.pair.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ref = offline.generate([text], SamplingParams(max_new_tokens=16))[0]
    r = client(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == ref.text and r.usage.prompt_tokens == len(ref.prompt_token_ids)
    chunks = list(client(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                      stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    seen = metrics(url)
    assert seen[("batchspec_generation_tokens_total", ())] >= sum(len(r.token_ids) for r in refs)
    assert seen[("batchspec_kv_tokens_budget", ())] == engine.engine.kv_tokens > 0
    assert seen[("batchspec_draft_tokens_total", ())] > 0  # the child's statistics, sent with each round


def test_the_http_side_checks_requests_with_the_childs_limits(served):
    url, engine = served
    too_long = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": engine.engine.context, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=too_long)
    assert r.status_code == 400 and "model context" in r.json()["error"]["message"]


def test_a_client_that_leaves_frees_its_row_in_the_child(served):
    url, engine = served
    aborted = ("batchspec_sequences_finished_total", (("finish_reason", "abort"),))
    cancelled = ("batchspec_requests_total", (("endpoint", "completions"), ("outcome", "cancelled")))
    before = metrics(url)
    long = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 100, "temperature": 0, "ignore_eos": True,
            "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=long) as r:
            assert next(r.iter_lines()).startswith("data: ")
            os.kill(engine.process.pid, signal.SIGSTOP)  # no more rounds until the client has gone
        until(lambda: metrics(url)[cancelled] == before[cancelled] + 1, "the server saw the client leave")
    finally:
        os.kill(engine.process.pid, signal.SIGCONT)
    view = engine.engine  # the child's state after its last round
    until(lambda: metrics(url)[aborted] == before[aborted] + 1, "the child reported the abort")
    until(lambda: not view.has_unfinished(), "the child was idle")
    assert view.num_running() == 0 and view.kv_tokens_in_use() == 0 and view.num_waiting() == 0


def test_a_dead_engine_process_is_a_503_and_health_keeps_answering(tiny_dirs):
    engine = start(tiny_dirs)
    try:
        with running(create_app(engine, model_name=MODEL, retry_after=3)) as url:
            assert httpx.get(url + "/health").status_code == 200
            os.kill(engine.process.pid, signal.SIGKILL)
            until(lambda: httpx.get(url + "/health").status_code == 503, "/health said the engine stopped")
            r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4})
            assert r.status_code == 503 and r.headers["Retry-After"] == "3"
            assert "engine process died" in r.json()["error"]["message"]
            assert httpx.get(url + "/health").json() == {"status": "engine stopped"}
            assert httpx.get(url + "/v1/models").status_code == 200
    finally:
        engine.close()
    assert engine.exitcode == -signal.SIGKILL


def test_sigterm_drains_the_stream_in_flight_and_ends_the_child(tiny_dirs, offline):
    engine = start(tiny_dirs)
    port, got = free_port(), {}
    url = f"http://127.0.0.1:{port}"
    body = {"model": MODEL, "prompt": PROMPTS[4], "max_tokens": 40, "temperature": 0, "stream": True}

    def client_thread():
        with contextlib.suppress(AssertionError):
            until(lambda: _answers(url), "the server answered", 60)
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            parts = [next(lines)]
            os.kill(os.getpid(), signal.SIGTERM)  # mid-stream: the server must finish this one first
            parts.extend(lines)
        got["text"] = "".join(_text(line) for line in parts)

    thread = threading.Thread(target=client_thread, daemon=True)
    thread.start()
    serve(engine, port=port, model_name=MODEL)  # returns once drained and the child has ended
    thread.join(timeout=10)
    assert got.get("text") == offline.generate([PROMPTS[4]], SamplingParams(max_new_tokens=40))[0].text
    assert not engine.process.is_alive() and engine.process.exitcode == 0  # it stopped, it was not killed


def _answers(url: str) -> bool:
    try:
        return httpx.get(url + "/health").status_code == 200
    except httpx.HTTPError:
        return False


def _text(line: str) -> str:
    import json

    if not line.startswith("data: {"):
        return ""
    return "".join(c["text"] for c in json.loads(line[6:])["choices"])


def test_the_engine_process_ends_with_its_parent(tiny_dirs, tmp_path):
    """A server killed outright (no close, no atexit) leaves no engine process behind."""
    script = textwrap.dedent(f"""
        import sys, time
        from batchspec import EngineConfig
        from batchspec.server.engine_process import ProcessEngine
        engine = ProcessEngine.start({tiny_dirs["target"]!r}, {tiny_dirs["draft"]!r}, EngineConfig(**{CONFIG!r}))
        print(engine.process.pid, flush=True)
        time.sleep(600)
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.kill()
        parent.wait(10)
        until(lambda: not _alive(child), "the orphaned engine process ended")
    finally:
        parent.kill()


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_model_the_engine_refuses_is_a_value_error(tmp_path):
    with pytest.raises(ValueError):
        ProcessEngine.start(str(tmp_path / "no-such-model"), timeout=120)


def test_serve_engine_process_starts_the_engine_process(monkeypatch):
    from typer.testing import CliRunner

    from batchspec.cli import app

    seen = []

    def start_engine_process(target, draft, config, dtype, device, settings):
        seen.append((config.batch_size, settings.max_waiting))
        raise ValueError("stop here")

    monkeypatch.setattr("batchspec.cli.serve.start_engine_process", start_engine_process)
    result = CliRunner().invoke(app, ["serve", "--engine-process", "--batch-size", "3", "--max-waiting", "5"])
    assert result.exit_code == 2 and "stop here" in result.output and seen == [(3, 5)]
