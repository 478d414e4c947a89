"""The user-facing engine: `generate()` and `stream()` for offline work, `add_request()` / `step()`
/ `abort()` underneath, which is what a server drives.

Each `step()` is one round boundary and does, in order:
    1. take in requests added and aborts asked for since the last step (from any thread);
    2. admit waiting requests into free rows of the KV buffer (the scheduler's policy);
    3. choose which requests still prefilling join this round with their prompts (`_fusable`) and
       run one prefill chunk (at most `max_prefill_tokens` slots) for the others;
    4. choose the decoding batch and, if its rows lie too far apart, move rows closer;
    5. run one draft-and-verify round on the batch, prefilling the joining requests in its pass;
    6. report every request that advanced or ended: its new token ids and text, and how it ended.

Memory: each model's KV lives in one buffer of R rows x C columns (`core/rows.py`), allocated
once: R is the number of resident requests (the batch size, or exspec's window), C the longest
request a row can hold (`max_kv_tokens` / R, by default the model context). A request is
checked against C when it is added, so a running request can always grow: there is nothing to
preempt, and requests wait in the queue only for a free row.

Threads: `add_request()` and `abort()` may be called from any thread; they queue work that the
next `step()` takes in. `step()`, `generate()` and `stream()` belong to one thread, the one that
owns the models.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace

import torch

from .config import EngineConfig
from .core.detok import TextStream
from .core.request import FinishReason, Output, Request, StepOutput
from .core.runner import ModelRunner, content_ids, kv_shape
from .core.stats import RunStats, StageTimer
from .decode import run_round
from .drafters import drafter_needs_model, drafter_requires_model, drafter_uses_model, make_drafter, missing_draft
from .models import ModelPair, context_length
from .sampling import SamplingParams, make_generator
from .sched import make_scheduler, plan_prefill
from .sched.policy import SpecPolicy
from .sched.profile import cost_table
from .sched.slots import SlotTable, arrange

KV_MEMORY_FRACTION = 0.5  # at most this share of the memory free at start-up, when no --max-kv-tokens is given


class SpecEngine:
    """Batch speculative decoding over a target and a draft model.

    >>> engine = SpecEngine.from_pretrained()                       # the bundled pair
    >>> outs = engine.generate(["def add(a, b):\\n"], SamplingParams(max_new_tokens=32))
    >>> outs[0].text, outs[0].finish_reason, outs[0].stats.acceptance_rate
    >>> for out in engine.stream(["class Stack:\\n"]):               # per-round text as it is verified
    ...     print(out.new_text, end="")
    """

    def __init__(self, pair: ModelPair, config: EngineConfig | None = None) -> None:
        self.config = cfg = config or EngineConfig()
        self.pair = pair
        if cfg.speculative and drafter_requires_model(cfg.drafter) and pair.draft is None:
            raise ValueError(missing_draft(cfg.drafter))
        self.device = pair.target.device
        self.timer = StageTimer(self.device, sync=cfg.profile)
        # a model-free drafter leaves the draft model unused: no runner, no KV, no context limit
        draft_model = pair.draft if cfg.speculative and drafter_uses_model(cfg.drafter) else None
        self.context = min(c for c in (context_length(pair.target),
                                       context_length(draft_model) if draft_model else None, 10**9) if c is not None)
        self.rows = cfg.effective_window
        self.row_capacity = self._row_capacity(pair.target, draft_model)
        self.kv_tokens = self.rows * self.row_capacity
        runner = dict(vocab_size=pair.vocab_size, rows=self.rows, capacity=self.row_capacity, timer=self.timer,
                      debug=cfg.debug, forward=cfg.forward)
        self.target = ModelRunner(pair.target, "target", **runner)
        self.draft_runner = ModelRunner(draft_model, "draft", **runner) if draft_model is not None else None
        self.slots = SlotTable(self.rows)
        self.stats = RunStats()  # the engine's whole life
        self.last_run: RunStats | None = None  # the last generate() / stream() call's own numbers
        self._runs: list[RunStats] = []  # open generate() / stream() calls
        self._lock = threading.Lock()
        self._inbox: list[tuple[str, Request | int]] = []
        self._next_id = 0
        self._requests: dict[int, Request] = {}  # taken in and not yet ended
        self._stashed: list[StepOutput] = []  # other requests' outputs drawn by stream(): the next step() returns them
        self.scheduler = make_scheduler(cfg)
        self.drafter = self.policy = None
        self.trace = None  # a `sched.replay.TraceRecorder` records every round when set
        if cfg.speculative:
            self.drafter = make_drafter(cfg.drafter, draft_runner=self.draft_runner, device=self.device,
                                        vocab_size=pair.vocab_size, compute_reference=self._oracle_reference,
                                        draft_window=cfg.draft_window, forward=cfg.forward, target=pair.target,
                                        head=pair.head)
            self.policy = self._policy()

    @classmethod
    def from_pretrained(cls, target: str | None = None, draft: str | None = None,
                        config: EngineConfig | None = None, *, dtype: str | None = None,
                        device: str | None = None) -> SpecEngine:
        from .models import load_pair

        config = config or EngineConfig()
        if config.speculative and drafter_requires_model(config.drafter) and target is not None and draft is None:
            raise ValueError(missing_draft(config.drafter))  # before loading the target
        needs_draft = config.speculative and drafter_needs_model(config.drafter)
        pair = load_pair(target, draft, dtype=dtype, device=device, need_draft=needs_draft)
        return cls(pair, config)

    @property
    def gamma(self) -> int:
        return self.config.gamma if self.config.speculative else 0

    @property
    def siblings(self) -> int:
        """Runner-ups per depth a greedy row may verify: --siblings, at most what the drafter gives."""
        return min(self.config.siblings, self.drafter.runner_ups) if self.drafter is not None else 0

    def _policy(self) -> SpecPolicy:
        """The scheduling policy; adaptive, it prices rounds by a cost table measured once for these
        models on this machine (a few seconds, cached: sched/profile.py)."""
        cfg = self.config
        table = None
        if cfg.adaptive:
            table = cost_table(self.pair.target, self.drafter, self.pair.draft if self.draft_runner else None,
                               cfg.batch_size, cfg.gamma, cfg.forward, self.siblings)
            table = replace(table, scale=dict(table.scale), _by_rows={}, _seen={}, _passes=0)  # (corrected per engine)
        return SpecPolicy(cfg.gamma, table, cfg.budget, sources=self.drafter.sources,
                          confident=self.drafter.confident, sibling_width=self.siblings)

    def _row_capacity(self, target, draft) -> int:
        """Columns per row: `max_kv_tokens` / rows, or the model context (+ one round), capped so
        that all rows of both models take at most a share of the free memory."""
        if self.config.max_kv_tokens is not None:
            return max(1, self.config.max_kv_tokens // self.rows)
        per_token = sum(_kv_bytes_per_token(m) for m in (target, draft) if m is not None)
        if self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
        else:
            import psutil

            free = psutil.virtual_memory().available
        afford = int(KV_MEMORY_FRACTION * free / per_token) // self.rows
        return max(1, min(self.context + self.gamma + 1, afford))

    # ----------------------------------------------------------------------------- requests
    def encode(self, prompt: str | Sequence[int], add_special_tokens: bool | None = None) -> list[int]:
        """Token ids of a prompt. Text gets the tokenizer's special tokens (BOS) unless it already
        starts with the BOS text (e.g. it went through a chat template) or `add_special_tokens` is False."""
        if isinstance(prompt, str):
            tok = self.pair.tokenizer
            if tok is None:
                raise ValueError("this engine has no tokenizer; pass prompts as lists of token ids")
            if not prompt:
                raise ValueError("empty prompt")
            if add_special_tokens is None:
                bos = getattr(tok, "bos_token", None)
                add_special_tokens = not (bos and prompt.startswith(bos))
            return list(tok(prompt, add_special_tokens=add_special_tokens)["input_ids"])
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
        if need > self.row_capacity:
            raise ValueError(f"{where} needs up to {need} KV tokens (prompt {len(ids)} + max_new_tokens "
                             f"{params.max_new_tokens} + gamma {self.gamma}) but a row of the KV budget holds "
                             f"{self.row_capacity} ({self.kv_tokens} tokens over {self.rows} rows); raise "
                             "--max-kv-tokens or lower max_new_tokens")
        if params.stop and self.pair.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine has none (use stop_token_ids)")
        if self.drafter is not None and self.drafter.synthetic and not params.greedy:
            raise ValueError("the oracle drafter proposes the target's greedy output; use temperature 0")

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                    add_special_tokens: bool | None = None) -> int:
        """Queue one request (from any thread); returns its id. It is taken in at the next `step()`."""
        params = params or SamplingParams()
        ids = self.encode(prompt, add_special_tokens)
        self.check_request(ids, params)
        return self._add(ids, params, prompt if isinstance(prompt, str) else None)

    def _add(self, ids: list[int], params: SamplingParams, text: str | None, job: bool = False) -> int:
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop.update(self.pair.eos_token_ids)
        tok = self.pair.tokenizer
        with self._lock:
            req = Request(self._next_id, list(ids), params, frozenset(stop), prompt=text, job=job,
                          generator=None if params.greedy else make_generator(params.seed),
                          text=TextStream(tok, params.stop) if tok is not None else None)
            self._next_id += 1
            self._inbox.append(("add", req))
        return req.index

    def abort(self, rid: int) -> None:
        """End a request (from any thread; e.g. its client went away). It takes effect at the next
        round boundary: the request's KV is freed in both models and `step()` reports it once,
        with finish_reason "abort". Ids that already ended are ignored."""
        with self._lock:
            self._inbox.append(("abort", rid))

    def has_unfinished(self) -> bool:
        """Whether `step()` has anything to do or report."""
        return bool(self._inbox or self._requests or self._stashed)

    def num_waiting(self) -> int:
        return len(self.scheduler) + sum(1 for kind, _ in self._inbox if kind == "add")

    def num_running(self) -> int:
        return len(self.scheduler.resident)

    def kv_tokens_in_use(self) -> int:
        """Target KV tokens committed by resident requests."""
        return sum(r.kv_len.get("target", 0) for r in self.scheduler.resident)

    # ----------------------------------------------------------------------------- rounds
    def step(self) -> list[StepOutput]:
        """One round boundary (see the module docstring). Returns a StepOutput for every request
        that produced tokens or ended in this step."""
        start, stage_start = time.perf_counter(), dict(self.timer.totals)
        stats = RunStats()
        outputs, self._stashed = self._stashed, []
        ended = self._take_inbox(stats)
        self.scheduler.admit(self._try_admit)
        self._rope_regimes(stats)
        prefilling = [r for r in self.scheduler.resident if not r.prefilled]
        fused = self._fusable(prefilling)
        joining = {r.index for r in fused}
        rest = [r for r in prefilling if r.index not in joining]
        if rest:
            self._prefill(rest, stats)
        if fused and not (self.drafter is not None and self.drafter.features):  # (those read the round's pass)
            fused = sorted(fused, key=lambda r: r.slot)
            self._prefill_drafter(fused, [r.num_tokens - 1 for r in fused])
        batch = self._arrange(self.scheduler.next_batch() + fused, stats)
        if batch:
            run_round(batch, self.target, self.drafter, self.policy, self.gamma, self.timer, stats, self.trace,
                      self._draining(batch))
        stats.peak_kv_tokens = self.kv_tokens_in_use()
        outputs.extend(self._report(r) for r in batch)
        for r in batch:
            if r.finished:
                self._end(r)
        outputs.extend(self._report(r) for r in ended)
        stats.finished = sum(1 for o in outputs if o.finished)
        stats.wall = time.perf_counter() - start
        stats.stage_time = self.timer.since(stage_start)
        for sink in (self.stats, *self._runs):
            sink.merge(stats)
        return outputs

    def _draining(self, batch: list[Request]) -> bool:
        """Whether this round's batch is a job's last (`SpecPolicy.worth`): every request in
        flight came with a closed set of prompts (`submit`, `generate`: no more will come), none
        waits, and all run in this batch. A server's requests (`add_request`) never drain: more
        may arrive at any moment, and each one's own latency is what matters."""
        resident = self.scheduler.resident
        return (not self._inbox and not len(self.scheduler) and len(batch) == len(resident)
                and all(r.job for r in resident))

    def _take_inbox(self, stats: RunStats) -> list[Request]:
        """Take in queued requests and aborts; returns the requests that ended here."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
        ended = []
        for kind, item in inbox:
            if kind == "add":
                self._requests[item.index] = item
                if item.remaining <= 0:  # max_new_tokens = 0
                    item.finish_reason = FinishReason.LENGTH
                    self._requests.pop(item.index)
                    ended.append(item)
                else:
                    self.scheduler.add(item)
            elif (req := self._requests.get(item)) is not None:
                req.finish_reason = FinishReason.ABORT
                stats.aborted += 1
                self._end(req)
                ended.append(req)
        return ended

    def _rope_regimes(self, stats: RunStats) -> None:
        """LongRoPE models: a row that grew past the limit is recomputed in the long regime."""
        for runner in (self.target, self.draft_runner):
            if runner is not None and runner.rope_limit is not None:
                for r in self.scheduler.resident:
                    if runner.enter_long_rope(r):
                        stats.recomputed_rows += 1

    def _try_admit(self, req: Request) -> bool:
        """Give `req` a free row of the KV buffer (a row always holds a whole request: checked when
        it was added)."""
        if not self.slots.free:
            return False
        req.slot = self.slots.take()
        return True

    @property
    def fuses_prefill(self) -> bool:
        """Whether requests join rounds with their prompts (see `_fusable`)."""
        return (self.config.fuse_prefill and self.scheduler.runs_every_resident
                and self.target.forward.selects_before_head)

    def _fusable(self, prefilling: list[Request]) -> list[Request]:
        """The requests still prefilling that join this step's round with their prompts
        (`decode/round.py`): each is fed its whole unseen prompt inside the round's target pass and
        takes its first token from it, so it costs the pass its tokens but no forward of its own (a
        forward's fixed cost is a whole plain step at small batch sizes: on the Xeon, a one-row
        prefill of 20 tokens 8.1 ms, a step of 8 rows 8.7 ms, the two in one pass 13.1 ms). Where
        every resident request runs each round (autoregressive, eqspec), up to
        `max_prefill_tokens` prompt tokens; longer prompts are prefilled in chunks first; and
        where the target's forward runs the LM head on the verified columns only (the lean
        forward; through the transformers modules every prompt token would get logits). A
        seeded sampled request is prefilled apart: joining, it drafts nothing in its first round,
        and which uniforms serve which token must not depend on its batch (decode/round.py)."""
        if not self.fuses_prefill:
            return []
        out, budget = [], self.config.max_prefill_tokens
        for r in prefilling:
            lead = r.num_tokens - 1 - r.kv_len.get("target", 0)
            if lead <= budget and (r.params.greedy or r.params.seed is None):
                out.append(r)
                budget -= lead
        return out

    def _prefill_drafter(self, reqs: list[Request], ends: list[int], hidden=None, counts=None) -> None:
        """The drafter's prefill of `reqs` (in slot order) up to `ends`; `hidden`: the target's
        features of the chunk (`counts` tokens a row), for a drafter that reads them."""
        if self.drafter is not None:
            with self.timer.stage("prefill"):
                self.drafter.prefill(reqs, ends, hidden, counts)

    def _prefill(self, reqs: list[Request], stats: RunStats) -> None:
        """One prefill chunk: at most max_prefill_tokens slots (rows x width) of prompt tokens."""
        todo = [r.num_tokens - 1 - r.kv_len.get("target", 0) for r in reqs]
        chunk = plan_prefill(todo, self.config.max_prefill_tokens)
        rows = sorted(((r, n) for r, n in zip(reqs, chunk) if n > 0), key=lambda rn: rn[0].slot)
        reqs, counts = [r for r, _ in rows], [n for _, n in rows]
        ends = [r.kv_len.get("target", 0) + n for r, n in rows]
        features = self.drafter.features if self.drafter is not None else None
        with self.timer.stage("prefill"):
            out = self.target.feed(reqs, content_ids(reqs, ends, counts, self.device), counts, logits="none",
                                   **({"hidden": features} if features else {}))
            self.target.commit(reqs, counts)
        self._prefill_drafter(reqs, ends, out[1] if features else None, counts)
        stats.prefill_forwards += 1
        stats.prefill_tokens += sum(counts)

    def _arrange(self, batch: list[Request], stats: RunStats) -> list[Request]:
        """The batch in slot order, its rows first moved closer together if they are spread out
        (only rows whose place in the batch changed are moved; see `sched.slots.arrange`)."""
        if not batch:
            return batch
        by_slot = {r.slot: r for r in self.scheduler.resident}
        pairs = arrange([r.slot for r in batch], set(by_slot))
        if pairs:
            for runner in (self.target, self.draft_runner):
                if runner is not None:
                    runner.move(pairs, [by_slot[src].kv_len.get(runner.name, 0) for src, _ in pairs])
            for src, dst in pairs:
                by_slot[src].slot = dst
            self.slots.moved(pairs)
            stats.moved_rows += len(pairs)
        return sorted(batch, key=lambda r: r.slot)

    def _release(self, req: Request) -> None:
        self.target.release(req)
        if self.drafter is not None:
            self.drafter.release(req)
        req.kv_len.clear()
        if req.slot is not None:
            self.slots.give(req.slot)
            req.slot = None

    def _end(self, req: Request) -> None:
        self.scheduler.finish(req)
        self._release(req)
        self._requests.pop(req.index, None)

    def _report(self, req: Request) -> StepOutput:
        new = req.output_ids[req.reported:]
        req.reported += len(new)
        text = req.text.take(final=req.finished) if req.text is not None else None
        return StepOutput(req.index, new, text, req.finish_reason.value if req.finished else None,
                          self._output(req) if req.finished else None)

    def _output(self, req: Request) -> Output:
        return Output(index=req.index, prompt=req.prompt, prompt_token_ids=req.token_ids[: req.prompt_len],
                      token_ids=list(req.output_ids), text=req.text.text if req.text is not None else None,
                      finish_reason=req.finish_reason.value, stats=req.stats)

    # ----------------------------------------------------------------------------- offline
    def stream(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        references: Mapping[tuple[int, ...], list[int]] | None = None,
    ) -> Iterator[StepOutput]:
        """Run `prompts` to completion, yielding each round's StepOutput for them as it happens
        (`index`, here and in the final `output`, is the position in `prompts`). Requests queued
        earlier with `add_request()` keep running alongside; their outputs are kept for the next
        `step()`. Closing the iterator early aborts the prompts not yet finished. `last_run`
        holds this call's statistics."""
        ids = self.submit(prompts, params, references=references)  # all validated before any is queued
        position = {rid: i for i, rid in enumerate(ids)}
        open_ids, others = set(ids), []
        with self.recording() as run:
            start = time.perf_counter()
            try:
                while open_ids:
                    outs = self.step()
                    if not outs and not self.has_unfinished():
                        raise RuntimeError("the engine stopped with requests unfinished; this is a bug")
                    for out in outs:
                        if out.index not in position:
                            others.append(out)
                            continue
                        if out.finished:
                            open_ids.discard(out.index)
                        i = position[out.index]
                        yield replace(out, index=i, output=replace(out.output, index=i) if out.output else None)
            finally:
                for rid in open_ids:  # closed early: the aborts take effect at the next step()
                    self.abort(rid)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                run.wall = time.perf_counter() - start  # the whole call, not only its steps
                self._stashed = others + self._stashed

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
        `progress(n_tokens)` is called as each prompt finishes. Requests queued earlier with
        `add_request()` keep running; their outputs come from the next `step()`.
        """
        results: list[Output | None] = [None] * len(prompts)
        for out in self.stream(prompts, params, references=references):
            if out.finished:
                results[out.index] = out.output
                if progress is not None:
                    progress(len(out.output.token_ids))
        return results

    def submit(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        references: Mapping[tuple[int, ...], list[int]] | None = None,
    ) -> list[int]:
        """Queue every prompt, all validated before any is queued (as `generate` does); returns
        their request ids, in order. For callers that drive `step()` themselves."""
        encoded, params = self._prepare(prompts, params, references)
        return [self._add(ids, sp, p if isinstance(p, str) else None, job=True)
                for ids, sp, p in zip(encoded, params, prompts)]

    @contextmanager
    def recording(self) -> Iterator[RunStats]:
        """The statistics of every `step()` taken inside the block, summed (their `wall` is the
        steps' own time); `last_run` holds them afterwards. `generate()` and `stream()` record
        this way; a caller that drives `step()` itself can too (`bench` runs engines step by
        step, in turn, so that a shared machine's drift falls on all of them alike)."""
        run = RunStats()
        self._runs.append(run)
        try:
            yield run
        finally:
            self._runs.remove(run)
            self.last_run = run

    def _prepare(self, prompts, params, references) -> tuple[list[list[int]], list[SamplingParams]]:
        if isinstance(params, SamplingParams) or params is None:
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        encoded = [self.encode(p) for p in prompts]
        for i, (ids, sp) in enumerate(zip(encoded, params)):
            self.check_request(ids, sp, where=f"prompt {i}")
        if self.drafter is not None and self.drafter.synthetic:
            self._oracle_references(encoded, params, references)
        return encoded, list(params)

    # ----------------------------------------------------------------------------- oracle drafter
    def _oracle_references(self, encoded, params, references) -> None:
        """Give the synthetic oracle drafter the target-only greedy output of every prompt, computed
        together in one batch (requests added with `add_request()` get theirs one by one)."""
        refs = self.drafter.references
        refs.update(references or {})
        missing = [ids for ids in encoded if tuple(ids) not in refs]
        if missing:
            sp = SamplingParams(max_new_tokens=max(p.max_new_tokens for p in params))
            for ids, out in zip(missing, self._baseline().generate(missing, sp)):
                refs[tuple(ids)] = out.token_ids

    def _oracle_reference(self, req: Request) -> list[int]:
        prompt = req.token_ids[: req.prompt_len]
        sp = SamplingParams(max_new_tokens=req.params.max_new_tokens, stop_token_ids=req.params.stop_token_ids,
                            ignore_eos=req.params.ignore_eos)
        return self._baseline().generate([prompt], sp)[0].token_ids

    def _baseline(self) -> SpecEngine:
        return SpecEngine(self.pair, EngineConfig(method="autoregressive", batch_size=self.config.batch_size,
                                                  forward=self.config.forward))


def _kv_bytes_per_token(model) -> int:
    layers, heads, head_dim = kv_shape(model)
    return layers * 2 * heads * head_dim * torch.empty(0, dtype=model.dtype).element_size()
