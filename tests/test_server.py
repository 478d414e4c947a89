"""`batchspec serve` through the official openai client, against a real uvicorn server on a free
loopback port: completions, chat, streaming, seeds, stop strings, auth, every error answer,
client disconnects, and a load test of 64 concurrent clients whose greedy answers must equal
offline `batchspec generate` for the same prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass

import httpx
import openai
import pytest
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from batchspec import EngineConfig, SamplingParams, SpecEngine, load_pair
from batchspec.server import create_app, serve
from batchspec.server.app import OpenAIServer

torch.set_num_threads(1)  # the machine is shared: one thread per torch process

MODEL = "tiny-llama"
API_KEY = "sk-test"
CONFIG = dict(method="eqspec", batch_size=8, gamma=3)
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
PROMPTS = [f"def {name}(self, {arg}):\n    "  # 32 distinct prompts
           for name in ("add", "push", "pop", "init", "parse", "stack", "items", "get")
           for arg in ("a", "b", "item", "x")]


@dataclass
class Served:
    url: str
    server: OpenAIServer
    offline: SpecEngine  # same config on its own copy of the models: the reference

    @property
    def engine(self) -> SpecEngine:
        return self.server.spec

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", API_KEY), max_retries=0, **kw)

    def reference(self, prompt: str, max_tokens: int, **params):
        return self.offline.generate([prompt], SamplingParams(max_new_tokens=max_tokens, **params))[0]

    def metrics(self) -> dict[tuple[str, tuple], float]:
        text = httpx.get(self.url + "/metrics", headers=auth()).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until the engine has nothing in flight and holds no KV (aborts land at a round boundary)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.engine.has_unfinished() and self.engine.kv_tokens_in_use() == 0:
                return
            time.sleep(0.02)
        raise AssertionError(f"engine not idle: {self.engine.num_running()} running, "
                             f"{self.engine.kv_tokens_in_use()} KV tokens in use")


def auth(key: str = API_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(app):
    config = uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning",
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)


@pytest.fixture(scope="module")
def served(tiny_dirs):
    pairs = []
    for _ in range(2):
        p = load_pair(tiny_dirs["target"], tiny_dirs["draft"])
        p.tokenizer.chat_template = CHAT_TEMPLATE
        pairs.append(p)
    engine = SpecEngine(pairs[0], EngineConfig(**CONFIG))
    app = create_app(engine, model_name=MODEL, api_key=API_KEY, max_waiting=256)
    with running(app) as url:
        yield Served(url, app.state.server, SpecEngine(pairs[1], EngineConfig(**CONFIG)))


# ------------------------------------------------------------------------------------------ basics
def test_models_health_and_metrics(served):
    assert [m.id for m in served.client().models.list().data] == [MODEL]
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}  # no key needed
    names = {name for name, _ in served.metrics()}
    for name in ("batchspec_requests_total", "batchspec_prompt_tokens_total", "batchspec_generation_tokens_total",
                 "batchspec_acceptance_rate", "batchspec_batch_occupancy_bucket", "batchspec_requests_waiting",
                 "batchspec_kv_tokens_in_use", "batchspec_time_to_first_token_seconds_bucket",
                 "batchspec_inter_token_latency_seconds_bucket"):
        assert name in names, name


def test_completion_equals_offline_greedy_with_usage(served):
    client = served.client()
    for prompt, max_tokens in ((PROMPTS[0], 12), (PROMPTS[5], 20)):
        ref = served.reference(prompt, max_tokens)
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
        assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), len(ref.token_ids))
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    ids = served.engine.encode(PROMPTS[1])  # token ids work as a prompt too
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert r.choices[0].text == served.reference(PROMPTS[1], 8).text
    nulls = {"n": None, "stream": None, "stop": None, "seed": None, "top_p": None, "ignore_eos": None}
    raw = httpx.post(served.url + "/v1/completions", headers=auth(),
                     json={"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0, **nulls})
    assert raw.status_code == 200 and raw.json()["choices"][0]["text"] == r.choices[0].text


def test_streaming_completion_sends_each_round_and_usage(served):
    ref = served.reference(PROMPTS[2], 24)
    chunks = list(served.client().completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=24, temperature=0,
                                                      stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == ref.text and len(texts) > 2
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert all(c.usage is None for c in chunks[:-1])
    raw = httpx.post(served.url + "/v1/completions", headers=auth(),
                     json={"prompt": PROMPTS[2], "max_tokens": 4, "temperature": 0, "stream": True})
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.rstrip().endswith("data: [DONE]")


def test_chat_uses_the_template_and_streams(served):
    client = served.client()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def add(a, b):"}]
    text = served.engine.pair.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ref = served.reference(text, 16)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    bos = served.engine.pair.tokenizer.bos_token_id
    assert ref.prompt_token_ids[0] == bos and ref.prompt_token_ids.count(bos) == 1  # the template's BOS, no second
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)
    parts = [{"role": "user", "content": [{"type": "text", "text": "def add(a, b):"}]}]
    r2 = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=16, temperature=0)
    text2 = served.engine.pair.tokenizer.apply_chat_template([{"role": "user", "content": "def add(a, b):"}],
                                                              tokenize=False, add_generation_prompt=True)
    assert r2.choices[0].message.content == served.reference(text2, 16).text
    r3 = client.chat.completions.create(model=MODEL, messages=parts, temperature=0)  # no max_tokens: up to context
    assert r3.usage.prompt_tokens + r3.usage.completion_tokens <= served.engine.context


def test_chat_without_a_template_is_a_clear_400(served):
    tok = served.engine.pair.tokenizer
    saved, tok.chat_template = tok.chat_template, None
    try:
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            served.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    finally:
        tok.chat_template = saved


def test_seeds_and_n(served):
    client = served.client()
    kw = dict(model=MODEL, prompt=PROMPTS[3], max_tokens=12, temperature=1.0, extra_body={"ignore_eos": True})
    a = client.completions.create(seed=7, **kw).choices[0].text
    assert a == client.completions.create(seed=7, **kw).choices[0].text
    assert a == served.reference(PROMPTS[3], 12, temperature=1.0, seed=7, ignore_eos=True).text
    r = client.completions.create(seed=7, n=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2] and r.choices[0].text == a
    assert r.choices[1].text == client.completions.create(seed=8, **kw).choices[0].text  # choice i: seed + i
    assert len({c.text for c in r.choices}) > 1
    assert r.usage.completion_tokens == 3 * 12
    assert r.usage.prompt_tokens == len(served.engine.encode(PROMPTS[3]))  # a prompt counts once, whatever n
    greedy = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=12, temperature=0, n=2,
                                       extra_body={"top_k": 5})
    assert greedy.choices[0].text == greedy.choices[1].text == served.reference(PROMPTS[3], 12).text
    chunks = list(client.completions.create(seed=7, n=2, stream=True, **kw))
    by_choice = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            by_choice[ch.index] += ch.text
    assert by_choice == {0: r.choices[0].text, 1: r.choices[1].text}


def test_stop_strings(served):
    client = served.client()
    full = served.reference(PROMPTS[4], 24, ignore_eos=True).text
    stop = full[6:8]
    cut = full[: full.find(stop)]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=24, temperature=0, stop=[stop, "zzzz"],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=24, temperature=0, stop=stop,
                                         stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut


# ------------------------------------------------------------------------------------------ errors
def test_auth(served):
    with pytest.raises(openai.AuthenticationError, match="API key"):
        served.client(api_key="wrong").completions.create(model=MODEL, prompt="x", max_tokens=1)
    r = httpx.post(served.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(served.url + "/metrics").status_code == 401
    assert httpx.get(served.url + "/v1/models", headers=auth("wrong")).status_code == 401
    assert httpx.get(served.url + "/v1/models", headers={"Authorization": f"bearer {API_KEY}"}).status_code == 200
    assert httpx.get(served.url + "/health").status_code == 200


@pytest.mark.parametrize("body, status, reason", [
    ({"prompt": PROMPTS[0] * 40}, 400, "longer than the model context"),
    ({"prompt": PROMPTS[0], "max_tokens": 5000}, 400, "model context"),
    ({"prompt": PROMPTS[0], "max_tokens": -1}, 400, "max_tokens: Input should be greater than or equal to 1"),
    ({"prompt": PROMPTS[0], "max_tokens": 0}, 400, "max_tokens: Input should be greater than or equal to 1"),
    ({"prompt": PROMPTS[0], "temperature": -0.5}, 400, "temperature"),
    ({"prompt": PROMPTS[0], "top_p": 0}, 400, "top_p"),
    ({"prompt": PROMPTS[0], "top_k": -3}, 400, "top_k"),
    ({"prompt": PROMPTS[0], "stop": [""]}, 400, "stop strings"),
    ({"prompt": PROMPTS[0], "n": 0}, 400, "n must be"),
    ({"prompt": PROMPTS[0], "n": 100}, 400, "at most"),
    ({"prompt": PROMPTS[0], "seed": 2**70}, 400, "seed"),
    ({"prompt": PROMPTS[0], "logprobs": 2}, 400, "not supported"),
    ({"prompt": ""}, 400, "empty"),
    ({"prompt": []}, 400, "empty"),
    ({"prompt": [5, 10**6]}, 400, "token ids"),
    ({"prompt": PROMPTS[0], "model": "gpt-4"}, 404, "not served here"),
    ({"prompt": PROMPTS[0], "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": {"text": "x"}}, 400, "prompt"),
    ({"max_tokens": 3}, 400, "prompt"),
])
def test_bad_requests_get_the_reason(served, body, status, reason):
    r = httpx.post(served.url + "/v1/completions", headers=auth(), json={"model": MODEL, **body})
    assert r.status_code == status, r.text
    assert reason in r.json()["error"]["message"]


def test_malformed_json_and_chat_errors(served):
    for raw in (b"{not json", b"[1, 2]", b""):
        r = httpx.post(served.url + "/v1/chat/completions", headers={**auth(), "content-type": "application/json"},
                       content=raw)
        assert r.status_code == 400 and "malformed" in r.json()["error"]["message"]
    client = served.client()
    with pytest.raises(openai.BadRequestError, match="messages is empty"):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.BadRequestError, match="only text content"):
        client.chat.completions.create(model=MODEL, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}])
    with pytest.raises(openai.BadRequestError, match="not supported"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       response_format={"type": "json_object"})


def test_full_queue_is_429_and_the_server_stays_up(served):
    engine = served.server.engine
    engine.max_waiting = 0
    try:
        with pytest.raises(openai.RateLimitError, match="busy"):
            served.client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4)
        r = httpx.post(served.url + "/v1/completions", headers=auth(),
                       json={"prompt": PROMPTS[0], "stream": True, "n": 2})
        assert r.status_code == 429
    finally:
        engine.max_waiting = 256
    served.wait_idle()
    r = served.client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert r.choices[0].text == served.reference(PROMPTS[0], 4).text


def test_a_failed_round_is_a_500_and_the_server_goes_on(served):
    engine, real_step = served.engine, served.engine.step
    failed = threading.Event()

    def failing_step():
        if not failed.is_set():
            failed.set()
            raise RuntimeError("simulated fault")
        return real_step()

    engine.step = failing_step
    try:
        r = httpx.post(served.url + "/v1/completions", headers=auth(), json={"prompt": PROMPTS[7], "max_tokens": 4})
    finally:
        del engine.step
    assert r.status_code == 500 and "simulated fault" in r.json()["error"]["message"]
    served.wait_idle()
    r = served.client().completions.create(model=MODEL, prompt=PROMPTS[7], max_tokens=4, temperature=0)
    assert r.choices[0].text == served.reference(PROMPTS[7], 4).text


# ------------------------------------------------------------------------------------------ disconnects
def counter(metrics, name: str, **labels) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_disconnects_has_its_request_aborted(served, stream):
    before = served.metrics()
    long = {"model": MODEL, "prompt": PROMPTS[6], "max_tokens": 100, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    engine, real_step = served.engine, served.engine.step
    engine.step = lambda: (time.sleep(0.01), real_step())[1]  # >= 20 rounds: still running when the client leaves
    try:
        if stream:
            with httpx.stream("POST", served.url + "/v1/completions", headers=auth(), json=long) as r:
                assert next(r.iter_lines()).startswith("data: ")
        else:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(served.url + "/v1/completions", headers=auth(), json=long, timeout=0.1)
        served.wait_idle()
    finally:
        del engine.step
    deadline = time.monotonic() + 5
    while counter(served.metrics(), "batchspec_requests_total", endpoint="completions", outcome="cancelled") == \
            counter(before, "batchspec_requests_total", endpoint="completions", outcome="cancelled"):
        assert time.monotonic() < deadline, "the disconnect was not counted"
        time.sleep(0.02)
    after = served.metrics()
    assert counter(after, "batchspec_sequences_finished_total", finish_reason="abort") == \
        counter(before, "batchspec_sequences_finished_total", finish_reason="abort") + 1
    assert served.engine.kv_tokens_in_use() == 0 and served.engine.num_waiting() == 0


# ------------------------------------------------------------------------------------------ load
def offline_generate(tmp_path, tiny_dirs, prompts: list[str], max_tokens: int) -> list[str]:
    """`batchspec generate` with the server's config: the reference texts."""
    from typer.testing import CliRunner

    from batchspec.cli import app

    prompt_file, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    result = CliRunner().invoke(app, ["generate", "--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"],
                                      "--method", CONFIG["method"], "--batch-size", str(CONFIG["batch_size"]),
                                      "--gamma", str(CONFIG["gamma"]), "--max-new-tokens", str(max_tokens),
                                      "--prompts", str(prompt_file), "--output", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    return [json.loads(line)["text"] for line in out.read_text().splitlines()]


@pytest.mark.slow
def test_load_64_clients_mixed_streaming_and_cancelled(served, tmp_path, tiny_dirs):
    total, clients, max_tokens = 256, 64, 12
    refs = offline_generate(tmp_path, tiny_dirs, PROMPTS, max_tokens)
    before = served.metrics()
    engine_before = {name: getattr(served.engine.stats, name) for name in ("drafted", "accepted")}
    kinds = ("stream", "whole", "stream_usage", "cancel")

    async def one(client, i: int):
        prompt, kind = PROMPTS[i % len(PROMPTS)], kinds[i % len(kinds)]
        if kind == "cancel":  # leaves early: after the first chunk, or before any answer
            if (i // len(kinds)) % 2:
                stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=64, temperature=0,
                                                         stream=True, extra_body={"ignore_eos": True})
                async for _ in stream:
                    break
                await stream.close()
            else:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(client.completions.create(model=MODEL, prompt=prompt, max_tokens=64,
                                                                     temperature=0), 0.05)
            return i, None, None
        if kind == "whole":
            r = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
            return i, r.id, r.choices[0].text
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True,
                                                 stream_options={"include_usage": kind == "stream_usage"})
        text, ids = "", set()
        async for chunk in stream:
            ids.add(chunk.id)
            text += "".join(c.text for c in chunk.choices)
        assert len(ids) == 1
        return i, ids.pop(), text

    async def main():
        async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key=API_KEY, max_retries=0) as client:
            queue = list(range(total))

            async def worker():
                done = []
                while queue:
                    done.append(await one(client, queue.pop()))
                return done

            return [r for part in await asyncio.gather(*(worker() for _ in range(clients))) for r in part]

    results = asyncio.run(main())
    assert sorted(i for i, _, _ in results) == list(range(total))
    answered = [(i, rid, text) for i, rid, text in results if rid is not None]
    assert len(answered) == total * 3 // 4
    assert len({rid for _, rid, _ in answered}) == len(answered)  # no answer delivered twice
    for i, _, text in answered:
        assert text == refs[i % len(PROMPTS)], i
    served.wait_idle()

    def delta(name, **labels):
        return counter(served.metrics(), name, **labels) - counter(before, name, **labels)

    def settled():
        ok = delta("batchspec_requests_total", endpoint="completions", outcome="ok")
        cancelled = delta("batchspec_requests_total", endpoint="completions", outcome="cancelled")
        ended = {r: delta("batchspec_sequences_finished_total", finish_reason=r) for r in ("stop", "length", "abort")}
        return ok, cancelled, ended

    deadline = time.monotonic() + 5
    while True:  # a cancelled stream is counted when Starlette closes its generator: wait for it
        ok, cancelled, ended = settled()
        if sum(ended.values()) == ok + cancelled and ok + cancelled >= len(answered) + total // 8:
            break
        assert time.monotonic() < deadline, (ok, cancelled, ended)
        time.sleep(0.05)
    # Every request that reached the server ended exactly once, in the engine and in the counts: the
    # answered ones as "ok", every stream left after its first chunk as "cancelled" and aborted. Only a
    # non-streaming request given up within 50 ms may have been dropped before the server read it.
    assert ok >= len(answered) and ok + cancelled <= total and ok + cancelled >= total - total // 8
    assert ended["abort"] == cancelled >= total // 8
    now = served.metrics()
    # the draft counters follow the engine's own (how many rounds speculate is the adaptive policy's
    # call, made on this machine's timings: under this load it may run every round plain)
    for metric, name in (("batchspec_draft_tokens_total", "drafted"), ("batchspec_accepted_draft_tokens_total",
                                                                         "accepted")):
        assert delta(metric) == getattr(served.engine.stats, name) - engine_before[name]
    assert delta("batchspec_batch_occupancy_count") > 0
    assert delta("batchspec_time_to_first_token_seconds_count") >= len(answered)
    assert 0 <= counter(now, "batchspec_acceptance_rate") <= 1
    for gauge in ("batchspec_requests_waiting", "batchspec_requests_running", "batchspec_kv_tokens_in_use"):
        assert counter(now, gauge) == 0, gauge  # the last step left the engine idle
    assert served.engine.kv_tokens_in_use() == 0 and not served.engine.has_unfinished()


def test_comparison_table_from_reports(tmp_path):
    from batchspec.server.loadtest import comparison_table

    def report(tput, texts):
        return {"output_throughput": tput, "request_throughput": 1.0, "median_e2el_ms": 500.0, "p95_e2el_ms": 900.0,
                "median_ttft_ms": 50.0, "median_itl_ms": 10.0, "failed": 0, "prompt_indices": [0, 1],
                "generated_texts": texts}

    for name, rep in (("ours_c8_r1", report(300.0, ["a", "b"])), ("ours_c8_r2", report(200.0, ["a", "c"])),
                      ("hf_c8_r1", report(100.0, ["a", "b"]))):
        (tmp_path / f"{name}.json").write_text(json.dumps(rep))
    table = comparison_table(tmp_path, {"ours": "batchspec serve", "hf": "transformers serve"}, baseline="hf")
    rows = table.splitlines()
    assert rows[2] == "| batchspec serve | 8 | 250.0 | 2.50 | 1.00 | 0.50 | 0.90 | 50.0 | 10.0 | 0 | 2 | 0.75 |"
    assert rows[3].startswith("| transformers serve | 8 | 100.0 | 1.00 |")


def test_loadtest_command_reports_json(served, tmp_path):
    from typer.testing import CliRunner

    from batchspec.cli import app

    prompt_file, out = tmp_path / "p.jsonl", tmp_path / "report.json"
    prompt_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:4]))
    result = CliRunner().invoke(app, ["loadtest", "--url", served.url, "--api-key", API_KEY, "--concurrency", "4",
                                      "--requests", "8", "--max-tokens", "6", "--stream", "--prompts",
                                      str(prompt_file), "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["completed"] == 8 and report["failed"] == 0 and report["model"] == MODEL
    assert report["total_output_tokens"] == sum(report["output_lens"]) and report["usage_missing"] == 0
    for key in ("request_throughput", "output_throughput", "median_ttft_ms", "p95_ttft_ms", "median_itl_ms",
                "p95_itl_ms", "median_e2el_ms"):
        assert report[key] is not None and report[key] > 0, key
    for i, text in zip(report["prompt_indices"], report["generated_texts"]):
        assert text == served.reference(PROMPTS[i], 6).text


def test_timed_requests_start_after_the_warm_up_prompts(monkeypatch):
    """Timed request i uses prompt (W + i) mod P: a server that remembers the warm-up's answers
    (suffix drafting) meets those prompts again only when the timed requests outnumber the rest."""
    import asyncio

    from batchspec.server import loadtest

    async def fake(client, model, prompt, index, **kw):
        return loadtest.RequestResult(index, ok=True, text=prompt)

    monkeypatch.setattr(loadtest, "one_request", fake)
    prompts = [f"p{k}" for k in range(5)]
    results = asyncio.run(loadtest._wave(None, "m", prompts, 6, 3, first=3))
    assert [r.prompt_index for r in results] == [3, 4, 0, 1, 2, 3]
    assert [r.text for r in results] == ["p3", "p4", "p0", "p1", "p2", "p3"]


def test_serve_steps_the_engine_on_its_own_thread_and_stops_on_sigterm(tiny_dirs):
    """`serve` runs the rounds on the thread that called it (the one that loaded the models: see
    AsyncEngine) and HTTP on another; SIGTERM stops it; a port already taken is a RuntimeError."""
    engine = SpecEngine(load_pair(tiny_dirs["target"], tiny_dirs["draft"]), EngineConfig(**CONFIG))
    reference = SpecEngine(load_pair(tiny_dirs["target"], tiny_dirs["draft"]), EngineConfig(**CONFIG))
    stepped_on, step = set(), engine.step

    def recording_step():
        stepped_on.add(threading.current_thread())
        return step()

    engine.step = recording_step
    url, got = f"http://127.0.0.1:{(port := free_port())}", {}

    def client():  # SIGTERM only once the server answered: serve's handler is in place by then
        deadline = time.monotonic() + 60
        while "health" not in got and time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                got["health"] = httpx.get(url + "/health").status_code
            time.sleep(0.05)
        if "health" in got:
            with contextlib.suppress(httpx.HTTPError):
                body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 10, "temperature": 0}
                got["text"] = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
            os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    serve(engine, port=port, model_name=MODEL)
    thread.join(timeout=5)
    assert got.get("health") == 200
    assert got.get("text") == reference.generate([PROMPTS[2]], SamplingParams(max_new_tokens=10))[0].text
    assert stepped_on == {threading.current_thread()}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(RuntimeError, match="did not start"):
            serve(engine, port=taken.getsockname()[1], model_name=MODEL)


def test_a_server_drafting_with_an_eagle_head_answers_as_generate_does(tiny_dirs, tmp_path):
    """`batchspec serve --drafter eagle:<dir>`: concurrent greedy requests, drafted by a head from
    the target's own hidden states (random: ragged acceptance), get what `generate` gives (the
    head's rows of features come and go with the requests)."""
    from concurrent.futures import ThreadPoolExecutor

    from batchspec.eagle.formats import save_head
    from batchspec.eagle.head import new_head

    pair = load_pair(tiny_dirs["target"], need_draft=False)
    save_head(new_head(pair.target, "eagle", seed=3), tmp_path)
    config = EngineConfig(**{**CONFIG, "drafter": f"eagle:{tmp_path}", "adaptive": False})
    engine = SpecEngine(pair, config)
    prompts = PROMPTS[:12]
    offline = SpecEngine(load_pair(tiny_dirs["target"], need_draft=False), config)
    want = [o.text for o in offline.generate(prompts, SamplingParams(max_new_tokens=16))]
    app = create_app(engine, model_name=MODEL, api_key=API_KEY)
    with running(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)

        def complete(prompt: str) -> str:
            return client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0).choices[0].text
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(complete, prompts))
    assert got == want
    assert offline.stats.drafted > 0 and app.state.server.spec.stats.drafted > 0
