"""`batchspec loadtest`: drive any OpenAI-compatible server with the official `openai` client and
report what its users feel.

N workers (the concurrency) each send one request at a time until M requests have been sent
(a closed loop, as `vllm bench serve --max-concurrency` does). An untimed warm-up wave of W
requests goes first, on prompts 0..W-1; timed request i then uses prompt (W + i) mod P, so a
server that remembers earlier requests (a prefix cache, suffix drafting) meets a prompt again only
when the timed requests outnumber the P - W prompts the warm-up left unused. Per request it records:

    e2el   end-to-end latency, from sending to the last byte
    ttft   time to first token: to the first chunk with text (streaming only)
    itl    inter-token latency: the gaps between later chunks with text (streaming only; with
           speculation one chunk may carry several tokens, as in vLLM's benchmark)
    tpot   time per output token after the first: (e2el - ttft) / (output tokens - 1)

Output tokens come from the server's `usage` (streams ask for it with stream_options); a server
that sends none is counted in chunks, and `usage_missing` says how often that happened. The JSON
uses `vllm bench serve`'s keys where they mean the same thing.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone


@dataclass
class RequestResult:
    prompt_index: int
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    text: str = ""
    e2el: float = 0.0
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    usage_missing: bool = False

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def base_url(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


async def served_model(client) -> str:
    models = await client.models.list()
    if not models.data:
        raise ValueError("the server lists no models; pass --model")
    return models.data[0].id


async def one_request(client, model: str, prompt: str, index: int, *, max_tokens: int, stream: bool, chat: bool,
                      temperature: float) -> RequestResult:
    result = RequestResult(index)
    args = dict(model=model, max_tokens=max_tokens, temperature=temperature, stream=stream)
    if stream:
        args["stream_options"] = {"include_usage": True}
    start = time.perf_counter()
    try:
        if chat:
            response = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **args)
        else:
            response = await client.completions.create(prompt=prompt, **args)
        if stream:
            await _read_stream(response, result, start, chat)
        else:
            choice = response.choices[0]
            result.text = (choice.message.content if chat else choice.text) or ""
            _take_usage(result, response.usage)
        result.e2el = time.perf_counter() - start
        result.ok = True
    except Exception as exc:  # an error is a result: counted and reported, the run goes on
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def _read_stream(response, result: RequestResult, start: float, chat: bool) -> None:
    last, chunks, usage = None, 0, None
    async for chunk in response:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text = (choice.delta.content if chat else choice.text) or ""
            if not text:
                continue
            now = time.perf_counter()
            if last is None:
                result.ttft = now - start
            else:
                result.itls.append(now - last)
            last = now
            chunks += 1
            result.text += text
    _take_usage(result, usage, chunks)


def _take_usage(result: RequestResult, usage, chunks: int = 0) -> None:
    if usage is not None:
        result.prompt_tokens, result.output_tokens = usage.prompt_tokens, usage.completion_tokens
    else:
        result.output_tokens, result.usage_missing = chunks, True


async def _wave(client, model: str, prompts: list[str], count: int, concurrency: int, first: int = 0,
                **kw) -> list[RequestResult]:
    """`count` requests, request i on prompt (first + i) mod P, `concurrency` at a time."""
    results: list[RequestResult | None] = [None] * count
    next_index = iter(range(count))

    async def worker() -> None:
        for i in next_index:  # shared: each index is taken by exactly one worker
            k = (first + i) % len(prompts)
            results[i] = await one_request(client, model, prompts[k], k, **kw)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, count))))
    return results


async def run_loadtest(url: str, prompts: list[str], *, concurrency: int, requests: int, max_tokens: int,
                       stream: bool = False, chat: bool = False, temperature: float = 0.0, model: str | None = None,
                       api_key: str | None = None, warmup: int | None = None, timeout: float = 600.0) -> dict:
    """Run the load test; returns the report (see the module docstring)."""
    import httpx
    import openai

    if concurrency < 1 or requests < 1 or max_tokens < 1:
        raise ValueError("--concurrency, --requests and --max-tokens must be >= 1")
    if not prompts:
        raise ValueError("no prompts")
    warmup = concurrency if warmup is None else warmup
    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 8,
                                                 max_keepalive_connections=concurrency + 8),
                             timeout=httpx.Timeout(timeout))
    async with openai.AsyncOpenAI(base_url=base_url(url), api_key=api_key or "none", max_retries=0,
                                  http_client=http) as client:
        model = model or await served_model(client)
        kw = dict(max_tokens=max_tokens, stream=stream, chat=chat, temperature=temperature)
        if warmup:
            await _wave(client, model, prompts, warmup, concurrency, **kw)
        start = time.perf_counter()
        results = await _wave(client, model, prompts, requests, concurrency, first=warmup, **kw)
        duration = time.perf_counter() - start
    config = dict(url=url, model=model, endpoint="chat/completions" if chat else "completions", stream=stream,
                  max_concurrency=concurrency, num_prompts=requests, max_tokens=max_tokens, temperature=temperature,
                  warmup=warmup)
    return summarize(results, duration, config)


def summarize(results: list[RequestResult], duration: float, config: dict) -> dict:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **config,
        "duration": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": errors,
        "usage_missing": sum(r.usage_missing for r in done),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
    }
    series = {"ttft": [r.ttft for r in done if r.ttft is not None],
              "tpot": [r.tpot for r in done if r.tpot is not None],
              "itl": [x for r in done for x in r.itls],
              "e2el": [r.e2el for r in done]}
    for name, values in series.items():
        report.update(_percentiles(name, values))
    report.update(input_lens=[r.prompt_tokens for r in done], output_lens=[r.output_tokens for r in done],
                  ttfts=series["ttft"], itls=[r.itls for r in done], e2els=series["e2el"],
                  prompt_indices=[r.prompt_index for r in done], generated_texts=[r.text for r in done])
    return report


def _percentiles(name: str, values: list[float]) -> dict:
    """mean / median / p95 / p99 in milliseconds (None without values), as vllm bench serve names them."""
    if not values:
        return {f"{k}_{name}_ms": None for k in ("mean", "median", "std", "p95", "p99")}
    ordered = sorted(values)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] * 1000

    return {f"mean_{name}_ms": statistics.fmean(values) * 1000, f"median_{name}_ms": statistics.median(values) * 1000,
            f"std_{name}_ms": statistics.pstdev(values) * 1000, f"p95_{name}_ms": pct(0.95),
            f"p99_{name}_ms": pct(0.99)}


def format_report(report: dict) -> list[tuple[str, str]]:
    """(label, value) rows for the console."""

    def ms(key: str) -> str:
        v = report.get(key)
        return "-" if v is None else f"{v:.1f}"

    rows = [("requests completed / failed", f"{report['completed']} / {report['failed']}"),
            ("duration (s)", f"{report['duration']:.2f}"),
            ("requests/s", f"{report['request_throughput']:.2f}"),
            ("output tokens/s", f"{report['output_throughput']:.1f}"),
            ("output tokens", str(report["total_output_tokens"]))]
    for name, label in (("e2el", "latency"), ("ttft", "TTFT"), ("itl", "inter-token latency"), ("tpot", "TPOT")):
        rows.append((f"{label} p50 / p95 (ms)", f"{ms(f'median_{name}_ms')} / {ms(f'p95_{name}_ms')}"))
    for message, count in list(report["errors"].items())[:5]:
        rows.append((f"error x{count}", message[:200]))
    return rows


def comparison_table(folder, labels: dict[str, str], baseline: str | None = None) -> str:
    """Markdown table of the reports `<server>_c<concurrency>_r<repeat>.json` in `folder` (as
    scripts/serve_bench.sh writes them): medians over repeats, throughput ratio to `baseline`, and
    the share of answers whose text equals the baseline's answer to the same prompt (greedy runs
    of one model should agree)."""
    import json
    import re
    from pathlib import Path

    cells: dict[tuple[str, int], list[dict]] = {}
    for path in sorted(Path(folder).glob("*_c*_r*.json")):
        m = re.fullmatch(r"(.+)_c(\d+)_r\d+\.json", path.name)
        if m:
            cells.setdefault((m.group(1), int(m.group(2))), []).append(json.loads(path.read_text()))

    def med(reports: list[dict], key: str) -> float | None:
        values = [r[key] for r in reports if r.get(key) is not None]
        return statistics.median(values) if values else None

    def fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
        return "-" if value is None else f"{value * scale:.{digits}f}"

    order = {name: i for i, name in enumerate(labels)}
    rows = ["| server | concurrency | output tokens/s | vs " + (baseline or "-")
            + " | requests/s | latency p50 (s) | latency p95 (s) | TTFT p50 (ms) | ITL p50 (ms) | failed | repeats "
            "| same text |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for server, c in sorted(cells, key=lambda k: (k[1], order.get(k[0], len(order)), k[0])):
        reports = cells[(server, c)]
        tput = med(reports, "output_throughput")
        base = med(cells.get((baseline, c), []), "output_throughput") if baseline else None
        ratio = f"{tput / base:.2f}" if tput and base else "-"
        rows.append(f"| {labels.get(server, server)} | {c} | {fmt(tput)} | {ratio} | "
                    f"{fmt(med(reports, 'request_throughput'), digits=2)} | "
                    f"{fmt(med(reports, 'median_e2el_ms'), 1e-3, 2)} | {fmt(med(reports, 'p95_e2el_ms'), 1e-3, 2)} | "
                    f"{fmt(med(reports, 'median_ttft_ms'))} | {fmt(med(reports, 'median_itl_ms'))} | "
                    f"{sum(r['failed'] for r in reports)} | {len(reports)} | "
                    f"{_agreement(reports, cells.get((baseline, c), []))} |")
    return "\n".join(rows)


def _agreement(reports: list[dict], baseline: list[dict]) -> str:
    """Share of answers equal to the baseline's answer to the same prompt ("-" without a baseline)."""
    def answers(rs: list[dict]):
        return [(i, t) for r in rs for i, t in zip(r.get("prompt_indices", []), r.get("generated_texts", []))]

    reference = dict(answers(baseline))
    pairs = [(t, reference[i]) for i, t in answers(reports) if i in reference]
    return f"{sum(a == b for a, b in pairs) / len(pairs):.2f}" if pairs else "-"
