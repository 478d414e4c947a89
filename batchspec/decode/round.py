"""One decoding round for a batch: draft, verify in one target pass, commit.

Each row has its own draft length γ_i ≤ γ: at most min(γ, tokens it may still emit - 1), so a
row about to finish drafts nothing it could not use; with a policy (adaptive and/or a TETRIS
budget, `sched/adaptive.py`) the policy plans how deep each row drafts and then prunes which
drafted tokens are verified. Row i verifies its newest token plus its first γ_i drafts, so the
target pass feeds rows different numbers of tokens (the lean forward computes only real tokens,
so a shorter row is cheaper). With every γ_i = 0 the round is a plain autoregressive step: the
target reads the newest token and its own token ("bonus") is the output. Methods differ only in
how batches are formed (see `batchspec.sched`), never in this loop.

A row may join the round with its prompt (`SpecEngine._fusable`): it is fed the prompt tokens the
target has not seen before its newest token, in the same pass, drafts nothing and takes its first
token from the pass's last column, so a request admitted while others decode costs no forward of
its own. Example, rows A (decoding, 2 drafts) and B (a prompt of 5 tokens, none in the KV):

    A: fed [t, d1, d2]            logits of all 3 columns verify d1, d2 and draw the bonus
    B: fed [p0, p1, p2, p3, p4]   logits of column 4 only: B's first token (a plain step)

Randomness stays per request: every row draws 2γ + 1 uniforms per round whatever γ_i is (u_j
drafts d_j, u_{γ+j} accepts it, u_{2γ} draws the final token), so a seeded request's output does
not depend on its batch. Which uniform serves which token also depends on how many drafts each
round verified, so a policy must not choose that for a seeded sampled row from what the rest of
the batch does: such a row is *held* at the length it has with fixed γ (`held` below), and the
policy plans the other rows around it. Greedy rows (whose output no length changes) and unseeded
sampled rows (which promise no particular sample) are the policy's to plan.
"""

from __future__ import annotations

import math
import time

import torch

from ..core.request import Request
from ..core.stats import RunStats
from ..sampling import BatchSampling, draw_uniforms, probabilities
from ..verify import greedy_verify, rejection_verify


def draft_lengths(batch: list[Request], gamma: int, rope_limit: int | None = None) -> list[int]:
    """γ_i per row: never more drafts than the row can still emit after its bonus token, and for
    a LongRoPE target a row at or below the limit L0 verifies no position beyond L0 - 1, so one
    pass never mixes the short and the long regime (see core/attention.py)."""
    out = []
    for r in batch:
        g = min(gamma, r.remaining - 1)
        if rope_limit is not None and r.num_tokens <= rope_limit:
            g = min(g, rope_limit - r.num_tokens)
        out.append(max(0, g))
    return out


def run_round(engine, batch: list[Request], stats: RunStats) -> None:
    """Advance every request of `batch` (in slot order) by one round; counters go to `stats`."""
    started = time.perf_counter()
    gamma, timer, target = engine.gamma, engine.timer, engine.target
    device = engine.device
    sampling = BatchSampling.of([r.params for r in batch], device)
    u = None if sampling.all_greedy else draw_uniforms([r.generator for r in batch], 2 * gamma + 1, device)
    lengths = draft_lengths(batch, gamma, target.rope_limit)
    leads = [r.num_tokens - 1 - r.kv_len.get("target", 0) for r in batch]  # > 0: joins with its prompt
    fused = any(leads)
    if fused:
        lengths = [0 if lead else n for n, lead in zip(lengths, leads)]
    policy = engine.policy  # adaptive lengths and TETRIS budgets (sched/adaptive.py), or None: fixed γ
    # the requests in this round and whether any wait (a plan weighs rows otherwise when none do),
    # for the policy's shortcut to a plain round
    draining = engine.num_waiting() == 0
    # (none for a round that prefills a row: that row drafts nothing now, whatever it would next round)
    key = None if fused else (*map(id, batch), draining)
    indexed_s = getattr(engine.drafter, "catch_up_s", 0.0)  # a lookup's catch-up so far (drafters/ngram.py)
    held = None  # seeded sampled rows keep their fixed-γ length (see the module docstring)
    looked = None  # a hybrid drafter's lookups, done before the plan (below)
    by_lookup = [False] * len(batch)  # rows its lookup drafts (not its draft model)
    if policy is not None and not sampling.all_greedy:
        held = [n if r.params.seed is not None and not r.params.greedy else 0 for r, n in zip(batch, lengths)]
        held = held if any(held) else None
    # a round at the standing length: as fixed γ = L would run it, nothing planned or pruned, where
    # a plan would not earn the host time it costs (sched/standing.py; never with a fixed budget,
    # held rows or a prompt joining)
    gated = policy is not None and held is None and not fused and policy.cost is not None and policy.budget is None
    stand = policy.standing.length(len(batch)) if gated else None
    declined = None  # the policy ran this round plain where rows could have drafted (sched/standing.py)
    planned = None  # the plan's lengths, before the draft model's cut and the TETRIS prune (sched/standing.py)
    if gated:  # (the gate weighs a round's host time: all but its draft and verify stages)
        staged = (timer.totals.get("draft", 0.0), timer.totals.get("verify", 0.0))
    lookups = hasattr(engine.drafter, "lookahead")  # a hybrid: its lookups can run before the plan
    if stand is not None:
        policy.stood()
        before = dict(timer.totals)
        if lookups:  # which rows its lookup drafts (L for them), which its draft model (its own L)
            with timer.stage("draft"):
                looked = engine.drafter.lookahead(batch, lengths)
            by_lookup, lengths = _looked_up(looked, lengths)
        lengths = stand.lengths(lengths, by_lookup)
    elif policy is not None and held is None and policy.plain_now(key, len(batch), joining=fused):  # plain, due or kept
        lengths = policy.plain(len(batch))
        before = dict(timer.totals)
        declined = True
    elif policy is not None:
        # each row's acceptance estimate, from its record of the drafter's drafts (`factors`: those
        # after the first, against the pair's); a hybrid's lookup has a record of its own (below)
        alphas, factors = policy.estimates([r.stats for r in batch])
        weights = None
        if draining:  # the batch lasts as long as its longest request
            most = max(r.remaining for r in batch)
            weights = [r.remaining / most for r in batch]
        # refilling: a row that ends apart from its cohort costs a prefill forward of its own
        split = policy.split_s(batch, refilling=weights is None and not engine.fuses_prefill)
        before, planning = dict(timer.totals), time.perf_counter()
        first_fed = None
        if engine.draft_runner is not None:  # the draft model first catches up on what it has not seen:
            # a one-off cost that serves the rounds it drafts for the request from now on, so a round
            # is charged its share (`catch_up_share`), priced per token fed (`CostModel.catch_up`)
            share = engine.drafter.model_share() if lookups else 1.0
            model = engine.draft_model  # (None: a synthetic drafter run at the draft model's cost)
            feeds = [model.feeds(r) if model is not None else r.num_tokens - r.kv_len.get("draft", 0) for r in batch]
            first_fed = [1 + policy.catch_up(len(batch), (max(1, n) - 1) * policy.catch_up_share(r, share))
                         for r, n in zip(batch, feeds)]
        # a hybrid drafter's lookups, done first: what a row's lookup proposes bounds its length, and
        # a row the lookup drafts costs no draft-model step (first_fed 0, sched/adaptive.py). Whether
        # even free drafts would pay (`may_speculate`) is asked first, but only after a plain round:
        # after one that verified drafts the answer is yes but for a rare turn, and at batch 1 asking
        # costs as much as the plan, ~1 % of a round
        ask = not lookups or policy.last_plain is not False
        # a lookup drafter first indexes what it has not seen: a row's own index a one-off priced at
        # the row's share, a shared one at most what finishing requests bring it a round (`intake`)
        index_s = 0.0
        if hasattr(engine.drafter, "index_s") and ask:  # (a row joining with its prompt drafts nothing)
            shares = [0.0 if lead else s for s, lead in zip(policy.index_shares(batch), leads)]
            index_s = engine.drafter.index_s(batch, shares, policy.intake(batch))
        if lookups:  # the lookup's drafts are judged by its own record; free drafts are bounded by
            found = policy.estimates([r.stats for r in batch], [True] * len(batch))  # each row's likelier source
            bound = [m < f for m, f in zip(alphas, found[0])]
        # (the lookups themselves are paid whatever the plan then says: charged to speculating here)
        if lookups and ask and not policy.may_speculate(_pick(bound, found[0], alphas), lengths, weights, held,
                                                        index_s + engine.drafter.lookahead_s(lengths),
                                                        split, key=key, factors=_pick(bound, found[1], factors),
                                                        looked=bound):
            lengths = [0] * len(batch)  # not even free drafts would pay: that is the plan (a plain one)
            declined = True
        elif lookups:
            with timer.stage("draft"):
                looked = engine.drafter.lookahead(batch, lengths)
            by_lookup, lengths = _looked_up(looked, lengths)
            alphas, factors = _pick(by_lookup, found[0], alphas), _pick(by_lookup, found[1], factors)
            # what the lookup found is priced by its own confidence (greedy rows, as in `prune`)
            confidence = [f if f and r.params.greedy else None for f, r in zip(looked, batch)]
            held = [min(h, n) for h, n in zip(held, lengths)] if held is not None else None
            if first_fed is not None:
                first_fed = [f if by is None else 0.0 for f, by in zip(first_fed, looked)]
            # a plain plan is kept for the same requests (`plain_now`) only if it turned down what the
            # lookup found (not when it found nothing: the next round's lookups may well find
            # something; kept, a miss at batch 1 skipped the lookups of the next 2 rounds, 40-110
            # rounds a run), and never as settled: what lookups find changes from round to round
            kept = key if any(by_lookup) else None
            could = any(lengths)  # (nothing found, the model off: plain whatever the plan would say)
            lengths = policy.plan(alphas, lengths, weights, first_fed, key=kept, held=held,
                                  split_s=split, settle=False, factors=factors, looked=by_lookup,
                                  confidence=confidence if any(confidence) else None)  # (the lookahead indexed)
            declined = not any(lengths) if could else None
        else:
            could = any(lengths)
            lengths = policy.plan(alphas, lengths, weights, first_fed, key=key, held=held, index_s=index_s,
                                  split_s=split, factors=factors)
            declined = not any(lengths) if could else None
        planned = list(lengths)
        policy.planned(len(batch), time.perf_counter() - planning)
    g = max(lengths)

    confidence, caught_up = None, 0
    if g > 0:
        with timer.stage("draft"):
            proposal = engine.drafter.propose(batch, g, None if u is None else u[:, :g], sampling, lengths=lengths)
        drafts, q, caught_up = proposal.tokens, proposal.probs, proposal.caught_up
        if proposal.lengths is not None:  # a model-free drafter found fewer tokens for some rows
            lengths = [min(n, m) for n, m in zip(lengths, proposal.lengths)]
            if held is not None:
                held = [min(h, n) for h, n in zip(held, lengths)]
        if stand is not None:
            by_lookup = proposal.looked or by_lookup
        elif policy is not None:  # TETRIS: which drafted tokens to verify
            if proposal.confidence is not None:  # greedy rows only (see sched/adaptive.py); NaN: unknown
                confidence = [c if r.params.greedy and not math.isnan(c[0]) else None
                              for r, c in zip(batch, proposal.confidence.tolist())]
            lengths = policy.prune(alphas, lengths, confidence, timer.since(before)["draft"], weights, held, split,
                                   factors, by_lookup)
        drafts = drafts[:, :max(lengths)]
        q = q[:, :drafts.shape[1]] if q is not None else None
    else:
        drafts, q = torch.zeros(len(batch), 0, dtype=torch.long, device=device), None

    idle_before = target.stats.idle_rows
    with timer.stage("verify"):
        counts = [lead + 1 + n for lead, n in zip(leads, lengths)]
        if fused:  # the verified columns' logits only: [B, g+1, V]
            logits = target.feed(batch, _fed_ids(batch, leads, drafts, lengths, device), counts,
                                 logits=[1 + n for n in lengths])
        else:
            newest = torch.tensor([[r.token_ids[-1]] for r in batch], dtype=torch.long, device=device)
            logits = target.feed(batch, torch.cat([newest, drafts], dim=1), counts, logits="all")  # [B, g+1, V]
        lens = torch.tensor(lengths, dtype=torch.long, device=device)
        if sampling.all_greedy:
            result = greedy_verify(logits, drafts, lens)
        else:
            p = probabilities(logits, sampling)
            result = rejection_verify(p, q, drafts, u[:, gamma:gamma + drafts.shape[1]], u[:, 2 * gamma], lens)
        accepted = result.accepted.tolist()
        tokens = result.tokens.tolist()

    target.commit(batch, [lead + 1 + a for lead, a in zip(leads, accepted)])  # (prompt,) newest, accepted drafts
    if g > 0 or looked is not None:  # the drafter ran (a hybrid's lookups count), even if it found
        engine.drafter.observe(batch, accepted)  # nothing to propose or nothing was verified
    stats.rounds += 1
    stats.row_rounds += len(batch)
    stats.prefill_tokens += sum(leads)
    stats.fused_prefills += sum(1 for lead in leads if lead)
    stats.idle_rows += target.stats.idle_rows - idle_before
    stats.padding_tokens += sum(drafts.shape[1] - n for n in lengths)
    made = 0
    for i, (req, a, row, n) in enumerate(zip(batch, accepted, tokens, lengths)):
        emitted = req.append(row[: a + 1])
        stats.emitted += emitted
        made += emitted
        req.stats.rounds += 1
        if gamma > 0:
            stats.accept_hist[a] += 1
            stats.gamma_hist[n] += 1
            if n:  # (a row that verified nothing moves no count below: plain rounds skip them)
                req.stats.count_drafts(a, n, by_lookup[i])
                stats.drafted += n
                stats.accepted += a
    elapsed = time.perf_counter() - started
    if not fused:  # (a round that also prefilled is no measure of decoding)
        stats.count_round(len(batch), any(lengths), made, elapsed)  # (core/stats.py: round_gain)
    if policy is not None:  # the whole round is measured, less a lookup's catch-up: the policy weighs it all
        draft_s = timer.since(before)["draft"]
        rest_s = elapsed - draft_s
        draft_s = max(0.0, draft_s - (getattr(engine.drafter, "catch_up_s", 0.0) - indexed_s))
        policy.observe(accepted, lengths, confidence, rest_s, draft_s, caught_up=caught_up > 0,
                       timed=not fused and stand is None, looked=by_lookup)
        predicted = policy.predicted_s()
        if predicted is not None and not fused:
            stats.predicted_s += predicted
            stats.measured_s += rest_s + draft_s
        if gated:  # (the lookups and the passes are the same work either way: host time is the rest)
            totals = timer.totals
            host_s = elapsed - (totals.get("draft", 0.0) - staged[0]) - (totals.get("verify", 0.0) - staged[1])
            sources = None if looked is None else [True if f else None if f == [] else False for f in looked]
            policy.standing.record(len(batch), elapsed, host_s, stand is not None,
                                   lengths if planned is None else planned, sources, declined)
            stats.standing_rounds += stand is not None


def _looked_up(looked: list[list[float] | None], lengths: list[int]) -> tuple[list[bool], list[int]]:
    """After a hybrid's `lookahead`: which rows its lookup drafts, and each row's length, a lookup
    row's at most what the lookup found (looked[i]: its tokens' confidences, None: a draft-model
    row, []: nothing drafts it)."""
    return [bool(f) for f in looked], [n if f is None else min(n, len(f)) for n, f in zip(lengths, looked)]


def _pick(which: list[bool], yes: list, no: list) -> list:
    """Per row, yes[i] where which[i], else no[i]."""
    return [y if w else n for w, y, n in zip(which, yes, no)]


def _fed_ids(batch: list[Request], leads: list[int], drafts: torch.Tensor, lengths: list[int], device) -> torch.Tensor:
    """[B, max fed] ids of a round that prefills some rows: row i's last leads[i] + 1 tokens (its
    unseen prompt and its newest token), then its lengths[i] drafts, right-padded with 0."""
    rows = [r.token_ids[r.num_tokens - 1 - lead:] + d[:n]
            for r, lead, d, n in zip(batch, leads, drafts.tolist(), lengths)]
    width = max(len(row) for row in rows)
    return torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=torch.long, device=device)
