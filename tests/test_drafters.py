"""Drafters without a draft model (ngram, suffix) and the hybrid, plus the drafter registry.

Tiers, as everywhere: the index math on made-up token lists (worked examples, and the
incremental structures against a brute-force rescan); greedy output of every new drafter x
method equal to target-only decoding, token for token; a statistical test that sampling with
n-gram drafts draws from the target's distribution, with a broken verifier as negative control.

Random tiny models rarely repeat themselves, so n-gram drafts would never be accepted. The
equivalence tests use a "loopy" target instead: attention damped (o_proj x 0.01) so that it is
close to a Markov chain whose greedy output falls into cycles the drafters can copy, yet still
reads its context (about a quarter of its greedy tokens differ from the memoryless prediction),
so a wrong KV entry would show.
"""

from __future__ import annotations

import functools
import math
import random
import sys
import time
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_sampling import chi_square, models
from tiny import VOCAB, make_model, perturbed, prompts, references

import batchspec.decode.round as round_module
import batchspec.drafters.hybrid as hybrid_module
from batchspec import EngineConfig, ModelPair, SamplingParams, SpecEngine
from batchspec.cli import echo_workload
from batchspec.core.request import FinishReason, Request
from batchspec.drafters import (
    HybridDrafter,
    drafter_needs_model,
    drafter_requires_model,
    drafter_uses_model,
    hybrid,
    make_drafter,
    parse_drafter,
    split_drafters,
)
from batchspec.drafters import suffix as suffix_module
from batchspec.drafters.base import DraftProposal
from batchspec.drafters.hybrid import ModelGate
from batchspec.drafters.ngram import NgramDrafter, NgramIndex, match_confidence
from batchspec.drafters.suffix import SuffixDrafter, most_frequent_path
from batchspec.drafters.trie import ROOT, CountTrie, RequestTrie, SharedTrie
from batchspec.harness import warped_probs
from batchspec.prompts import apply_workload, echo_ids, repetitive_prompts
from batchspec.sampling import BatchSampling, request_seed
from batchspec.verify.rejection import VerifyResult, rejection_verify

CPU = torch.device("cpu")
GREEDY = BatchSampling.of([SamplingParams()], CPU)


def request(tokens, index=0, stop=(), prompt_len=None) -> Request:
    r = Request(index, list(tokens), SamplingParams(max_new_tokens=100), frozenset(stop))
    if prompt_len is not None:
        r.prompt_len = prompt_len
    return r


def propose(drafter, reqs, gamma):
    """Rows of proposed tokens (each cut to its proposal length)."""
    out = drafter.propose(reqs, gamma, None, GREEDY)
    assert out.probs is None  # point masses
    return [row[:n] for row, n in zip(out.tokens.tolist(), out.lengths)]


# ------------------------------------------------------------------------------------- n-gram
A, B, C, D, E = 10, 11, 12, 13, 14


def test_ngram_docstring_example():
    tokens = [A, B, C, D, A, B, C]
    idx = NgramIndex(1, 3)
    idx.extend(tokens)
    assert idx.match(tokens) == (3, 3)
    assert idx.continuation(tokens, 3, 5) == [D, A, B, C, D]  # past the end it copies itself
    assert idx.last[(A,)] == 5 and idx.last[(D, A, B)] == 6


def test_ngram_match_no_match_and_overlap():
    drafter = NgramDrafter(CPU, 2, 4, 10)
    assert propose(drafter, [request([A, B, C, D, A, B])], 3) == [[C, D, A]]
    assert propose(drafter, [request([A, B, C, D], 1)], 3) == [[]]  # no earlier (C, D)
    assert propose(drafter, [request([A, A, A, A], 2)], 4) == [[A, A, A, A]]  # overlapping occurrence
    # the most recent occurrence wins: (A, B) was followed by C, then by E
    assert propose(drafter, [request([A, B, C, A, B, E, A, B], 3)], 2) == [[E, A]]
    # the longest suffix wins over a more recent shorter one: (C, A, B) -> D; (A, B) alone -> E
    assert propose(drafter, [request([C, A, B, D, E, A, B, E, C, A, B], 4)], 1) == [[D]]


def test_ngram_k_caps_and_rows_have_their_own_histories():
    drafter = NgramDrafter(CPU, 1, 2, 2)
    rows = [request([A, B, C, A], 0), request([C, D, E, C], 1), request([E], 2)]
    assert propose(drafter, rows, 5) == [[B, C], [D, E], []]
    out = drafter.propose(rows, 5, None, GREEDY, lengths=[1, 0, 3])  # per-row caps from the round
    assert out.lengths == [1, 0, 0] and out.tokens.tolist()[0][0] == B


def test_ngram_index_is_incremental():
    """Appending tokens between rounds indexes only the new ones, and gives what a fresh index
    over the whole sequence gives."""
    drafter = NgramDrafter(CPU, 2, 3, 4)
    r = request([A, B, C, D])
    drafter.prefill([r], [3])
    assert drafter.index(r).upto == 3
    assert propose(drafter, [r], 4) == [[]]
    r.append([A, B])
    assert drafter.index(r).upto == 4
    assert propose(drafter, [r], 4) == [[C, D, A, B]]
    assert drafter.index(r).upto == 6
    drafter.release(r)
    assert r.index not in drafter._index


def brute_force_match(tokens, min_n, max_n):
    """The definition, by rescanning: longest suffix with an earlier occurrence, its latest end."""
    length = len(tokens)
    for n in range(min(max_n, length), min_n - 1, -1):
        suffix = tokens[length - n:]
        for e in range(length - 1, n - 1, -1):
            if tokens[e - n:e] == suffix:
                return n, e
    return 0, -1


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), min_size=1, max_size=10),
       st.integers(1, 3), st.integers(0, 2))
def test_ngram_incremental_equals_rescan(chunks, min_n, extra):
    """Whatever the chunks the sequence grows by, the incremental index matches like a rescan."""
    idx, seen = NgramIndex(min_n, min_n + extra), []
    for chunk in chunks:
        seen += chunk
        idx.extend(seen)
        assert idx.match(seen) == brute_force_match(seen, min_n, min_n + extra)


def test_eos_inside_a_copied_span_ends_the_proposal():
    eos = 99
    drafter = NgramDrafter(CPU, 2, 4, 10)
    r = request([A, B, C, eos, D, E, A, B], stop=(eos,))
    assert propose(drafter, [r], 5) == [[C, eos]]  # nothing after a stop token can be emitted


# ------------------------------------------------------------------------------------- suffix
def node_counts(trie, node=ROOT, prefix=()):
    """{path: count} of every node under `node`."""
    out = {}
    for child in trie.children(node):
        path = prefix + (trie.token[child],)
        out[path] = trie.count[child]
        out.update(node_counts(trie, child, path))
    return out


def test_suffix_trie_docstring_example():
    a, b, c = A, B, C
    trie = CountTrie(3)
    trie.add([a, b, a, b, c])
    assert node_counts(trie) == {(a,): 2, (a, b): 2, (a, b, a): 1, (a, b, c): 1, (b,): 2, (b, a): 1,
                                      (b, a, b): 1, (b, c): 1, (c,): 1}
    trie.remove([a, b, a, b, c])
    assert trie.kids[ROOT] is None and trie.nodes == 1
    trie.add([c, a])  # removed nodes' ids are reused
    assert node_counts(trie) == {(c,): 1, (c, a): 1, (a,): 1} and len(trie.token) == 10


def test_most_frequent_path_docstring_example():
    trie = CountTrie(3)
    for seq in ([1, 7, 4], [1, 7, 5], [1, 7, 4], [1, 7, 5], [1, 9]):
        trie.add(seq)
    # under 1: 7 x4, 9 x1; under (1, 7): 4 x2, 5 x2 -> a tie, the smaller id
    at = [(trie, trie.find([1]))]
    assert most_frequent_path(at, 5, 0.25)[0] == [7, 4]
    assert most_frequent_path(at, 5, 0.5)[0] == [7]
    assert most_frequent_path(at, 1, 0.0)[0] == [7]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=30), st.integers(1, 29), st.integers(2, 6))
def test_request_trie_incremental_equals_batch_insert(tokens, cut, depth):
    grown = RequestTrie(depth)
    grown.extend(tokens, min(cut, len(tokens)))
    grown.extend(tokens)
    whole = CountTrie(depth)
    whole.add(tokens)
    substrings = Counter(tuple(tokens[s:s + k]) for s in range(len(tokens)) for k in range(1, depth + 1)
                         if s + k <= len(tokens))  # what the counts mean, computed by hand
    assert node_counts(whole) == dict(substrings)
    assert node_counts(grown) == node_counts(whole)
    assert [node_counts(grown, n) for n in grown.active] == \
        [node_counts(whole, whole.find(tokens[len(tokens) - m:])) for m in range(1, len(grown.active) + 1)]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=8), st.integers(1, 30))
def test_shared_trie_after_evictions_equals_a_fresh_one(sequences, budget):
    shared = SharedTrie(4, budget)
    for seq in sequences:
        shared.add(seq)
        assert shared.tokens == sum(map(len, shared.sequences)) <= budget
    fresh = CountTrie(4)
    for seq in shared.sequences:
        fresh.add(seq)
    assert node_counts(shared) == node_counts(fresh) and shared.nodes == fresh.nodes


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=8), st.integers(1, 30),
       st.sets(st.integers(0, 7)))
def test_suffix_learns_lazily_what_adding_at_once_learns(sequences, budget, reads):
    """Finished requests wait until a round reads the shared trie (reads: after which ones); the
    trie read is the one that adding each request as it finished gives, evictions included."""
    drafter, eager = SuffixDrafter(CPU, depth=4, max_tokens=budget), SharedTrie(4, budget)
    for i, seq in enumerate(sequences):
        finished = request(seq, i)
        finished.finish_reason = FinishReason.STOP
        drafter.release(finished)
        eager.add(seq)
        if i in reads or i == len(sequences) - 1:
            assert list(drafter.shared.sequences) == list(eager.sequences)
            assert node_counts(drafter.shared) == node_counts(eager)


def test_suffix_proposes_the_most_frequent_continuation():
    tokens = [A, B, C, A, B, C, A, B, D, A, B]  # after (A, B): C twice, D once; after (A, B, C): A twice
    assert propose(SuffixDrafter(CPU, 6, 2, 0.5), [request(tokens)], 2) == [[C, A]]  # 2/3, then 2/3 x 1
    assert propose(SuffixDrafter(CPU, 6, 2, 0.7), [request(tokens)], 2) == [[]]  # 2/3 < 0.7
    drafter = SuffixDrafter(CPU, depth=12, k=6, min_prob=0.3)
    # seen once, a copy is proposed, at most twice as long as the match: (A, B, C, D) -> E A B C
    assert propose(drafter, [request([A, B, C, D, E, A, B, C, D], 1)], 4) == [[E, A, B, C]]
    assert propose(drafter, [request([A, B, C, D, E, A, B], 2)], 6) == [[C, D, E, A]]  # (A, B): 4 of 6
    assert propose(drafter, [request([A, B, C, D, E, A], 5)], 4) == [[]]  # one token is too weak a match
    assert propose(drafter, [request([A, B, C], 3)], 4) == [[]]  # the suffix itself is no match
    # overlapping occurrences count; the continuation ends where the known tokens end
    assert propose(drafter, [request([A, A, A, A], 4)], 2) == [[A]]  # (A, A, A) then A, once


def test_a_suffix_proposal_longer_than_a_segment_is_matched_again(monkeypatch):
    """A walk goes at most `SEGMENT` tokens below its match (the trie is only so deep); a
    proposal allowed to be longer matches the row's tokens plus what it proposed so far again and
    goes on. Depth 5, segments of 2, so matches of at most 3: (A, B, C) -> D E, then (C, D, E) -> F G,
    then (E, F, G) -> A B (6 = twice the first match); without matching again the walk would end at
    the trie's depth, after D E."""
    monkeypatch.setattr(suffix_module, "SEGMENT", 2)
    F, G = 15, 16
    tokens = [A, B, C, D, E, F, G, A, B, C]
    assert propose(SuffixDrafter(CPU, depth=5, k=6, min_prob=0.1), [request(tokens)], 6) == [[D, E, F, G, A, B]]
    assert propose(SuffixDrafter(CPU, depth=5, k=3, min_prob=0.1), [request(tokens)], 6) == [[D, E, F]]  # k caps it
    # the probability runs on across segments: after (C, D, E), F once and G once -> 1/2 < 0.6
    forked = [A, B, C, D, E, F, C, D, E, G, A, B, C]
    assert propose(SuffixDrafter(CPU, depth=5, k=3, min_prob=0.6), [request(forked)], 6) == [[D, E]]
    assert propose(SuffixDrafter(CPU, depth=5, k=3, min_prob=0.4), [request(forked)], 6) == [[D, E, F]]


def test_suffix_shares_finished_requests_and_evicts_the_oldest():
    drafter = SuffixDrafter(CPU, depth=6, k=4, min_prob=0.1, max_tokens=10)
    first = request([A, B, C, D, E, A], 0)
    first.finish_reason = FinishReason.LENGTH
    drafter.release(first)
    assert drafter.shared.tokens == 6
    assert propose(drafter, [request([E, B, C], 1)], 3) == [[D, E, A]]  # from the shared trie
    sampled = request([E, B, C], 7)
    sampled.params = SamplingParams(temperature=1.0, max_new_tokens=100)
    assert propose(drafter, [sampled], 3) == [[]]  # a sampled row reads its own tokens only
    aborted = request([C, D, A, A, A, A], 2)
    aborted.finish_reason = FinishReason.ABORT
    drafter.release(aborted)
    assert drafter.shared.tokens == 6  # aborted requests are not learned from
    second = request([D, E, E, E, E], 3)
    second.finish_reason = FinishReason.STOP
    drafter.release(second)  # 6 + 5 > 10: the first request is evicted
    assert drafter.shared.tokens == 5 and len(drafter.shared.sequences) == 1
    assert propose(drafter, [request([E, B, C], 4)], 3) == [[]]
    assert propose(drafter, [request([A, D, E], 5)], 3) == [[E, E, E]]
    drafter.shared.add([A] * 30)  # longer than the budget: only its newest 10 tokens are kept
    assert drafter.shared.tokens == 10 and node_counts(drafter.shared)[(A,)] == 10
    hybrid_on_it = HybridDrafter(None, drafter)
    hybrid_on_it.forget()  # a bench run starts from no history (what the requests in flight saw stays)
    assert drafter.shared.tokens == 0 and drafter.shared.nodes == 1
    assert propose(drafter, [request([A, D, E], 5)], 3) == [[]]


def test_suffix_merges_own_and_shared_counts():
    drafter = SuffixDrafter(CPU, depth=6, k=4, min_prob=0.0, max_tokens=100)
    for i, seq in enumerate(([A, B, D], [A, B, D], [A, B, D])):
        r = request(seq, 10 + i)
        r.finish_reason = FinishReason.STOP
        drafter.release(r)
    # its own history says C once; the shared one says D three times
    assert propose(drafter, [request([A, B, C, E, A, B], 1)], 1) == [[D]]


# ------------------------------------------------------------------------------------- registry
def test_registry_parses_and_refuses_clearly():
    assert parse_drafter("draft_model") == ("draft_model", None)
    assert parse_drafter("oracle:0.7") == ("oracle", 0.7)
    assert parse_drafter("ngram") == ("ngram", (2, 4, 16))
    assert parse_drafter("ngram:1,3") == ("ngram", (1, 3, 16))
    assert parse_drafter("suffix:8,4,0.5,100") == ("suffix", (8, 4, 0.5, 100))
    assert parse_drafter("hybrid") == ("hybrid", parse_drafter(hybrid.LOOKUP))  # built on the default lookup
    assert parse_drafter("hybrid:ngram:1,3") == parse_drafter("hybrid:1,3") == ("hybrid", ("ngram", (1, 3, 16)))
    assert parse_drafter("hybrid:suffix:8,4") == ("hybrid", ("suffix", (8, 4, 0.25, 1 << 16)))
    for spec, message in [("ngram:3,2", "min_n <= max_n"), ("ngram:x", "ngram:2,4,16"),
                          ("ngram:1,2,3,4", "ngram\\[:min_n,max_n,k\\]"), ("suffix:4,4", "depth > k"),
                          ("suffix:8,4,2", "min_prob in \\[0, 1\\]"), ("draft_model:1", "takes no arguments"),
                          ("oracle", "oracle:0.7"), ("beam", "choose one of draft_model, ngram"),
                          ("hybrid:draft_model", "built on one of ngram, suffix"), ("hybrid:suffix:4,4", "depth > k")]:
        with pytest.raises(ValueError, match=message):
            parse_drafter(spec)
    assert [drafter_needs_model(s) for s in ("draft_model", "ngram", "suffix", "hybrid", "oracle:1")] == \
        [True, False, False, True, False]
    assert [drafter_requires_model(s) for s in ("draft_model", "hybrid", "oracle:1")] == [True, False, False]
    assert [drafter_uses_model(s) for s in ("ngram", "suffix", "oracle:1")] == [False, False, True]
    assert split_drafters("draft_model,ngram:2,4,10,suffix, oracle:0.5,hybrid:ngram:2,3,hybrid:suffix") == \
        ["draft_model", "ngram:2,4,10", "suffix", "oracle:0.5", "hybrid:ngram:2,3", "hybrid:suffix"]
    assert make_drafter("ngram:1,2,3", draft_runner=None, device=CPU, vocab_size=8).label == "ngram:1,2,3"
    with pytest.raises(ValueError, match="needs a draft model"):
        make_drafter("draft_model", draft_runner=None, device=CPU, vocab_size=8)
    # without a draft model the hybrid is its lookup alone
    assert make_drafter("hybrid:ngram:1,2,3", draft_runner=None, device=CPU, vocab_size=8).label == "ngram:1,2,3"


def test_engine_uses_the_registry():
    target = loopy()[0].target
    free = ModelPair(target, None, None, VOCAB, ())
    with pytest.raises(ValueError, match="--draft.*--drafter ngram.*--method autoregressive"):
        SpecEngine(free, EngineConfig(drafter="draft_model"))
    alone = SpecEngine(free, EngineConfig(drafter="hybrid", max_kv_tokens=512))  # the lookup alone
    assert alone.draft_runner is None and alone.drafter.label == \
        make_drafter(hybrid.LOOKUP, draft_runner=None, device=CPU, vocab_size=8).label
    with_draft = ModelPair(target, loopy()[0].draft, None, VOCAB, ())
    engine = SpecEngine(with_draft, EngineConfig(drafter="ngram", max_kv_tokens=512))
    assert engine.draft_runner is None  # a model-free drafter allocates nothing for the draft model
    assert engine.drafter.label == "ngram:2,4,16" and not engine.drafter.synthetic
    oracle = SpecEngine(with_draft, EngineConfig(drafter="oracle:0.5", max_kv_tokens=512))
    assert oracle.drafter.synthetic and oracle.draft_runner is not None  # runs the draft model for its cost
    assert SpecEngine(with_draft, EngineConfig(max_kv_tokens=512)).drafter.label == \
        "hybrid:" + make_drafter(hybrid.LOOKUP, draft_runner=None, device=CPU, vocab_size=8).label  # the default


def test_cli_model_free_drafter_needs_no_draft(tiny_dirs):
    from typer.testing import CliRunner

    from batchspec.cli import app

    base = ["generate", "--target", tiny_dirs["target"], "--prompt", "def f():\n    return f()\ndef f():",
            "--max-new-tokens", "6", "--quiet"]
    result = CliRunner().invoke(app, base + ["--drafter", "ngram:1,3,4"])
    assert result.exit_code == 0 and "eqspec" in result.output, result.output
    for drafter, message in (("draft_model", "--method autoregressive"), ("ngram:4,1", "e.g. ngram:2,4,16")):
        result = CliRunner().invoke(app, base + ["--drafter", drafter])
        assert result.exit_code == 2 and message in result.output, result.output


def test_repetitive_workload():
    assert repetitive_prompts(["def f():\n", "x = 1"]) == ["def f():\ndef f():\n", "x = 1\nx = 1"]
    assert apply_workload("plain", ["a"]) == ["a"]
    assert apply_workload("twice", ["a", "b"]) == ["a", "b", "a", "b"]
    with pytest.raises(ValueError, match="plain, repetitive, echo, twice"):
        apply_workload("thrice", ["a"])
    assert echo_ids([2, 7, 8], [9, 10], [7, 8]) == [2, 7, 8, 9, 10, 7, 8]


def test_echo_workload_holds_the_targets_answer():
    """bench --workload echo: prompt, the target's greedy answer, the prompt again (no BOS)."""
    pair, ids, refs = loopy()
    echoed = echo_workload(pair, ids, [MAX_NEW] * len(ids), added=1)
    assert echoed == [p + r + p[1:] for p, r in zip(ids, refs)]


def test_model_gate_keeps_the_model_only_while_it_pays():
    """Rounds the model drafts against rounds whose rows without a match go undrafted, in tokens
    per second, each side explored again now and then."""
    gate = ModelGate(weight=1.0, explore_every=3, min_rounds=1)
    assert gate.use()  # nothing measured: try it
    gate.record(tokens=1.8, seconds=0.012, drafted=True)  # 150 tok/s with the model
    assert not gate.use()  # measure the other side
    gate.skip()
    gate.record(tokens=1.0, seconds=0.005, drafted=False)  # 200 tok/s without: the model does not pay
    for _ in range(2):
        assert not gate.use()
        gate.skip()
        gate.record(tokens=1.0, seconds=0.005, drafted=False)
    assert gate.use()  # explore again after 3 rounds without it
    gate.record(tokens=1.8, seconds=0.012, drafted=True)  # still 150 tok/s: wait twice as long
    assert gate.wait == 6 and not gate.use()
    for _ in range(6):
        gate.skip()
    assert gate.use()
    gate.record(tokens=2.4, seconds=0.010, drafted=True)  # 240 tok/s: keep it
    assert gate.pays() and gate.skipped == 0 and gate.wait == 3
    assert gate.used == 2  # model rounds since the last recorded round without it
    assert gate.use()
    gate.record(tokens=2.4, seconds=0.010, drafted=True)
    assert not gate.use()  # a round without it after 3 with it: is the other side still slower?
    gate.skip()
    gate.record(tokens=1.0, seconds=0.005, drafted=False)
    assert gate.probe == 6 and gate.use()  # yes: probe it half as often


def test_model_gate_measures_both_sides_alike_before_it_compares_them():
    """One round is not a measurement: at first each side is measured in turn, `min_rounds` times,
    and each average is the mean of its rounds until the exponential weight takes over. (Seen with
    the adaptive default at batch 8: one round without the model, a slow one at 721 tok/s, stood
    against ~950 for the model's, which then drafted every round the lookup missed: 1.19x plain
    decoding against fixed γ's 1.28x; measured alike, 1.27x.)"""
    gate = ModelGate(weight=0.1, explore_every=16, min_rounds=3)
    sides = []
    for model_s, without_s in ((0.010, 0.014), (0.010, 0.008), (0.010, 0.008)):
        for _ in range(2):
            drafted = gate.use()
            sides.append(drafted)
            if not drafted:
                gate.skip()
            gate.record(tokens=10.0, seconds=model_s if drafted else without_s, drafted=drafted)
    assert sides == [True, False] * 3  # in turn
    assert gate.model == [10.0, pytest.approx(0.010)]
    assert gate.without == [10.0, pytest.approx(0.010)]  # the mean of 14, 8 and 8 ms, not the first alone
    gate.record(tokens=10.0, seconds=0.011, drafted=True)
    assert not gate.pays()  # 10 tokens in 10.25 ms (the 4th round at weight 1/4) against 10 in 10 ms


def test_model_gate_measures_a_side_again_afresh():
    """A side explored again runs `min_rounds` rounds whose mean replaces its stale average, and is
    judged after them: a model shut out at 100 tok/s (150 without) that now makes 250 comes back,
    where one round at the average's weight (0.1) would have left it at 115 and the wait doubled;
    one still at 100 waits twice as long, once its rounds are over. Rounds without it are probed the
    same way while it pays."""
    def measured(model: float, without: float) -> ModelGate:
        gate = ModelGate(weight=0.1, explore_every=4, min_rounds=3)
        gate.model, gate.without, gate.counts = [model, 1.0], [without, 1.0], [50, 50]
        return gate

    for now, back in ((250.0, True), (100.0, False)):
        gate = measured(100.0, 150.0)
        for _ in range(4):
            assert not gate.use()
            gate.skip()
        for _ in range(3):
            assert gate.use() and gate.wait == 4
            gate.record(tokens=now, seconds=1.0, drafted=True)
        assert gate.model == [pytest.approx(now), 1.0] and gate.pays() == back
        assert gate.use() == back and gate.wait == (4 if back else 8)
    gate = measured(250.0, 150.0)
    gate.used = gate.probe
    for _ in range(3):  # rounds without it, measured afresh: now 300 tok/s
        assert not gate.use()
        gate.skip()
        gate.record(tokens=300.0, seconds=1.0, drafted=False)
    assert not gate.pays() and not gate.use() and gate.probe == 4


def test_model_gate_compares_with_the_rounds_the_model_would_replace():
    """Batch 1 on prompts a lookup often copies: its rounds make 3 tokens in 8 ms, the model's 2.2
    in 13 ms, plain rounds 1 in 6.5 ms. Against all rounds (375 tok/s) the model would never run;
    against the rounds it replaces (154 tok/s) it pays (169 tok/s). Rounds every row of which had a
    match are not recorded (`HybridDrafter.observe`), so they cannot sway it."""
    gate = ModelGate(weight=1.0)
    gate.record(tokens=2.2, seconds=0.013, drafted=True)
    gate.record(tokens=1.0, seconds=0.0065, drafted=False)
    assert gate.pays() and gate.use()


def test_model_gate_keeps_a_model_that_pays_through_noisy_rounds():
    """A model round makes 1, 2 or 3 tokens (2 drafts, each accepted at 0.55), one without it 1
    token; the model's rounds make 1.25x the tokens per second of the others (or 0.8x). The gate
    must leave the paying model out of few rounds, not chase the noise of a short average
    (weight 0.1 left it out of 15 % of 1000 rounds), and still keep the losing one out."""
    def rounds_without(pays: float, seed: int) -> int:
        rng, gate, without = random.Random(seed), ModelGate(), 0
        for _ in range(1000):
            if gate.use():
                accepted = 0
                while accepted < 2 and rng.random() < 0.55:
                    accepted += 1
                gate.record(1 + accepted, 1.85 * 0.0043 / pays * rng.uniform(0.9, 1.1), drafted=True)
            else:
                gate.skip()
                without += 1
                gate.record(1, 0.0043 * rng.uniform(0.9, 1.1), drafted=False)
        return without

    assert sum(rounds_without(1.25, seed) for seed in range(10)) < 10 * 60
    assert sum(rounds_without(0.8, seed) for seed in range(10)) > 10 * 850


def never_pays(gate: ModelGate) -> ModelGate:
    """`gate` as measured: rounds with the model make 1 token a second, rounds without it 10."""
    gate.record(tokens=1.0, seconds=1.0, drafted=True)
    gate.record(tokens=10.0, seconds=1.0, drafted=False)
    return gate


def test_hybrid_drops_a_draft_model_that_does_not_pay():
    """A draft model whose proposals are never accepted stops running (but for exploration rounds),
    and the output stays the target's."""
    pair, ids, refs = loopy()
    engine = SpecEngine(pair, EngineConfig(method="eqspec", batch_size=2, gamma=3, drafter="hybrid", adaptive=False))
    hybrid = engine.drafter
    hybrid.gate = ModelGate(explore_every=1000)
    model_propose, calls = hybrid.model.propose, []

    def wrong(reqs, gamma, uniforms, sampling, lengths=None):
        calls.append(len(reqs))
        out = model_propose(reqs, gamma, uniforms, sampling, lengths)
        out.tokens = (out.tokens + 1) % pair.vocab_size  # never the target's token
        return out

    hybrid.model.propose = wrong
    outs = engine.generate(ids, SamplingParams(max_new_tokens=MAX_NEW))
    assert [o.token_ids for o in outs] == refs
    # the first model round (its prompt catch-up left out pro rata) gets no draft accepted for its
    # time: measured against the next round without it, it does not pay, and every later round
    # with a row without a match skips it
    assert len(calls) == 1 and not hybrid.gate.pays() and hybrid.gate.skipped > 20


def test_the_gate_charges_a_model_round_its_share_of_the_catch_up(monkeypatch):
    """A model round that first catches up on a row (its prompt, or what the lookup drafted) is
    charged the share of the catch-up a plan charges (`AdaptivePolicy.catch_up_share`); the rest
    serves later rounds and is left out, pro rata of the tokens fed. Here the draft model runs
    1.04 s on a row whose catch-up feeds it 102 tokens (`DraftModelDrafter.feeds`: 100 beyond the
    usual 2) with 4 to draft: a quarter of the
    catch-up is charged, so 1.04 x 75 / 104 = 0.75 s is left out and the round records 0.29 s.
    Left out whole, a request the lookup serves almost alone paid a full catch-up for a model
    round or two that the gate never saw."""
    now = [0.0]
    monkeypatch.setattr(hybrid_module.time, "perf_counter", lambda: now[0])
    row = request(range(110))  # (its draft row empty: a window's feed of 102 tokens, not all 110)
    monkeypatch.setattr(hybrid_module.AdaptivePolicy, "catch_up_share", staticmethod(lambda req, share=1.0: 0.25))

    def model_propose(reqs, gamma, uniforms, sampling, lengths=None):
        now[0] += 1.04
        return DraftProposal(torch.zeros(len(reqs), gamma, dtype=torch.long), None)

    runner = SimpleNamespace(name="draft", device=CPU)
    model = SimpleNamespace(runner=runner, propose=model_propose, observe=lambda reqs, accepted: None,
                            feeds=lambda req: 102)
    lookup = SimpleNamespace(label="none", catch_up_s=0.0, find=lambda req, limit: ([], []))
    hybrid = HybridDrafter(model, lookup)
    hybrid.gate = ModelGate(weight=1.0)
    hybrid.propose([row], 4, None, BatchSampling.of([row.params], CPU))
    assert hybrid._round[1] == pytest.approx(0.75)
    hybrid.observe([row], [3])
    assert hybrid.gate.model == pytest.approx([4.0, 0.29])


# ------------------------------------------------------------------------------------- greedy equivalence
MAX_NEW = 24


@functools.cache
def loopy():
    """(pair with a perturbed draft, prompts, references). The prompts carry 0 to 48 tokens of the
    target's own greedy output, so rows are at different stages: some before any cycle (drafts
    rejected), some inside one (drafts accepted). EOS is a token the outputs repeat from their
    prompts, so some rows stop inside a copied span and others run to max_new_tokens."""
    target = make_model("llama", 64, 2, seed=0)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.01)
    draft = perturbed(target, 0.05, seed=3)
    base = prompts(8, seed=5, max_len=24)
    longer = references(ModelPair(target, None, None, VOCAB, ()), base, 48 + MAX_NEW)
    warm = [0, 8, 24, 40, 0, 16, 32, 48]
    ids = [b + out[:w] for b, out, w in zip(base, longer, warm)]
    counts = {}
    for p, out, w in zip(ids, longer, warm):
        for t in set(out[w + 2:w + MAX_NEW]) & set(p):
            counts[t] = counts.get(t, 0) + 1
    eos = max(counts, key=lambda t: (counts[t] if counts[t] < len(ids) // 2 else 0, -t))
    pair = ModelPair(target, draft, None, VOCAB, (eos,))
    refs = references(pair, ids, MAX_NEW)
    assert any(len(r) < MAX_NEW for r in refs) and any(len(r) == MAX_NEW for r in refs)
    return pair, ids, refs


class Recorder:
    """Wraps a drafter: records each row-round's (proposed tokens, accepted count)."""

    def __init__(self, inner):
        self.inner, self.rounds = inner, []
        self.label, self.synthetic = inner.label, inner.synthetic

    def prefill(self, reqs, ends):
        self.inner.prefill(reqs, ends)

    def propose(self, reqs, gamma, uniforms, sampling, lengths=None):
        self.last = self.inner.propose(reqs, gamma, uniforms, sampling, lengths)
        return self.last

    def observe(self, reqs, accepted):
        rows = self.last.tokens.tolist()
        lengths = self.last.lengths or [len(rows[0])] * len(rows)
        self.rounds.append([(row[:n], a) for row, n, a in zip(rows, lengths, accepted)])
        self.inner.observe(reqs, accepted)

    def release(self, req):
        self.inner.release(req)


@pytest.mark.parametrize("drafter", ["ngram", "suffix", "hybrid:ngram", *(pytest.param(d, marks=pytest.mark.slow)
                                                                         for d in ("hybrid:suffix", "ngram:1,3,3"))])
def test_greedy_output_is_exact(drafter):
    pair, ids, refs = loopy()
    if not drafter_uses_model(drafter):
        pair = ModelPair(pair.target, None, None, pair.vocab_size, pair.eos_token_ids)
    hist = {}
    for method in ("eqspec", "exspec"):
        for bs in (1, 3):
            engine = SpecEngine(pair, EngineConfig(method=method, batch_size=bs, gamma=4, drafter=drafter,
                                                   debug=True))
            outs = engine.generate(ids, SamplingParams(max_new_tokens=MAX_NEW))
            assert [o.token_ids for o in outs] == refs, f"{drafter} {method} bs={bs}"
            hist = engine.stats.accept_hist
    assert hist[0] > 0 and hist[3] + hist[4] > 0  # ragged: some rows reject at once, others accept several


@pytest.mark.parametrize("drafter", ["ngram", "hybrid:ngram", "hybrid:suffix"])
def test_greedy_output_is_exact_with_adaptive_lengths_and_budgets(drafter):
    pair, ids, refs = loopy()
    if not drafter_uses_model(drafter):
        pair = ModelPair(pair.target, None, None, pair.vocab_size, pair.eos_token_ids)
    for options in (dict(adaptive=True), dict(budget=4)):
        engine = SpecEngine(pair, EngineConfig(method="eqspec", batch_size=3, gamma=4, drafter=drafter, debug=True,
                                               **options))
        outs = engine.generate(ids, SamplingParams(max_new_tokens=MAX_NEW))
        assert [o.token_ids for o in outs] == refs, f"{drafter} {options}"


def test_eos_accepted_inside_a_copied_span():
    pair, ids, refs = loopy()
    free = ModelPair(pair.target, None, None, pair.vocab_size, pair.eos_token_ids)
    # (the workload's EOS inside a copied span is the last prompt's first token, drafted in its first
    # round: prefilled apart, as a prompt joining a round drafts nothing there)
    engine = SpecEngine(free, EngineConfig(method="eqspec", batch_size=4, gamma=4, drafter="ngram", adaptive=False,
                                           fuse_prefill=False))
    engine.drafter = recorder = Recorder(engine.drafter)
    outs = engine.generate(ids, SamplingParams(max_new_tokens=MAX_NEW))
    assert [o.token_ids for o in outs] == refs
    eos = pair.eos_token_ids[0]
    assert any(eos in tokens[:a] for rnd in recorder.rounds for tokens, a in rnd)
    assert all(eos not in tokens[:-1] for rnd in recorder.rounds for tokens, _ in rnd)  # cut after it


def test_hybrid_mixes_rows_and_keeps_the_draft_kv_exact():
    """Rows switch between n-gram and draft-model drafting from round to round; the draft model
    drafts only for its rows and catches up on the tokens it did not see."""
    pair, ids, refs = loopy()
    engine = SpecEngine(pair, EngineConfig(method="exspec", batch_size=2, gamma=3, drafter="hybrid", debug=True,
                                           adaptive=False))  # (every round drafts: no plan reads the clock)
    hybrid = engine.drafter
    assert isinstance(hybrid, HybridDrafter)
    hybrid.gate = ModelGate(explore_every=0)  # the model drafts for every row without a match (no timing involved)
    mixes, calls = [], []
    model_propose = hybrid.model.propose

    def counting(reqs, *args, **kwargs):
        calls.append(len(reqs))
        return model_propose(reqs, *args, **kwargs)

    hybrid.model.propose = counting
    inner_propose = hybrid.propose

    def recording(reqs, *args, **kwargs):
        out = inner_propose(reqs, *args, **kwargs)
        mixes.append((len(hybrid._model_rows), len(reqs)))
        return out

    hybrid.propose = recording
    outs = engine.generate(ids, SamplingParams(max_new_tokens=MAX_NEW))
    assert [o.token_ids for o in outs] == refs
    assert any(0 < m < n for m, n in mixes)  # some batches mixed n-gram and draft-model rows
    assert any(m == 0 for m, _ in mixes)  # some rounds never ran the draft model
    assert calls == [m for m, _ in mixes if m]  # ... which only ever saw the rows it drafted for


def test_a_lookup_prices_what_it_would_index_first():
    """`index_s`: the tokens a lookup has not indexed (a row's own at its share; for greedy rows
    the finished requests waiting for the shared trie, at most the `intake` of a round) times the
    seconds a token measured; nothing before a catch-up was timed."""
    drafter = SuffixDrafter(CPU)
    first, second = request(range(100), 0), request(range(200, 250), 1)
    assert drafter.index_s([first], [1.0], 10.0) == 0.0  # not timed yet
    drafter.find(first, 4)  # indexes 100 tokens at once: timed
    rate = drafter.token_s
    assert rate > 0 and drafter.unindexed(first) == 0 and drafter.unindexed(second) == 50
    assert drafter.index_s([first, second], [0.5, 0.25], 10.0) == pytest.approx(rate * 50 * 0.25)
    first.finish_reason = FinishReason.LENGTH
    drafter.release(first)  # its 100 tokens wait for the shared trie
    sampled = Request(2, list(range(300, 340)), SamplingParams(max_new_tokens=9, temperature=1.0), frozenset())
    assert drafter.index_s([second, sampled], [0.25, 0.5], 1000.0) == pytest.approx(rate * (50 * 0.25 + 40 * 0.5 + 100))
    # a backlog beyond a round's intake is not this round's to pay (plain rounds left it)
    assert drafter.index_s([second, sampled], [0.25, 0.5], 30.0) == pytest.approx(rate * (50 * 0.25 + 40 * 0.5 + 30))
    assert drafter.index_s([sampled], [0.5], 1000.0) == pytest.approx(rate * 40 * 0.5)  # no greedy row reads it
    ngram = NgramDrafter(CPU)
    ngram.prefill([second], [50])  # (the n-gram index takes prompts in at prefill)
    ngram.token_s = rate
    assert ngram.index_s([second], [1.0], 10.0) == 0.0
    second.token_ids.extend(range(30))
    assert ngram.index_s([second], [0.5], 10.0) == pytest.approx(rate * 30 * 0.5)


@pytest.mark.parametrize("drafter", ["hybrid:ngram", "ngram"])
def test_indexing_that_costs_more_than_speculating_saves_keeps_rounds_plain(drafter, monkeypatch):
    """`run_round` charges what the lookup would index first (`index_s`) before a hybrid's lookups
    and to the plan: priced at 10 s, no lookup runs and every round is plain, output unchanged."""
    pair, ids, refs = loopy()
    engine = SpecEngine(pair, EngineConfig(batch_size=3, gamma=4, drafter=drafter, adaptive=True))
    monkeypatch.setattr(type(engine.drafter), "index_s", lambda self, reqs, shares, intake: 10.0)
    found = []
    lookup = engine.drafter.lookup if drafter.startswith("hybrid") else engine.drafter
    find = lookup.find
    lookup.find = lambda req, limit: found.append(1) or find(req, limit)
    assert [o.token_ids for o in engine.generate(ids, SamplingParams(max_new_tokens=MAX_NEW))] == refs
    assert not found and set(engine.last_run.gamma_hist) == {0}


def test_a_lookahead_is_timed_per_row_it_looks_up(monkeypatch):
    """`lookahead_s`: 0 until a lookahead ran, then its seconds per row looked up (rows with a
    cap of 0 are not looked up, and not charged) times the rows it would look up, an exponential
    average; the lookup's catch-up is not in it (`index_s` prices that)."""
    hybrid = HybridDrafter(None, NgramDrafter(CPU, 1, 3, 4))
    assert hybrid.lookahead_s([3] * 8) == 0.0
    clock = iter([1.0, 1.5, 2.0, 2.1])  # lookaheads of 0.5 s over 2 rows, then 0.1 s over 1
    monkeypatch.setattr(hybrid, "_clock", lambda: next(clock))
    rows = [request([A, B, C, A, B], 0), request([A, B, C, D, E], 1), request([A, B], 2)]
    hybrid.lookahead(rows, [3, 3, 0])
    assert hybrid.lookahead_s([3] * 8 + [0]) == pytest.approx(8 * 0.25)
    hybrid.lookahead(rows[:1], [3])
    assert hybrid.lookahead_s([3]) == pytest.approx(0.25 + 0.1 * (0.1 - 0.25))


def test_the_model_share_is_the_rows_the_lookup_found_nothing_for():
    """`model_share`: of the rows a lookahead (or a `propose` without one) looked up, the share
    its lookup found nothing for, with one such row as a prior; rows with a cap of 0 are not
    looked up. It prices a new request's catch-up (`AdaptivePolicy.catch_up_share`)."""
    model = SimpleNamespace(runner=SimpleNamespace(name="draft", device=CPU))  # (never asked to draft here)
    hybrid = HybridDrafter(model, NgramDrafter(CPU, 1, 3, 4))
    assert hybrid.model_share() == 1.0
    hybrid.gate.use = lambda: False
    rows = [request([A, B, C, A, B], 0), request([A, B, C, D, E], 1), request([A, B], 2)]
    looked = hybrid.lookahead(rows, [3, 3, 0])
    assert looked[0] and looked[1] == []  # a match (A, B -> C), none
    assert hybrid.model_share() == pytest.approx((1 + 1) / (2 + 1))
    hybrid.propose(rows[:1], 3, None, GREEDY)  # its own lookup: a match
    assert hybrid.model_share() == pytest.approx((1 + 1) / (3 + 1))


def test_the_plan_and_the_gate_price_a_catch_up_with_the_model_share(monkeypatch):
    """Both places that charge a round its share of the draft model's catch-up, the plan
    (`run_round`'s first_fed) and the hybrid's gate (`propose`'s spared time), give
    `catch_up_share` the hybrid's `model_share` as a new request's prior; output unchanged."""
    pair, ids, refs = loopy()
    engine = SpecEngine(pair, EngineConfig(batch_size=3, gamma=4, drafter="hybrid:ngram", adaptive=True))
    engine.drafter.gate = ModelGate(explore_every=0)  # the model drafts every row without a match
    policy = engine.policy  # every round planned, and every row drafted as far as it may (else
    policy.standing.length = lambda rows: None  # whether the model drafts at all is the clock's call)
    policy.may_speculate = lambda *a, **k: True
    policy.plan = lambda alphas, caps, *a, **k: list(caps)
    monkeypatch.setattr(type(engine.drafter), "model_share", lambda self: 0.125)
    share, seen = hybrid_module.AdaptivePolicy.catch_up_share, []

    def recorded(req, model_share=1.0):
        seen.append((sys._getframe(1).f_code.co_filename.rsplit("/", 1)[-1], model_share))
        return share(req, model_share)

    monkeypatch.setattr(hybrid_module.AdaptivePolicy, "catch_up_share", staticmethod(recorded))
    assert [o.token_ids for o in engine.generate(ids, SamplingParams(max_new_tokens=MAX_NEW))] == refs
    assert {name for name, _ in seen} == {"round.py", "hybrid.py"}
    assert all(s == 0.125 for _, s in seen)


def test_lookups_that_cost_more_than_speculating_saves_are_not_made(monkeypatch):
    """`run_round` charges a hybrid's lookahead (`lookahead_s`, paid whatever the plan then says)
    to speculating when it asks whether even free drafts would pay: priced at 10 s a lookahead,
    no lookup runs and every round is plain, output unchanged."""
    pair, ids, refs = loopy()
    engine = SpecEngine(pair, EngineConfig(batch_size=3, gamma=4, drafter="hybrid:ngram", adaptive=True))
    monkeypatch.setattr(type(engine.drafter), "lookahead_s", lambda self, caps: 10.0)
    found = []
    find = engine.drafter.lookup.find
    engine.drafter.lookup.find = lambda req, limit: found.append(1) or find(req, limit)
    assert [o.token_ids for o in engine.generate(ids, SamplingParams(max_new_tokens=MAX_NEW))] == refs
    assert not found and set(engine.last_run.gamma_hist) == {0}


@pytest.mark.parametrize("model", [True, False])
def test_the_hybrid_looks_up_before_the_policy_plans(model):
    """With a policy, the hybrid's lookups run before the plan (`HybridDrafter.lookahead`): a row
    the lookup drafts is planned no longer than what it found and costs no draft-model step
    (first_fed 0), and `propose` reuses the lookups instead of searching again. With the model
    kept off, rounds in which no lookup finds anything are plain, and that plan is not kept for
    the next rounds (`plain_now`); the gate is told of every round whose unmatched rows it kept
    undrafted, plain ones included (`run_round` calls `observe` after a lookahead)."""
    pair, ids, refs = loopy()
    engine = SpecEngine(pair, EngineConfig(method="eqspec", batch_size=3 if model else 1, gamma=4,
                                           drafter="hybrid:ngram", adaptive=True, debug=True))
    hybrid, policy = engine.drafter, engine.policy
    if model:
        hybrid.gate = ModelGate(explore_every=0)  # the model drafts every row without a match
    else:
        hybrid.gate = never_pays(ModelGate(explore_every=10 ** 9))  # unmatched rows draft nothing
    rounds, finds, undrafted = [], [0], []
    lookahead, plan, find, record = hybrid.lookahead, policy.plan, hybrid.lookup.find, hybrid.gate.record

    def looking(reqs, caps):
        rounds.append({"looked": lookahead(reqs, caps), "finds": finds[0], "asked": list(caps)})
        return rounds[-1]["looked"]

    def recording(tokens, seconds, drafted):
        undrafted.append(not drafted)
        return record(tokens, seconds, drafted)

    def planning(alphas, caps, weights=None, first_fed=None, **kwargs):
        lengths = plan(alphas, caps, weights, first_fed, **kwargs)
        if rounds and "looked" in rounds[-1] and "caps" not in rounds[-1]:
            rounds[-1].update(caps=list(caps), first_fed=list(first_fed), kept=policy._memo)
        return lengths

    def finding(req, limit):
        finds[0] += 1
        return find(req, limit)

    hybrid.lookahead, policy.plan, hybrid.lookup.find, hybrid.gate.record = looking, planning, finding, recording
    outs = engine.generate(ids, SamplingParams(max_new_tokens=MAX_NEW))
    assert [o.token_ids for o in outs] == refs
    planned = [r for r in rounds if "caps" in r]
    looked = [n for r in planned for n in r["looked"]]
    assert any(looked) and (None if model else []) in looked  # rows the lookup drafts, and the others
    for r in planned:
        # a plain plan is kept only if it turned down what the lookup found
        assert r["kept"] is None or any(r["looked"])
        for found, cap, fed in zip(r["looked"], r["caps"], r["first_fed"]):
            if found is not None:
                assert cap <= len(found) and fed == 0.0
            else:
                assert fed >= 1.0
    assert model or any(not any(r["caps"]) for r in planned)  # (such rounds happened)
    # each request counts the rounds its lookup drafted (what its draft model's catch-up is shared by)
    assert all(o.stats.looked_up <= o.stats.first_drafted for o in outs) and sum(o.stats.looked_up for o in outs)
    assert model or all(o.stats.looked_up == o.stats.first_drafted for o in outs)
    # the gate hears of every round whose unmatched rows it kept undrafted, plain ones included
    skipped = [any(n == [] and c > 0 for n, c in zip(r["looked"], r["asked"])) for r in rounds]
    assert sum(undrafted) == sum(skipped) and (model or sum(undrafted) > 0)
    for before, after in zip(rounds, rounds[1:] + [{"finds": finds[0]}]):  # one search per row and round
        assert after["finds"] - before["finds"] <= len(before["looked"])


def test_the_hybrids_lookups_serve_only_the_round_they_were_made_for():
    """`lookahead` says what the lookup found (row 0: C A B after A B; row 1: no match, so the
    model's) and keeps it for the next `propose` of the same rows at the same lengths only: a plan
    that then drafts nothing leaves lookups that must not pass for the next round's."""
    hybrid = HybridDrafter(None, NgramDrafter(CPU, 1, 3, 4))
    rows = [request([A, B, C, A, B], 0), request([A, B, C, D, E], 1)]
    assert hybrid.lookahead(rows, [3, 3]) == [match_confidence([0.5] * 3, 2), None]  # (A B matched)
    assert hybrid._found[:2] == (hybrid._key(rows), [([C, A, B], match_confidence([0.5] * 3, 2)), ([], [])])
    rows[0].token_ids.append(C)  # a plain round committed a token
    assert hybrid._found[0] != hybrid._key(rows)


def test_a_gate_that_keeps_the_model_off_still_explores_it_under_a_policy():
    """Rows without a match get no draft (0) while the gate says the model does not pay; those
    rounds count as skipped, so after `explore_every` of them the model is tried again (None)."""
    hybrid = HybridDrafter(None, NgramDrafter(CPU, 1, 3, 4))
    hybrid.gate = never_pays(ModelGate(explore_every=2))
    row = [request([A, B, C, D, E], 0)]
    assert hybrid.lookahead(row, [3]) == [[]] and hybrid.lookahead(row, [3]) == [[]]
    assert hybrid.lookahead(row, [3]) == [None]  # explored


def test_the_gate_counts_a_round_it_kept_the_model_off_once():
    """Under a policy the gate decides in `lookahead`; `propose` then drafts the sampled rows it
    could not keep off (seeded ones, held at their length) without asking again, so a round counts
    once toward the next exploration and, mixing model rows and undrafted ones, is recorded on
    neither side."""
    pair, ids, refs = loopy()
    engine = SpecEngine(pair, EngineConfig(method="eqspec", batch_size=4, gamma=3, drafter="hybrid:ngram",
                                           adaptive=True))
    hybrid = engine.drafter
    hybrid.gate = never_pays(ModelGate(explore_every=10 ** 9))
    events, record, observe = [[]], hybrid.gate.record, hybrid.observe  # per round: what the gate heard
    hybrid.gate.skip = lambda: events[-1].append("skip")
    hybrid.gate.record = lambda tokens, seconds, drafted: events[-1].append(drafted) or record(tokens, seconds, drafted)

    def observing(reqs, accepted):
        model_rows = list(hybrid._model_rows)
        observe(reqs, accepted)
        events[-1].append(("model rows", len(model_rows), len(reqs)))
        events.append([])

    hybrid.observe = observing
    params = [SamplingParams(max_new_tokens=MAX_NEW) if i % 2 else
              SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, seed=request_seed(4, i)) for i in range(len(ids))]
    outs = engine.generate(ids, params)
    assert [o.token_ids for o, p in zip(outs, params) if p.greedy] == [r for r, p in zip(refs, params) if p.greedy]
    rounds = [e for e in events if e]
    assert all(e.count("skip") <= 1 for e in rounds)  # one skip per round at most
    mixed = [e for e in rounds if "skip" in e and e[-1][1] > 0]  # greedy rows kept off, sampled ones drafted
    assert mixed and not any(True in e or False in e for e in mixed)  # ... recorded on neither side
    assert any(False in e for e in rounds)  # rounds with every unmatched row undrafted are recorded


def test_the_draft_model_reports_its_catch_up():
    """`DraftProposal.caught_up`: the tokens the draft model fed beyond the 1-2 a row it drafted
    last round has unseen. The hybrid's model rows catch up after rounds the lookup served; an
    adaptive policy leaves such rounds out of its measurements (sched/adaptive.py)."""
    pair, ids, refs = loopy()
    engine = SpecEngine(pair, EngineConfig(method="eqspec", batch_size=3, gamma=3, drafter="hybrid:ngram",
                                           adaptive=False))
    engine.drafter.gate = ModelGate(explore_every=0)  # the model drafts every row without a match
    model, seen = engine.drafter.model, []
    propose = model.propose

    def recording(reqs, gamma, uniforms, sampling, lengths=None, **kwargs):
        lag = [r.num_tokens - r.kv_len.get("draft", 0) for r in reqs]
        out = propose(reqs, gamma, uniforms, sampling, lengths, **kwargs)
        seen.append((sum(max(0, u - 2) for u, n in zip(lag, lengths or [gamma] * len(reqs)) if n > 0), out.caught_up))
        return out

    model.propose = recording
    outs = engine.generate(ids, SamplingParams(max_new_tokens=MAX_NEW))
    assert [o.token_ids for o in outs] == refs
    assert all(expected == got for expected, got in seen)
    assert any(got > 0 for _, got in seen) and any(got == 0 for _, got in seen)


@pytest.mark.parametrize("kind", ["ngram", "suffix"])
def test_a_lookup_counts_indexing_beyond_a_round_as_catch_up(kind):
    """`LookupDrafter.catch_up_s`: a lookup after a round's worth of new tokens (at most 1 + its
    cap) counts nothing; one after a stretch no round looked up (or of a new prompt) counts the
    share beyond that; the suffix drafter's intake of finished requests counts whole."""
    drafter = NgramDrafter(CPU, 2, 3, 4) if kind == "ngram" else SuffixDrafter(CPU, depth=6, k=4)
    r = request([A, B, C, D, A, B] * 50, index=1)
    drafter.find(r, 4)  # a 300-token prompt, indexed at once
    counted = drafter.catch_up_s
    assert counted > 0
    for step in ([C, D, A], [B, C], [D, A, B, C, D]):  # 3, 2, 5 new tokens: a round's worth at cap 4
        r.append(step)
        drafter.find(r, 4)
    assert drafter.catch_up_s == counted
    r.append([C, D] * 100)  # 100 rounds no lookup read
    drafter.find(r, 4)
    assert drafter.catch_up_s > counted
    if kind == "suffix":
        done = request([E, D, C, B, A] * 200, index=2)
        done.finish_reason = FinishReason.LENGTH
        drafter.release(done)
        counted = drafter.catch_up_s
        r.append([A])
        drafter.find(r, 4)  # one new token; the shared trie takes the finished request in
        assert drafter.catch_up_s > counted


def test_a_lookups_catch_up_is_not_what_a_round_costs():
    """A round's lookup catch-up serves later rounds: the policy's draft time and the gate's round
    time leave it out (`run_round`, `HybridDrafter._clock`). Here every lookup takes 30 ms, all
    counted as catch-up: counted in, every round that looks up would measure > 30 ms. Every row
    drafts its cap, so the draft model runs in rounds that look up (timing decides whether the
    plan would have it)."""
    pair, ids, refs = loopy()
    engine = SpecEngine(pair, EngineConfig(method="eqspec", batch_size=3, gamma=4, drafter="hybrid:ngram",
                                           adaptive=True))
    hybrid, policy = engine.drafter, engine.policy
    hybrid.gate = ModelGate(explore_every=0)  # the model drafts every row without a match
    lookup, heard, timed, finds = hybrid.lookup, [], [], [0]
    find, observe, record, plan = lookup.find, policy.observe, hybrid.gate.record, policy.plan

    def planning(alphas, caps, *args, **kwargs):  # every row drafts its cap: the model runs whatever
        plan(alphas, caps, *args, **kwargs)  # the plan (timed on a busy machine) would have said
        return list(caps)

    def finding(req, limit):
        finds[0] += 1
        start = time.perf_counter()
        time.sleep(0.03)
        lookup.catch_up_s += time.perf_counter() - start
        return find(req, limit)

    def observing(accepted, verified, confidence, verify_s, draft_s, caught_up=False, timed=True, looked=None):
        heard.append((draft_s, caught_up))
        return observe(accepted, verified, confidence, verify_s, draft_s, caught_up, timed, looked)

    def recording(tokens, seconds, drafted):
        timed.append(seconds)
        return record(tokens, seconds, drafted)

    lookup.find, policy.observe, hybrid.gate.record, policy.plan = finding, observing, recording, planning
    outs = engine.generate(ids, SamplingParams(max_new_tokens=MAX_NEW))
    assert [o.token_ids for o in outs] == refs
    assert finds[0] > 0 and heard and timed
    # (a round in which the draft model caught up is left out of the policy's measurements anyway)
    assert max(s for s, caught_up in heard if not caught_up) < 0.03 and max(timed) < 0.03


# ------------------------------------------------------------------------------------- sampling
V = 8
# ends with (6, 2, 0), seen before: n-gram proposes 2, 2, 6, which the target draws with
# probabilities 0.26 and then 0.32 at temperature 1: drafts are often kept, often not
PROMPT = [6, 2, 0, 2, 2, 6, 2, 0]
OTHER = [3, 1, 4, 1, 5]  # no n-gram of 2 or more seen before
N = 3000


@torch.no_grad()
def exact_joint(sp: SamplingParams, prompt=tuple(PROMPT)) -> torch.Tensor:
    """P(t1, t2) under the target alone: [V, V] (transformers' warpers, not batchspec's)."""
    target, _ = models()
    p1 = warped_probs(target(torch.tensor([list(prompt)])).logits[:, -1], sp)[0]
    p2 = warped_probs(target(torch.tensor([list(prompt) + [t] for t in range(V)])).logits[:, -1], sp)
    return p1[:, None] * p2


def ngram_samples(sp: SamplingParams, drafter: str = "ngram", gamma: int = 3) -> tuple[torch.Tensor, SpecEngine]:
    """N seeded samples of (t1, t2): [N, 2], and the engine that drew them."""
    target, draft = models()
    pair = ModelPair(target, draft if drafter_uses_model(drafter) else None, None, V, ())
    engine = SpecEngine(pair, EngineConfig(method="eqspec", batch_size=32, gamma=gamma, drafter=drafter))
    params = [SamplingParams(temperature=sp.temperature, top_k=sp.top_k, max_new_tokens=2 + gamma,
                             seed=request_seed(1, i)) for i in range(N)]
    outs = engine.generate([PROMPT] * N, params)
    return torch.tensor([o.token_ids[:2] for o in outs]), engine


@pytest.mark.slow
@pytest.mark.parametrize("sp", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=3)])
def test_ngram_sampling_matches_the_target(sp):
    draws, engine = ngram_samples(sp)
    assert chi_square(draws, exact_joint(sp)) > 1e-4
    hist = engine.stats.accept_hist  # the point masses are accepted sometimes, and rejected sometimes
    assert engine.stats.drafted > engine.stats.accepted > 0 and hist[0] > 0 and hist[1] + hist[2] + hist[3] > 0


@pytest.mark.slow
def test_suffix_sampling_matches_the_target():
    draws, engine = ngram_samples(SamplingParams(temperature=1.0), drafter="suffix")
    assert chi_square(draws, exact_joint(SamplingParams(temperature=1.0))) > 1e-4
    assert engine.stats.drafted > engine.stats.accepted > 0 and engine.stats.accept_hist[0] > 0


@pytest.mark.slow
def test_hybrid_sampling_matches_the_target():
    """Every batch mixes n-gram rows (one-hot q) and draft-model rows (the model's q)."""
    target, draft = models()
    engine = SpecEngine(ModelPair(target, draft, None, V, ()),
                        EngineConfig(method="eqspec", batch_size=32, gamma=2, drafter="hybrid"))
    engine.drafter.gate = ModelGate(explore_every=0)  # model rows in every batch, whatever the clock says
    sp = SamplingParams(temperature=1.0, max_new_tokens=4)
    n = 2 * (N // 3)
    params = [SamplingParams(temperature=1.0, max_new_tokens=4, seed=request_seed(2, i)) for i in range(n)]
    outs = engine.generate([PROMPT if i % 2 else OTHER for i in range(n)], params)
    for parity, prompt in ((1, PROMPT), (0, OTHER)):
        draws = torch.tensor([o.token_ids[:2] for o in outs[parity::2]])
        assert chi_square(draws, exact_joint(sp, tuple(prompt))) > 1e-4


def accept_always(p, q, drafts, u_accept, u_final, lengths=None):
    """Broken: every proposed token is kept (as if the drafter were always right)."""
    res = rejection_verify(p, q, drafts, u_accept, u_final, lengths)
    n = lengths if lengths is not None else torch.full_like(res.accepted, drafts.shape[1])
    return VerifyResult(n, torch.cat([drafts, res.tokens[:, -1:]], dim=1))


def test_accepting_always_fails_the_same_test(monkeypatch):
    monkeypatch.setattr(round_module, "rejection_verify", accept_always)
    sp = SamplingParams(temperature=1.0)
    assert chi_square(ngram_samples(sp)[0], exact_joint(sp)) < 1e-6


def test_a_seeded_sampled_request_does_not_depend_on_the_gate():
    """The gate reads the clock, so it must not decide for sampled rows: with the draft model shut
    off for greedy rows, a seeded request samples exactly what it samples with the model always on."""
    pair, ids, _ = loopy()
    params = [SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, seed=request_seed(3, i)) for i in range(len(ids))]
    outs = []
    for gate in (ModelGate(explore_every=0), ModelGate(explore_every=10 ** 9)):
        engine = SpecEngine(pair, EngineConfig(method="eqspec", batch_size=2, gamma=3, drafter="hybrid"))
        engine.drafter.gate = gate
        if gate.explore_every:  # measured: the model never pays
            never_pays(gate)
            assert not gate.use()
        outs.append([o.token_ids for o in engine.generate(ids, params)])
    assert outs[0] == outs[1]


def test_lookups_are_guarded_only_after_a_plain_round_or_at_the_start(monkeypatch):
    """`may_speculate` (would free drafts pay?) guards a hybrid's lookups after plain rounds and
    before the first; after a round that verified drafts it is not asked (the answer is yes but
    for a rare turn, and at batch 1 asking cost as much as the plan itself). Output unchanged."""
    pair, ids, refs = loopy()
    engine = SpecEngine(pair, EngineConfig(method="eqspec", batch_size=3, gamma=4, drafter="hybrid:ngram",
                                           adaptive=True))
    policy, asked = engine.policy, []
    may = policy.may_speculate
    monkeypatch.setattr(policy, "may_speculate", lambda *a, **k: asked.append(policy.last_plain) or may(*a, **k))
    assert [o.token_ids for o in engine.generate(ids, SamplingParams(max_new_tokens=MAX_NEW))] == refs
    assert None in asked and False not in asked
    assert engine.last_run.drafted  # (rounds verified drafts, after which it was not asked)


def test_match_confidence_worked_example():
    """A copy is likelier the longer the match it follows and the more often what it copies
    followed that context before (ngram.py, `match_confidence`)."""
    assert match_confidence([0.5] * 3, 2) == pytest.approx([0.5, 2 / 3, 0.75])
    assert match_confidence([0.5], 6) == pytest.approx([5 / 6])
    assert match_confidence([0.75], 2)[0] > match_confidence([0.5], 2)[0]  # seen 3 of 3 times, not once


def test_lookups_report_their_confidence():
    """The suffix docstring's example: after (a, b), c followed twice of 3 (share 2/4), then a
    twice of 2 (2/3), after a match of 2; ngram copies what followed the last occurrence, counted
    as once seen."""
    drafter = SuffixDrafter(CPU, depth=6, k=2, min_prob=0.5)
    a, b, c, d = 1, 2, 3, 4
    row = request([a, b, c, a, b, c, a, b, d, a, b], 0)
    assert drafter.find(row, 2) == ([c, a], pytest.approx(match_confidence([2 / 4, 2 / 3], 2)))
    assert drafter.find(request([a, b, c, d], 1), 2) == ([], [])
    ngram = NgramDrafter(CPU, 1, 3, 4)
    assert ngram.find(request([A, B, C, A, B], 2), 3) == ([C, A, B], match_confidence([0.5] * 3, 2))
    proposal = ngram.propose([request([A, B, C, A, B], 3), request([A, B, C, D, E], 4)], 3, None, None)
    assert proposal.confidence[0].tolist() == pytest.approx(match_confidence([0.5] * 3, 2))
    assert all(math.isnan(x) for x in proposal.confidence[1].tolist())  # no match: nothing known
