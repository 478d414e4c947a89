"""One decoding round for a batch: draft γ tokens, verify them in one target pass, commit.

With γ = 0 there is nothing to draft and the round is a plain autoregressive step: the target
reads the newest token and its own token ("bonus") is the output. Methods differ only in how
batches are formed (see `batchspec.sched`), never in this loop.
"""

from __future__ import annotations

import torch

from ..core.request import Request
from ..core.stats import RunStats
from ..sampling import BatchSampling, draw_uniforms, probabilities
from ..verify import greedy_verify, rejection_verify


def run_round(engine, batch: list[Request], stats: RunStats) -> None:
    """Advance every request of `batch` by one round; counters go to `stats`."""
    gamma, timer, target = engine.gamma, engine.timer, engine.target
    device = engine.device
    sampling = BatchSampling.of([r.params for r in batch], device)
    # Per-request uniforms, a fixed count per round: γ to draft, γ to accept, 1 for the final token.
    u = None if sampling.all_greedy else draw_uniforms([r.generator for r in batch], 2 * gamma + 1, device)

    if gamma > 0:
        with timer.stage("draft"):
            proposal = engine.drafter.propose(batch, gamma, None if u is None else u[:, :gamma], sampling)
        drafts, q = proposal.tokens, proposal.probs
    else:
        drafts, q = torch.zeros(len(batch), 0, dtype=torch.long, device=device), None

    with timer.stage("verify"):
        target.begin(batch, extra=gamma)
        logits = target.feed(extra=drafts if gamma > 0 else None, keep=gamma + 1)  # [B, γ+1, V]
        if sampling.all_greedy:
            result = greedy_verify(logits, drafts)
        else:
            p = probabilities(logits, sampling)
            result = rejection_verify(p, q, drafts, u[:, gamma:2 * gamma], u[:, 2 * gamma])
        accepted = result.accepted.tolist()
        tokens = result.tokens.tolist()

    target.commit(batch, [1 + a for a in accepted])  # the newest token and the accepted drafts
    if gamma > 0:
        engine.drafter.observe(batch, accepted)

    layout = target.last_layout
    stats.rounds += 1
    stats.row_rounds += len(batch)
    stats.aligned_rounds += int(layout.padded_rows == 0)
    stats.realigned_rows += layout.padded_rows
    stats.padding_tokens += layout.padding
    for req, a, row in zip(batch, accepted, tokens):
        emitted = req.append(row[: a + 1])
        stats.emitted += emitted
        req.stats.rounds += 1
        if gamma > 0:
            req.stats.drafted += gamma
            req.stats.accepted += a
            stats.drafted += gamma
            stats.accepted += a
            stats.accept_hist[a] += 1
