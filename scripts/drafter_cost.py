"""What a model-free drafter costs per round: microseconds per row at long contexts, no model.

    .venv/bin/python scripts/drafter_cost.py                    # 4096-token contexts, batch 8, γ 4
    .venv/bin/python scripts/drafter_cost.py --context 16384 --json cost.json

Each of `batch` requests starts with a `context`-token prompt, indexed once (the prefill, timed
apart), then runs `rounds` rounds: the drafter proposes up to γ tokens per row, the row accepts
the longest prefix that agrees with its own token stream and appends that plus one token, as a
verified round does. Two streams: "random" (uniform ids: almost nothing repeats, the tries are
at their largest and matches fail) and "repetitive" (a 256-token block over and over: every
round matches and proposes γ tokens). For suffix, the shared trie is first filled to its
budget with earlier requests of the same kind. Memory is measured with tracemalloc.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import tracemalloc

import torch

from batchspec.core.request import FinishReason, Request
from batchspec.drafters.base import RoundOutcome
from batchspec.drafters.ngram import NgramDrafter
from batchspec.drafters.suffix import SuffixDrafter
from batchspec.sampling import BatchSampling, SamplingParams

CPU = torch.device("cpu")


def stream(kind: str, length: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    if kind == "random":
        return [rng.randrange(vocab) for _ in range(length)]
    block = [rng.randrange(vocab) for _ in range(256)]
    return (block * (length // 256 + 1))[:length]


def make(name: str):
    return NgramDrafter(CPU) if name == "ngram" else SuffixDrafter(CPU)


def fill_shared(drafter, kind: str, context: int, vocab: int) -> None:
    if not isinstance(drafter, SuffixDrafter):
        return
    i = 0
    while drafter.shared.tokens + context <= drafter.shared.max_tokens:
        r = Request(10_000 + i, stream(kind, context, vocab, 10_000 + i), SamplingParams(), frozenset())
        r.finish_reason = FinishReason.LENGTH
        drafter.release(r)
        i += 1


def run(name: str, kind: str, context: int, batch: int, gamma: int, rounds: int, vocab: int) -> dict:
    drafter = make(name)
    fill_shared(drafter, kind, context, vocab)
    streams = [stream(kind, context + rounds * (gamma + 1), vocab, seed=i) for i in range(batch)]
    reqs = [Request(i, s[:context], SamplingParams(max_new_tokens=10**9), frozenset()) for i, s in enumerate(streams)]
    greedy = BatchSampling.of([r.params for r in reqs], CPU)

    start = time.perf_counter()
    drafter.prefill(reqs, [context - 1] * batch)
    prefill_s = time.perf_counter() - start

    times, proposed, accepted = [], 0, 0
    for _ in range(rounds):
        start = time.perf_counter()
        out = drafter.propose(reqs, [gamma] * batch, None, greedy)
        times.append(time.perf_counter() - start)
        rows, taken = out.tokens.tolist(), []
        for r, s, row, n in zip(reqs, streams, rows, out.lengths):
            at = r.num_tokens
            a = next((j for j in range(n) if row[j] != s[at + j]), n)
            r.token_ids.extend(s[at:at + a + 1])
            proposed, accepted = proposed + n, accepted + a
            taken.append(a)
        drafter.observe(reqs, RoundOutcome(taken, list(out.lengths)))
    per_row_us = [t / batch * 1e6 for t in times]
    return {"drafter": drafter.label, "stream": kind, "context": context, "batch": batch, "gamma": gamma,
            "us_per_row_round": statistics.mean(per_row_us), "us_per_row_round_p90": _p90(per_row_us),
            "us_per_round": statistics.mean(times) * 1e6, "prefill_ms_per_row": prefill_s / batch * 1e3,
            "proposed_per_row_round": proposed / (rounds * batch),
            "accepted_per_row_round": accepted / (rounds * batch)}


def memory(name: str, kind: str, context: int, vocab: int) -> dict:
    """MB held by one request's index at `context` tokens, and by suffix's full shared trie."""
    drafter = make(name)
    r = Request(0, stream(kind, context, vocab, 0), SamplingParams(), frozenset())
    tracemalloc.start()
    drafter.prefill([r], [context])
    own = tracemalloc.get_traced_memory()[0]
    fill_shared(drafter, kind, context, vocab)
    total = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    out = {"drafter": drafter.label, "stream": kind, "own_mb_per_request": own / 2**20}
    if isinstance(drafter, SuffixDrafter):
        out["shared_mb"] = (total - own) / 2**20
        out["shared_tokens"] = drafter.shared.tokens
    return out


def _p90(values: list[float]) -> float:
    return sorted(values)[int(0.9 * (len(values) - 1))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows, mems = [], []
    for name in ("ngram", "suffix"):
        for kind in ("random", "repetitive"):
            rows.append(run(name, kind, args.context, args.batch, args.gamma, args.rounds, args.vocab))
            mems.append(memory(name, kind, args.context, args.vocab))
    print(f"context {args.context} tokens, batch {args.batch}, γ {args.gamma}, {args.rounds} rounds, "
          f"vocab {args.vocab}, torch threads 1")
    print("| drafter | stream | µs / row / round (p90) | µs / round | prefill ms / row | proposed | accepted |"
          " MB own / request | MB shared |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r, m in zip(rows, mems):
        shared = f"{m['shared_mb']:.0f} ({m['shared_tokens']} tokens)" if "shared_mb" in m else "-"
        print(f"| {r['drafter']} | {r['stream']} | {r['us_per_row_round']:.1f} ({r['us_per_row_round_p90']:.1f}) | "
              f"{r['us_per_round']:.0f} | {r['prefill_ms_per_row']:.1f} | {r['proposed_per_row_round']:.2f} | "
              f"{r['accepted_per_row_round']:.2f} | {m['own_mb_per_request']:.1f} | {shared} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rounds": rows, "memory": mems}, f, indent=2)


if __name__ == "__main__":
    main()
