"""The user-facing engine: `generate()` for offline batches, `add_request()`/`step()` underneath.

Requests join and leave between rounds: each `step()` admits what the scheduler lets in
(prefilling both models), runs one round on the chosen batch and retires finished requests.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch

from .config import EngineConfig
from .core.request import FinishReason, Output, Request
from .core.runner import ModelRunner
from .core.stats import RunStats, StageTimer
from .decode import run_round
from .drafters import make_drafter, parse_drafter
from .models import ModelPair, context_length, load_pair
from .sampling import SamplingParams, make_generator
from .sched import make_scheduler


class SpecEngine:
    """Batch speculative decoding over a target and a draft model.

    >>> engine = SpecEngine.from_pretrained()                       # the bundled pair
    >>> outs = engine.generate(["def add(a, b):\\n"], SamplingParams(max_new_tokens=32))
    >>> outs[0].text, outs[0].finish_reason, outs[0].stats.acceptance_rate
    """

    def __init__(self, pair: ModelPair, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.pair = pair
        drafter_name, _ = parse_drafter(self.config.drafter)
        if self.config.speculative and drafter_name == "draft_model" and pair.draft is None:
            raise ValueError(f"method {self.config.method!r} needs a draft model")
        self.device = pair.target.device
        self.timer = StageTimer(self.device, sync=self.config.profile)
        cfg = self.config
        self.target = ModelRunner(pair.target, "target", pair.vocab_size, cfg.block_size, self.timer, cfg.debug,
                                  cfg.forward)
        self.draft_runner = None
        if cfg.speculative and pair.draft is not None:
            self.draft_runner = ModelRunner(pair.draft, "draft", pair.vocab_size, cfg.block_size, self.timer,
                                            cfg.debug, cfg.forward)
        self.context = min(c for c in (context_length(pair.target),
                                       context_length(pair.draft) if self.draft_runner else None,
                                       10**9) if c is not None)
        self.stats = RunStats()
        self.drafter = None
        self._next_id = 0
        self._requests: dict[int, Request] = {}
        self.scheduler = make_scheduler(cfg)
        if cfg.speculative and drafter_name == "draft_model":
            self.drafter = make_drafter(cfg.drafter, draft_runner=self.draft_runner, device=self.device,
                                        vocab_size=pair.vocab_size)

    @classmethod
    def from_pretrained(cls, target: str | None = None, draft: str | None = None,
                        config: EngineConfig | None = None, *, dtype: str | None = None,
                        device: str | None = None) -> SpecEngine:
        config = config or EngineConfig()
        needs_draft = config.speculative and parse_drafter(config.drafter)[0] == "draft_model"
        pair = load_pair(target, draft, dtype=dtype, device=device, need_draft=needs_draft)
        return cls(pair, config)

    @property
    def gamma(self) -> int:
        return self.config.gamma if self.config.speculative else 0

    # ----------------------------------------------------------------------------- requests
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.pair.tokenizer is None:
                raise ValueError("this engine has no tokenizer; pass prompts as lists of token ids")
            if not prompt:
                raise ValueError("empty prompt")
            return list(self.pair.tokenizer(prompt)["input_ids"])
        ids = [int(t) for t in prompt]
        if any(not 0 <= t < self.pair.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {self.pair.vocab_size})")
        return ids

    def check_request(self, ids: list[int], params: SamplingParams, where: str = "prompt") -> None:
        """Raise ValueError if a request cannot be served, before anything runs."""
        if not ids:
            raise ValueError(f"{where} is empty")
        need = len(ids) + params.max_new_tokens + self.gamma
        if len(ids) > self.context:
            raise ValueError(f"{where} has {len(ids)} tokens, longer than the model context ({self.context})")
        if need > self.context:
            raise ValueError(
                f"{where} has {len(ids)} tokens; with max_new_tokens={params.max_new_tokens} and gamma={self.gamma} "
                f"it needs {need} positions but the model context is {self.context}; shorten the prompt or "
                "lower max_new_tokens"
            )

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> int:
        """Queue one request; returns its id. It joins a batch at a later `step()`."""
        params = params or SamplingParams()
        ids = self.encode(prompt)
        self.check_request(ids, params)
        return self._add(ids, params, prompt if isinstance(prompt, str) else None)

    def _add(self, ids: list[int], params: SamplingParams, text: str | None) -> int:
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop.update(self.pair.eos_token_ids)
        req = Request(self._next_id, list(ids), params, frozenset(stop), prompt=text,
                      generator=None if params.greedy else make_generator(params.seed))
        self._next_id += 1
        self._requests[req.index] = req
        self.scheduler.add(req)
        return req.index

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def abort(self, rid: int) -> None:
        """Drop a request (e.g. its client went away), freeing its KV."""
        req = self._requests.pop(rid, None)
        if req is not None:
            self.scheduler.finish(req)
            self._release(req)

    # ----------------------------------------------------------------------------- rounds
    def step(self) -> list[Output]:
        """Admit, run one round, retire. Returns the outputs of requests that finished."""
        admit, batch = self.scheduler.schedule()
        done = [r for r in admit if r.remaining <= 0]
        for r in done:
            r.finish_reason = FinishReason.LENGTH
        admit = [r for r in admit if not r.finished]
        if admit:
            self._prefill(admit)
        batch = [r for r in batch if not r.finished]
        if batch:
            run_round(self, batch)
        finished = done + [r for r in batch if r.finished]
        outputs = []
        for r in finished:
            self.scheduler.finish(r)
            self._release(r)
            self._requests.pop(r.index, None)
            outputs.append(self._output(r))
        return outputs

    def _prefill(self, reqs: list[Request]) -> None:
        with self.timer.stage("verify"):
            tail = self.target.begin(reqs, leave=1)
            if tail > 0:
                self.target.feed(keep=1)
            self.target.commit(reqs, [tail - cp for cp in self.target.layout.tail_pad])
        if self.drafter is not None:
            with self.timer.stage("draft"):
                self.drafter.admit(reqs)

    def _release(self, req: Request) -> None:
        self.target.release(req)
        if self.drafter is not None:
            self.drafter.release(req)

    def _output(self, req: Request) -> Output:
        tok = self.pair.tokenizer
        text = tok.decode(req.output_ids, skip_special_tokens=True) if tok is not None else None
        return Output(index=req.index, prompt=req.prompt, prompt_token_ids=req.token_ids[: req.prompt_len],
                      token_ids=list(req.output_ids), text=text, finish_reason=req.finish_reason.value,
                      stats=req.stats)

    # ----------------------------------------------------------------------------- offline
    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        references: Mapping[tuple[int, ...], list[int]] | None = None,
        progress=None,
    ) -> list[Output]:
        """Generate for every prompt; outputs come back in input order.

        All prompts are validated before anything runs. `references` (prompt ids -> target-only
        greedy output) feed the synthetic oracle drafter; without them it computes its own.
        `progress(n_tokens)` is called as tokens are produced.
        """
        if isinstance(params, SamplingParams) or params is None:
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        encoded = [self.encode(p) for p in prompts]
        for i, (ids, sp) in enumerate(zip(encoded, params)):
            self.check_request(ids, sp, where=f"prompt {i}")
        if self.config.speculative and parse_drafter(self.config.drafter)[0] == "oracle":
            self._make_oracle(encoded, params, references)

        self.stats = RunStats()
        self.timer.reset()
        start = time.perf_counter()
        first = self._next_id
        for ids, sp, p in zip(encoded, params, prompts):
            self._add(ids, sp, p if isinstance(p, str) else None)
        results: dict[int, Output] = {}
        while self.has_unfinished():
            for out in self.step():
                results[out.index] = out
                if progress is not None:
                    progress(len(out.token_ids))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stats.wall = time.perf_counter() - start
        self.stats.stage_time = dict(self.timer.totals)
        return [results[first + i] for i in range(len(prompts))]

    def _make_oracle(self, encoded, params, references) -> None:
        """Give the synthetic oracle drafter the target-only greedy output of every prompt."""
        if any(not p.greedy for p in params):
            raise ValueError("the oracle drafter proposes the target's greedy output; use temperature 0")
        if self.drafter is None:
            self.drafter = make_drafter(self.config.drafter, draft_runner=self.draft_runner, device=self.device,
                                        vocab_size=self.pair.vocab_size, references={})
        refs = self.drafter.references
        refs.update(references or {})
        missing = [ids for ids in encoded if tuple(ids) not in refs]
        if missing:
            baseline = SpecEngine(self.pair, EngineConfig(method="autoregressive",
                                                          batch_size=self.config.batch_size))
            sp = SamplingParams(max_new_tokens=max(p.max_new_tokens for p in params))
            for ids, out in zip(missing, baseline.generate(missing, sp)):
                refs[tuple(ids)] = out.token_ids
