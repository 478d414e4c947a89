"""One decoding round for a batch, the paper's loop: schedule, plan, draft, prune, verify, commit,
observe. Every method runs it; they differ only in how batches are formed (`batchspec.sched`).

Row i verifies its newest token plus its first n_i drafts (n_i <= its cap: never more drafts than
it can still emit after its bonus token), so the target pass feeds rows different numbers of
tokens (the lean forward computes only real tokens). The policy (`sched/policy.py`) chooses the
n_i from the drafter's offer (a confident drafter's rows: its gate stops them as they are drafted,
`sched/gate.py`); all n_i = 0 is a plain autoregressive step. A greedy row may also be fed
siblings after its drafts, the drafter's runner-up tokens at some depths (`sched/siblings.py`
chooses them, `decode/siblings.py` feeds them and takes one that the target agrees with in a
rejected draft's place). A row may join the round with its prompt (`SpecEngine._fusable`): it is
fed the prompt tokens the target has not seen before its newest token, in the same pass, drafts
nothing and takes its first token from the pass's last column. Example, rows A (decoding, 2
drafts) and B (a prompt of 5 tokens):

    A: fed [t, d1, d2]            logits of all 3 columns verify d1, d2 and draw the bonus
    B: fed [p0, p1, p2, p3, p4]   logits of column 4 only: B's first token (a plain step)

Randomness stays per request: every row draws 2γ + 1 uniforms per round whatever n_i is (u_j
drafts d_j, u_{γ+j} accepts it, u_{2γ} draws the final token), so a seeded request's output does
not depend on its batch as long as its n_i does not: the policy holds such rows at their cap.
"""

from __future__ import annotations

import time

import torch

from ..core.request import Request
from ..core.stats import RunStats
from ..drafters.base import RoundOutcome
from ..sampling import BatchSampling, draw_uniforms, probabilities
from ..verify import greedy_verify, rejection_verify
from .siblings import Siblings


def draft_lengths(batch: list[Request], gamma: int, rope_limit: int | None = None) -> list[int]:
    """Each row's cap: never more drafts than the row can still emit after its bonus token, and for
    a LongRoPE target a row at or below the limit L0 verifies no position beyond L0 - 1, so one
    pass never mixes the short and the long regime (see core/attention.py)."""
    out = []
    for r in batch:
        g = min(gamma, r.remaining - 1)
        if rope_limit is not None and r.num_tokens <= rope_limit:
            g = min(g, rope_limit - r.num_tokens)
        out.append(max(0, g))
    return out


def run_round(batch: list[Request], target, drafter, policy, gamma: int, timer, stats: RunStats,
              trace=None, drain: bool = False) -> None:
    """Advance every request of `batch` (in slot order) by one round; counters go to `stats`.
    `drafter` and `policy` are None for plain decoding; `trace` (sched/replay.py) records it;
    `drain`: no request waits, and the policy prices a round by what it takes off the job's rest (`sched/drain.py`)."""
    started, device, b = time.perf_counter(), target.device, len(batch)
    sampling = BatchSampling.of([r.params for r in batch], device)
    u = None if sampling.all_greedy else draw_uniforms([r.generator for r in batch], 2 * gamma + 1, device)
    leads = [r.num_tokens - 1 - r.kv_len.get("target", 0) for r in batch]  # > 0: joins with its prompt
    caps = [0 if lead else n for n, lead in zip(draft_lengths(batch, gamma, target.rope_limit), leads)]
    held = [n > 0 and r.params.seed is not None and not r.params.greedy for r, n in zip(batch, caps)]
    records = [r.stats for r in batch]
    left = [r.remaining for r in batch] if drain else None
    # schedule and plan: what the drafter offers, and how far each row drafts
    lengths, decision, offer, offer_s = [0] * b, None, None, 0.0
    if drafter is not None and any(caps) and policy.worth_offering(tuple(r.index for r in batch), records, caps,
                                                                   held, left):
        tick = time.perf_counter()
        with timer.stage("draft"):
            offer = drafter.offer(batch, caps)
        offer_s = time.perf_counter() - tick
        decision = policy.plan(records, caps, offer, held, left)
        lengths = decision.lengths
    # draft and prune: a drafter may find fewer tokens than planned for some rows
    draft_s, looked, planned = 0.0, [o is not None for o in offer or [None] * b], list(lengths)
    if any(lengths):
        gate = decision.gate if decision is not None else None
        asked = gate.limits if gate is not None else lengths  # (gated: each row's most; the gate stops it)
        g = max(asked)
        tick = time.perf_counter()
        with timer.stage("draft"):
            proposal = drafter.propose(batch, asked, None if u is None else u[:, :g], sampling,
                                       **({"gate": gate} if gate is not None else {}))
        draft_s = time.perf_counter() - tick
        lengths = list(asked) if proposal.lengths is None else [min(n, m) for n, m in zip(asked, proposal.lengths)]
        looked = proposal.looked or [False] * b
        drafts = proposal.tokens[:, :max(lengths)]
        q = proposal.probs[:, :drafts.shape[1]] if proposal.probs is not None else None
    else:
        drafts, q = torch.zeros(b, 0, dtype=torch.long, device=device), None
    # siblings: a greedy round's runner-ups verified beside the chains, where they pay
    sibs, ranks = None, None
    if any(lengths) and sampling.all_greedy and proposal.runner_ups is not None and policy.sibling_width:
        room = [target.kv.capacity - r.kv_len.get("target", 0) - 1 - n for r, n in zip(batch, lengths)]
        conf = proposal.confidence.tolist() if proposal.confidence is not None else None
        ups_q = proposal.runner_up_q.tolist()
        ranks = policy.siblings(decision, records, looked, lengths, conf, ups_q)
        ranks = [row[:max(0, k)] for row, k in zip(ranks, room)]
        sibs = Siblings.pick(ranks, proposal.runner_ups) if any(ranks) else None
    extra = [sibs.count(i) if sibs else 0 for i in range(b)]
    # verify: one target pass over every row's newest token and drafts (and a joining prompt)
    features = drafter.features if drafter is not None else None
    idle_before, tick = target.stats.idle_rows, time.perf_counter()
    with timer.stage("verify"):
        counts = [lead + 1 + n + e for lead, n, e in zip(leads, lengths, extra)]
        ids = _fed_ids(batch, leads, drafts, lengths, device, sibs)
        want = [1 + n + e for n, e in zip(lengths, extra)] if any(leads) else "all"  # verified columns: [B, W, V]
        out = target.feed(batch, ids, counts, logits=want, **({"hidden": features} if features else {}),
                          **({"parents": sibs.parents(lengths, leads)} if sibs else {}))
        logits, hidden = out if features else (out, None)
        lens = torch.tensor(lengths, dtype=torch.long, device=device)
        if sampling.all_greedy:
            result = greedy_verify(logits, drafts, lens)
        else:
            p = probabilities(logits, sampling)
            result = rejection_verify(p, q, drafts, u[:, gamma:gamma + drafts.shape[1]], u[:, 2 * gamma], lens)
        chain, tokens = result.accepted.tolist(), result.tokens.tolist()
        accepted, hits = list(chain), sibs.resolve(tokens, chain, lengths, leads) if sibs else [None] * b
        if any(hits):  # a sibling taken: d_{a+1}'s place, its KV and features, and its column's bonus
            taken = [i for i, h in enumerate(hits) if h]
            target.move_columns([batch[i] for i in taken], [hits[i][:2] for i in taken])
            hidden = hidden.clone() if hidden is not None else None
            for i in taken:
                src, dst, bonus = hits[i]
                accepted[i] += 1
                tokens[i][accepted[i]] = bonus
                if hidden is not None:
                    hidden[i, dst] = hidden[i, src]
    verify_s = time.perf_counter() - tick
    # commit and observe
    target.commit(batch, [lead + 1 + a for lead, a in zip(leads, accepted)])  # (prompt,) newest, accepted drafts
    if drafter is not None and (any(planned) or features):
        drafter.observe(batch, RoundOutcome(accepted, lengths, hidden, leads if any(leads) else None))
    fed = [n + e for n, e in zip(lengths, extra)] if sibs else None
    if decision is not None:  # (a round whose pass also prefilled prompts corrects no price)
        policy.observe(decision, lengths, chain, looked, draft_s, None if any(leads) else verify_s, fed)
    if sibs:
        policy.observe_siblings(ranks, ups_q, chain, sum(1 for h in hits if h))
        stats.siblings += sum(extra)
        stats.sibling_hits += sum(1 for h in hits if h)
    made = 0
    for req, a, c, row, n, lk in zip(batch, accepted, chain, tokens, lengths, looked):
        made += req.append(row[: a + 1])
        req.stats.rounds += 1
        if gamma > 0:
            stats.accept_hist[a] += 1
            stats.gamma_hist[n] += 1
        if n:  # (a row that verified nothing moves no record: plain rounds skip them)
            req.stats.count_drafts(c, n, lk)
            stats.drafted += n
            stats.accepted += c
    elapsed = time.perf_counter() - started
    stats.rounds += 1
    stats.row_rounds += b
    stats.emitted += made
    stats.prefill_tokens += sum(leads)
    stats.fused_prefills += sum(1 for lead in leads if lead)
    stats.idle_rows += target.stats.idle_rows - idle_before
    stats.padding_tokens += sum(drafts.shape[1] - n for n in lengths)
    if not any(leads):  # (a round that also prefilled is no measure of decoding)
        stats.count_round(b, any(lengths), made, elapsed)
        if decision is not None and decision.planned:
            predicted = policy.predicted(decision, lengths, fed)
            stats.predicted_s += sum(predicted)
            stats.measured_s += draft_s + verify_s
    if trace is not None:
        trace.record(batch, caps, offer, chain, offer_s, draft_s, verify_s, elapsed, any(leads))


def _fed_ids(batch: list[Request], leads: list[int], drafts: torch.Tensor, lengths: list[int], device,
             sibs: Siblings | None = None) -> torch.Tensor:
    """[B, max fed] ids: row i's last leads[i] + 1 tokens (its unseen prompt, if joining, and its
    newest token), then its lengths[i] drafts (and its siblings), right-padded with 0."""
    rows = [r.token_ids[r.num_tokens - 1 - lead:] + d[:n] + (sibs.fed(i) if sibs else [])
            for i, (r, lead, d, n) in enumerate(zip(batch, leads, drafts.tolist(), lengths))]
    width = max(len(row) for row in rows)
    return torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=torch.long, device=device)
