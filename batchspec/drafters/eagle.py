"""Drafting with an EAGLE head (batchspec/eagle/head.py) from the target's own hidden states.

Each request owns a row of the head's KV (`HeadKV`, its own buffer, rows by request). Entry p of
a row pairs the token x_p with the target's feature f_{p-1}; `req.kv_len["eagle"]` counts the
entries committed, all of them from real features. A row starts at the first position whose
feature the drafter was given (`_Row.base`): entry column k holds (x_{base+k+1}, f_{base+k}).

A round, for a row whose newest token is x_T (the target holds x_0..x_{T-1}):
    propose   feeds the entries the row has not entered (tokens up to x_T, features up to f_{T-1},
              all known from earlier passes) and commits them; their last output drafts d_1; then
              each d_j is entered with the head's own output as its feature (beyond the committed
              length: never committed) and drafts d_{j+1}. d_g is never entered.
    observe   the verify pass's features of x_T and the accepted drafts d_1..d_a (positions T..T+a)
              become pending; those of rejected drafts are dropped, and the draft entries written
              past the committed length are overwritten by the next round.
So rejection is a length that does not move, and no entry is ever written from a drafted feature
and kept. Features arrive in order: positions a row gets must follow what it holds; a gap (a
round whose features the drafter was not given) restarts the row from the new features.

Sampling: q is the head's softmax after the row's temperature / top-k / top-p (`probabilities`),
over the target vocabulary; a reduced draft vocabulary scatters its logits into it, -inf (q = 0)
elsewhere. Greedy rows take the argmax.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..core.request import Request
from ..eagle.head import EagleHead, span
from ..sampling import BatchSampling, probabilities, sample
from .base import DraftProposal, RoundOutcome

if TYPE_CHECKING:
    from ..sched.gate import Gate


RUNNER_UPS = 3  # next-best tokens a greedy draft reports at each depth (siblings: sched/siblings.py)


class _Row:
    """A request's row: its KV slot, its first feature's position, the features not entered yet
    (`pending` [k, F], positions base + committed ..: kept as the chunks rounds add, joined when
    read, so that rounds that do not draft cost no copy of what piled up), and `tail` [1, F], the
    feature of the last committed entry (to enter it again)."""

    def __init__(self, slot: int, base: int, feats: torch.Tensor) -> None:
        self.slot, self.base, self.tail = slot, base, None
        self.pending = feats

    @property
    def pending(self) -> torch.Tensor:
        if len(self._chunks) > 1:
            self._chunks = [torch.cat(self._chunks)]
        return self._chunks[0]

    @pending.setter
    def pending(self, feats: torch.Tensor) -> None:
        self._chunks, self.waiting = [feats], feats.shape[0]

    def extend(self, feats: torch.Tensor) -> None:
        self._chunks.append(feats)
        self.waiting += feats.shape[0]


class EagleDrafter:
    label = "eagle"
    synthetic = False
    sources = (False,)
    confident = True  # each draft's max q is known before it is drawn: its rows can be gated (sched/gate.py)
    runner_ups = RUNNER_UPS
    name = "eagle"  # its key in `Request.kv_len`

    def __init__(self, head: EagleHead, vocab_size: int, dtype: torch.dtype | None = None) -> None:
        if head.embed is None:
            raise ValueError("attach the head to its target before drafting with it (head.attach(target))")
        self.head, self.vocab_size = head.eval(), vocab_size
        self.features: tuple[int, ...] = tuple(head.spec.layers)
        self.device = head.q_proj.weight.device
        if dtype is not None and dtype != head.q_proj.weight.dtype:  # (`auto_dtype`: the default the CLI takes)
            head.cast(dtype)
            self.label = f"eagle ({str(dtype).removeprefix('torch.')})"
        self.dtype = head.q_proj.weight.dtype
        self._ids = head.target_ids  # [V_draft] target id of each draft id, ascending (None: the same)
        # every draft id a real target id (read once: a device read each step would wait for the device)
        self._within = self._ids is None or int(self._ids[-1]) < vocab_size
        self.kv = head.new_kv(rows=8, capacity=256)
        self.state: dict[int, _Row] = {}  # request index -> its row
        self.free: list[int] = []
        self._newest: dict[int, int] = {}  # request index -> T, its newest token's position, at propose

    # ----------------------------------------------------------------------------- rows
    def _committed(self, req: Request) -> int:
        return req.kv_len.get(self.name, 0)

    def _have(self, req: Request) -> int | None:
        """The first position whose feature the row lacks (None: no row)."""
        row = self.state.get(req.index)
        return None if row is None else row.base + self._committed(req) + row.waiting

    def _add(self, req: Request, start: int, feats: torch.Tensor, replace: bool = False) -> None:
        """The target's features of positions start.. ([m, F]) for req's row. Overlapping what the
        row holds: kept once, or (`replace`, a row the target fed again) these replace the row's
        from `start` on, and committed entries built on the old ones are uncommitted."""
        feats = feats.detach().to(self.device, self.dtype)
        have = self._have(req)
        row = self.state.get(req.index)
        if replace and have is not None and row.base < start < have:
            keep, c = start - row.base, self._committed(req)  # entry k reads the feature of base + k
            if keep <= c:
                req.kv_len[self.name] = keep
                row.pending, row.tail = feats, None
            else:
                row.pending = torch.cat([row.pending[:keep - c], feats])
            return
        if have is not None and start <= have and not (replace and start <= row.base):
            row.extend(feats[have - start:])  # follows what the row holds
            return
        if row is None:
            slot = self.free.pop() if self.free else len(self.state) + len(self.free)
            row = self.state[req.index] = _Row(slot, start, feats)
        else:  # a gap, or all of it fed again: start the row again from these features
            row.base, row.pending, row.tail = start, feats, None
        req.kv_len[self.name] = 0

    def _enter(self, reqs: list[Request], upto: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed each row its pending entries up to position upto[i] (at least one: the last
        committed entry again when none is pending) and commit them. Returns the last entry's
        (logits [b, V_draft], output [b, H]) per row."""
        rows, tokens, feats, starts, counts = [], [], [], [], []
        for r, end in zip(reqs, upto):
            row = self.state[r.index]
            c = self._committed(r)
            k = min(row.waiting, end - row.base - c)  # entries c.. up to position `end`
            if k <= 0 and row.tail is None:
                raise RuntimeError(f"eagle: request {r.index} has nothing to enter")
            if k <= 0:  # everything is entered: enter the last entry again for its output
                c -= 1
                r.kv_len[self.name] = c
                row.pending = torch.cat([row.tail, row.pending])
                k = 1
            first = row.base + c + 1  # position of the first token entered
            rows.append(row.slot)
            tokens.append(r.token_ids[first:first + k])
            feats.append(row.pending[:k])
            starts.append(c)
            counts.append(k)
        n = max(counts)
        ids = torch.tensor([t + [0] * (n - len(t)) for t in tokens], dtype=torch.long, device=self.device)
        hidden = torch.stack([torch.cat([f, f.new_zeros(n - f.shape[0], f.shape[1])]) for f in feats])
        with torch.no_grad():
            logits, out = self.head.step(self.kv, rows, ids, hidden, starts, counts, last=True)
        last = torch.tensor(counts, device=self.device) - 1
        at = torch.arange(len(reqs), device=self.device)
        for r, k in zip(reqs, counts):
            row = self.state[r.index]
            row.tail = row.pending[k - 1:k]
            row.pending = row.pending[k:]
            r.kv_len[self.name] = self._committed(r) + k
        return logits[:, 0], out[at, last]

    # ----------------------------------------------------------------------------- protocol
    def step_probe(self, rows: int, context: int = 256) -> Callable[[], float]:
        """One draft step of `rows` rows at `context` committed entries each (a scratch buffer)."""
        kv = self.head.new_kv(rows=rows, capacity=context + 1)
        ids = torch.zeros(rows, 1, dtype=torch.long, device=self.device)
        hidden = torch.zeros(rows, 1, self.head.config.hidden_size, device=self.device, dtype=kv.data.dtype)

        def probe() -> float:
            started = time.perf_counter()
            with torch.no_grad():
                logits, _ = self.head.step(kv, list(range(rows)), ids, hidden, [context] * rows)
                logits.sum().item()  # (waits for the device)
            return time.perf_counter() - started
        return probe

    def offer(self, reqs: list[Request], caps: list[int]) -> list[int | None]:
        return [None] * len(reqs)  # every row is drafted by a head step

    def prefill(self, reqs: list[Request], ends: list[int], hidden: torch.Tensor | None = None,
                counts: list[int] | None = None) -> None:
        """`hidden` [b, n, F]: the target's features of the chunk's fed columns, row i's first
        (left-aligned, as `ModelRunner.feed` returns them); row i's chunk is tokens [ends[i] -
        counts[i], ends[i]) or, without counts, from where the row's features end (0 for a new
        row) to ends[i]. With counts, features of positions the row holds replace its own (the
        target fed them again). The entries whose tokens are known are entered at once."""
        if hidden is None:
            return  # (a row given no features restarts at its first verify pass)
        for i, (r, end) in enumerate(zip(reqs, ends)):
            start = end - counts[i] if counts is not None else (self._have(r) or 0)
            if counts is None and end <= start:
                continue  # (a chunk it holds already, fed again: pass counts to say where it starts)
            if not 0 <= end - start <= hidden.shape[1]:
                raise ValueError(f"eagle prefill: request {r.index}'s chunk [{start}, {end}) does not fit the "
                                 f"{hidden.shape[1]} columns given; pass counts")
            self._add(r, start, hidden[i, :end - start], replace=counts is not None)
        ready = [(r, r.num_tokens - 1) for r in reqs if r.index in self.state]
        ready = [(r, u) for r, u in ready if self.state[r.index].waiting
                 and u > self.state[r.index].base + self._committed(r)]
        if ready:
            self._enter([r for r, _ in ready], [u for _, u in ready])

    def propose(self, reqs: list[Request], lengths: list[int], uniforms: torch.Tensor | None,
                sampling: BatchSampling, gate: Gate | None = None) -> DraftProposal:
        """Draft lengths[i] tokens for row i; a row without the features of its newest positions
        (never prefilled with features, or a round it missed) drafts none this round. With a `gate`
        (sched/gate.py) lengths[i] is row i's most and the gate stops the rows it steers: each
        depth's step runs for the rows it lets go on, and a row's length is where it stopped."""
        b, g = len(reqs), max(lengths, default=0)
        asked, lengths = list(lengths), list(lengths)
        for i, r in enumerate(reqs):
            newest = r.num_tokens - 1
            if lengths[i] > 0 and (self._have(r) or -1) < newest:
                lengths[i] = 0  # its newest entry's feature is unknown
                if gate is not None:
                    gate.drop(i)
            if lengths[i] > 0:
                self._newest[r.index] = newest
        tokens = torch.zeros(b, g, dtype=torch.long, device=self.device)
        probs = None if sampling.all_greedy else torch.zeros(b, g, self.vocab_size, device=self.device)
        confidence = torch.zeros(b, g, device=self.device)
        ups = (torch.zeros(b, g, RUNNER_UPS, dtype=torch.long, device=self.device),
               torch.zeros(b, g, RUNNER_UPS, device=self.device)) if probs is None else None
        live = [i for i in range(b) if lengths[i] > 0]
        at = list(range(len(live)))  # the rows (indices into live) whose logits are of this depth
        going = set(gate.live()) if gate is not None else None
        if live:
            logits, out = self._enter([reqs[i] for i in live], [reqs[i].num_tokens - 1 for i in live])
            columns = [self._committed(reqs[i]) for i in live]
            rows = live  # (the batch rows of `at`)
            for j in range(g):
                if j > 0:
                    at = [k for k, i in enumerate(live) if (i in going if going is not None and gate.steered[i]
                                                            else lengths[i] > j)]
                    if not at:
                        break
                    rows = [live[k] for k in at]
                    every = len(at) == len(live)  # (every live row goes on: slices, no index tensors)
                    ids = tokens[span(rows), j - 1][:, None]
                    with torch.no_grad():
                        step_logits, step_out = self.head.step(
                            self.kv, [self.state[reqs[live[k]].index].slot for k in at], ids,
                            (out if every else out[at])[:, None], [columns[k] + j - 1 for k in at])
                    if every:
                        logits, out = step_logits[:, 0], step_out[:, 0]
                    else:
                        logits, out = logits.clone(), out.clone()
                        logits[at], out[at] = step_logits[:, 0], step_out[:, 0]
                confidence[span(rows), j] = self._draft(j, live, at, logits, tokens, probs, uniforms, sampling, ups)
                if gate is not None:
                    steered = [i for i in rows if i in going]
                    if steered:
                        going = set(gate.step(j + 1, steered, confidence[steered, j].tolist()))
            if gate is not None:
                lengths = gate.settle()
        return DraftProposal(tokens, probs, lengths=lengths if lengths != asked else None, confidence=confidence,
                             runner_ups=ups[0] if ups else None, runner_up_q=ups[1] if ups else None)

    def _runner_ups(self, j: int, live: list[int], at: list[int], logq: torch.Tensor, best: torch.Tensor,
                    ups: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Rows live[at]'s RUNNER_UPS next-best tokens after their draft at depth j, and their q, from
        their log q [len(at), V_draft] (overwritten)."""
        if not at:
            return
        logq.scatter_(-1, best[span(at)][:, None], float("-inf"))  # (the draft itself is not its own runner-up)
        top = logq.topk(min(RUNNER_UPS, logq.shape[-1] - 1), dim=-1)
        rows, width = span([live[k] for k in at]), top.indices.shape[-1]
        ups[0][rows, j, :width] = top.indices if self._ids is None else self._ids[top.indices]
        ups[1][rows, j, :width] = top.values.exp()

    def _target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [b, V_draft] -> over the target vocabulary [b, V], -inf outside the draft's."""
        ids = self.head.target_ids
        if ids is None:
            return logits[:, : self.vocab_size].float()
        full = logits.new_full((logits.shape[0], max(self.vocab_size, int(ids.max()) + 1)), float("-inf")).float()
        full[:, ids] = logits.float()
        return full[:, : self.vocab_size]

    def _draft(self, j: int, live: list[int], at: list[int], logits: torch.Tensor, tokens: torch.Tensor, probs,
               uniforms, sampling: BatchSampling, ups=None) -> torch.Tensor:
        """Draft token j of the live rows from their logits [len(live), V_draft]; returns the
        confidence of rows live[at] (max q: the greedy head's softmax, or the q a sampled row draws
        from), read off the distribution, never off the drawn token. Greedy (`ups`: runner-ups and
        their q [B, g, RUNNER_UPS]): the rows' next-best tokens at depth j too."""
        ids = self._ids
        if probs is None and self._within:
            # greedy: the argmax over the draft vocabulary, mapped (ids ascend: the same ties)
            scores = (logits[:, : self.vocab_size] if ids is None else logits).float()
            best = scores.argmax(-1)
            tokens[span(live), j] = best if ids is None else ids[best]
            s = scores[span(at)]
            logq = s - s.logsumexp(-1, keepdim=True)  # [len(at), V_draft]
            sure = logq.amax(-1).exp()
            if ups is not None:
                self._runner_ups(j, live, at, logq, best, ups)
            return sure
        full = torch.full((tokens.shape[0], self.vocab_size), float("-inf"), device=self.device)
        full[live] = self._target_logits(logits)
        rows = [live[k] for k in at]
        if probs is None:
            tokens[live, j] = full[live].argmax(-1)
            return (full[rows].amax(-1) - full[rows].logsumexp(-1)).exp()
        idle = sorted(set(range(tokens.shape[0])) - set(live))
        full[idle, 0] = 0.0  # (rows not drafting: any finite row)
        q = probabilities(full[:, None], sampling)[:, 0]  # [B, V]
        token = sample(q, uniforms[:, j])
        tokens[live, j] = token[live]
        probs[live, j] = q[live]
        return q[rows].amax(-1)

    def observe(self, reqs: list[Request], outcome: RoundOutcome) -> None:
        """Keep the features of each row's verified columns up to its last accepted one. Called
        before the round's tokens are appended to the requests (a row that drafted this round uses
        the newest position `propose` saw; others, req.num_tokens - 1)."""
        newest, self._newest = self._newest, {}
        if outcome.hidden is None:
            return
        leads = outcome.leads or [0] * len(reqs)
        for i, r in enumerate(reqs):
            t = newest.get(r.index, r.num_tokens - 1)
            keep = leads[i] + 1 + outcome.accepted[i]  # (prompt columns,) newest, accepted drafts
            self._add(r, t - leads[i], outcome.hidden[i, :keep])

    def release(self, req: Request) -> None:
        row = self.state.pop(req.index, None)
        if row is not None:
            self.free.append(row.slot)
        self._newest.pop(req.index, None)
        req.kv_len.pop(self.name, None)

    def forget(self) -> None:
        pass  # nothing is learned across requests


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices natively (AVX-512 BF16 or AMX)."""
    cpu = torch.cpu
    return any(getattr(cpu, name, lambda: False)() for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def auto_dtype(head: EagleHead) -> torch.dtype | None:
    """The dtype a head drafts in by default: bfloat16 for a float32 head on a CPU with native
    bfloat16 matrix instructions, else its own (None). On an AMD EPYC with AVX-512 BF16 a step of
    the SmolLM2 head takes 2.1 / 2.8 / 6.8 ms at 1 / 8 / 32 rows against 4.0 / 6.6 / 19.2 in
    float32 (its LM head over 16,384 ids alone 0.4 against 2.3 ms at one row). Drafts are only
    proposals: their precision changes how many are accepted, never what is emitted, and q is
    the distribution they were drawn from, whatever its precision."""
    weight = head.q_proj.weight
    if weight.device.type == "cpu" and weight.dtype == torch.float32 and native_bf16():
        return torch.bfloat16
    return None
