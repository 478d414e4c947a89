"""Prometheus metrics of one server, in its own registry (several apps in one process do not clash).

Two sources feed them:
  * the engine loop thread, after every step (`on_step`): tokens generated, drafts proposed and
    accepted, batch occupancy, queue length, requests running, KV in use, finished sequences;
    read there because that thread owns the engine, so nothing races a round;
  * the HTTP side: requests by endpoint and outcome, prompt tokens, time to first token,
    inter-token latency and end-to-end latency as the client sees them (event-loop time).

Inter-token latency: a round that accepts k tokens of a request after a gap dt contributes k
observations of dt / k, so the histogram's sum over its count is the mean time per token.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..core.request import StepOutput
from ..engine import SpecEngine

ENDPOINTS = ("completions", "chat_completions")
OUTCOMES = ("ok", "cancelled", "invalid", "queue_full", "unauthorized", "error")
FINISH_REASONS = ("stop", "length", "abort")
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)
OCCUPANCY_BUCKETS = (0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine: SpecEngine) -> None:
        self.engine = engine
        self.registry = r = CollectorRegistry()
        self.requests = Counter("batchspec_requests", "HTTP requests by endpoint and outcome "
                                f"({', '.join(OUTCOMES)})", ["endpoint", "outcome"], registry=r)
        self.sequences = Counter("batchspec_sequences_finished", "Engine requests (one per choice) that ended, by "
                                 "finish reason (stop, length, abort)", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("batchspec_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("batchspec_generation_tokens", "Tokens generated", registry=r)
        self.drafted = Counter("batchspec_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted = Counter("batchspec_accepted_draft_tokens", "Draft tokens the target accepted", registry=r)
        self.acceptance = Gauge("batchspec_acceptance_rate", "Accepted over drafted tokens since the server started",
                                registry=r)
        self.occupancy = Histogram("batchspec_batch_occupancy", "Rows verified per round over the batch size",
                                   buckets=OCCUPANCY_BUCKETS, registry=r)
        self.waiting = Gauge("batchspec_requests_waiting", "Requests queued, not yet admitted", registry=r)
        self.running = Gauge("batchspec_requests_running", "Requests resident in the engine", registry=r)
        self.kv_used = Gauge("batchspec_kv_tokens_in_use", "Target KV tokens reserved", registry=r)
        self.kv_budget = Gauge("batchspec_kv_tokens_budget", "Target KV budget in tokens", registry=r)
        self.kv_usage = Gauge("batchspec_kv_usage_ratio", "KV tokens in use over the budget", registry=r)
        self.ttft = Histogram("batchspec_time_to_first_token_seconds", "From request arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("batchspec_inter_token_latency_seconds", "Time per output token after the first",
                             buckets=TOKEN_BUCKETS, registry=r)
        self.latency = Histogram("batchspec_request_latency_seconds", "From request arrival to its last token",
                                 buckets=LATENCY_BUCKETS, registry=r)
        for endpoint in ENDPOINTS:  # every series exists from the start, at 0
            for outcome in OUTCOMES:
                self.requests.labels(endpoint, outcome)
        for reason in FINISH_REASONS:
            self.sequences.labels(reason)
        self.kv_budget.set(engine.kv_tokens)
        self._seen = {name: getattr(engine.stats, name) for name in ("rounds", "row_rounds", "drafted", "accepted")}
        self._drafted = self._accepted = 0  # since the server started (engine.stats also holds the warm-up)
        self.on_step([])

    def on_step(self, outputs: list[StepOutput]) -> None:
        """Called on the engine loop thread after every step."""
        engine = self.engine
        stats = engine.stats
        delta = {}
        for name, seen in self._seen.items():
            now = getattr(stats, name)
            delta[name], self._seen[name] = now - seen, now
        self.drafted.inc(delta["drafted"])
        self.accepted.inc(delta["accepted"])
        self._drafted += delta["drafted"]
        self._accepted += delta["accepted"]
        if self._drafted:
            self.acceptance.set(self._accepted / self._drafted)
        if delta["rounds"]:
            self.occupancy.observe(delta["row_rounds"] / delta["rounds"] / engine.config.batch_size)
        self.generation_tokens.inc(sum(len(o.new_token_ids) for o in outputs))
        for o in outputs:
            if o.finished:
                self.sequences.labels(o.finish_reason).inc()
        in_use = engine.kv_tokens_in_use()
        self.waiting.set(engine.num_waiting())
        self.running.set(engine.num_running())
        self.kv_used.set(in_use)
        self.kv_usage.set(in_use / engine.kv_tokens if engine.kv_tokens else 0.0)

    def request_done(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(endpoint, outcome).inc()

    def token_times(self, first: bool, gap: float, tokens: int) -> None:
        """A round's `tokens` for one request arrived `gap` seconds after its previous ones (or, when
        `first`, after the request arrived)."""
        if first:
            self.ttft.observe(gap)
            tokens -= 1
            gap = 0.0
        for _ in range(tokens):
            self.itl.observe(gap / tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
