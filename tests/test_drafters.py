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
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_sampling import chi_square, models
from tiny import VOCAB, make_model, perturbed, prompts, references

import batchspec.decode.round as round_module
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
from batchspec.drafters.ngram import NgramDrafter, NgramIndex
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
    out = drafter.propose(reqs, [gamma] * len(reqs), None, GREEDY)
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
    out = drafter.propose(rows, [1, 0, 3], None, GREEDY)  # per-row lengths from the round's plan
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
    assert parse_drafter("hybrid") == ("hybrid", (*parse_drafter(hybrid.LOOKUP), None))  # the default lookup
    assert parse_drafter("hybrid:ngram:1,3") == parse_drafter("hybrid:1,3") == ("hybrid", ("ngram", (1, 3, 16), None))
    assert parse_drafter("hybrid:suffix:8,4") == ("hybrid", ("suffix", (8, 4, 0.25, 1 << 16), None))
    # a head under the lookup: after '+', or alone (on the default lookup)
    assert parse_drafter("hybrid:ngram:1,3+eagle:/h") == ("hybrid", ("ngram", (1, 3, 16), "eagle:/h"))
    assert parse_drafter("hybrid:eagle") == ("hybrid", (*parse_drafter(hybrid.LOOKUP), "eagle"))
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
        self.label, self.synthetic, self.features = inner.label, inner.synthetic, inner.features

    def step_probe(self, rows, context):
        return self.inner.step_probe(rows, context)

    def offer(self, reqs, caps):
        return self.inner.offer(reqs, caps)

    def prefill(self, reqs, ends, hidden=None, counts=None):
        self.inner.prefill(reqs, ends, hidden, counts)

    def propose(self, reqs, lengths, uniforms, sampling):
        self.last = self.inner.propose(reqs, lengths, uniforms, sampling)
        return self.last

    def observe(self, reqs, outcome):
        rows = self.last.tokens.tolist()
        lengths = self.last.lengths or [len(rows[0])] * len(rows)
        self.rounds.append([(row[:n], a) for row, n, a in zip(rows, lengths, outcome.accepted)])
        self.inner.observe(reqs, outcome)

    def release(self, req):
        self.inner.release(req)

    def forget(self):
        self.inner.forget()


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


def test_the_hybrid_looks_up_before_the_policy_plans():
    """With a policy, the hybrid's lookups run before the plan (`offer`): a row the lookup drafts is
    planned no longer than what it found and costs no draft-model step (not a model row), a row it
    found nothing for is the model's, and `propose` reuses the lookups instead of searching again.
    Each request counts the rounds its lookup drafted in its lookup record."""
    pair, ids, refs = loopy()
    engine = SpecEngine(pair, EngineConfig(method="eqspec", batch_size=3, gamma=4, drafter="hybrid:ngram",
                                           adaptive=True, debug=True))
    hybrid, policy = engine.drafter, engine.policy
    rounds, finds = [], [0]
    offer, plan, find = hybrid.offer, policy.plan, hybrid.lookup.find
    policy.worth_offering = lambda *a: True  # (every round looks up: whether it pays is the clock's call)

    def offering(reqs, caps):
        rounds.append({"offer": offer(reqs, caps), "caps": list(caps), "finds": finds[0]})
        return rounds[-1]["offer"]

    def planning(stats, caps, offered, held, left=None):
        decision = plan(stats, caps, offered, held, left)
        rounds[-1]["decision"] = decision
        return decision

    def finding(req, limit):
        finds[0] += 1
        return find(req, limit)

    hybrid.offer, policy.plan, hybrid.lookup.find = offering, planning, finding
    outs = engine.generate(ids, SamplingParams(max_new_tokens=MAX_NEW))
    assert [o.token_ids for o in outs] == refs
    offered = [o for r in rounds for o in r["offer"]]
    assert any(offered) and None in offered  # rows the lookup drafts, and the model's
    for r in rounds:
        for o, cap, n, model in zip(r["offer"], r["caps"], r["decision"].lengths, r["decision"].model_rows):
            assert n <= cap
            if o is not None:
                assert 0 < o <= cap and n <= o and not model
            else:
                assert model == (n > 0)
    for before, after in zip(rounds, rounds[1:] + [{"finds": finds[0]}]):  # one search per row and round
        assert after["finds"] - before["finds"] <= len(before["offer"])
    assert sum(o.stats.looked_up for o in outs) > 0
    for o in outs:
        assert o.stats.looked_up == (o.stats.records[True].reached[0] if True in o.stats.records else 0)


def test_the_hybrids_lookups_serve_only_the_round_they_were_made_for():
    """`offer` says what the lookup found (row 0: C A B after A B; row 1: no match, so the model's)
    and keeps it for the next `propose` of the same rows at the same lengths only: a plan that then
    drafts nothing leaves lookups that must not pass for the next round's."""
    lookup = NgramDrafter(CPU, 1, 3, 4)
    hybrid, finds, find = HybridDrafter(None, lookup), [], lookup.find
    lookup.find = lambda req, limit: finds.append(req.index) or find(req, limit)
    rows = [request([A, B, C, A, B], 0), request([A, B, C, D, E], 1)]
    assert hybrid.offer(rows, [3, 3]) == [3, None] and finds == [0, 1]
    assert lookup.lookups(rows, [2, 3]) == [[C, A], []] and finds == [0, 1]  # (reused, cut to the plan)
    hybrid.offer(rows, [3, 3])
    rows[0].token_ids.append(C)  # a plain round committed a token
    assert lookup.lookups(rows, [3, 3]) == [[A, B, C], []] and finds == [0, 1, 0, 1, 0, 1]  # looked up again


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
    # (every row is seeded, so held at its cap: the rows the lookup misses are the model's in every round)
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


def test_a_seeded_sampled_request_does_not_depend_on_the_policy():
    """The policy reads the clock, so it must not decide for sampled rows: a seeded request samples
    exactly what it samples at a fixed γ, and what it samples in a batch with greedy rows the
    policy plans (it is held at its cap, whatever the lookup offers the rows beside it)."""
    pair, ids, _ = loopy()
    params = [SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, seed=request_seed(3, i)) for i in range(len(ids))]
    outs = []
    for adaptive in (True, False):
        engine = SpecEngine(pair, EngineConfig(method="eqspec", batch_size=2, gamma=3, drafter="hybrid",
                                               adaptive=adaptive))
        outs.append([o.token_ids for o in engine.generate(ids, params)])
    mixed = [SamplingParams(max_new_tokens=MAX_NEW) if i % 2 else p for i, p in enumerate(params)]
    engine = SpecEngine(pair, EngineConfig(method="eqspec", batch_size=4, gamma=3, drafter="hybrid"))
    outs.append([o.token_ids if i % 2 == 0 else outs[0][i] for i, o in enumerate(engine.generate(ids, mixed))])
    assert outs[0] == outs[1] == outs[2]


def test_lookups_find_the_docstring_examples():
    """The suffix docstring's example: after (a, b), c followed twice of 3, then a twice of 2, so
    [c, a] at min_prob 0.5; ngram copies what followed the last occurrence."""
    drafter = SuffixDrafter(CPU, depth=6, k=2, min_prob=0.5)
    a, b, c, d = 1, 2, 3, 4
    row = request([a, b, c, a, b, c, a, b, d, a, b], 0)
    assert drafter.find(row, 2) == [c, a]
    assert drafter.find(request([a, b, c, d], 1), 2) == []
    ngram = NgramDrafter(CPU, 1, 3, 4)
    assert ngram.find(request([A, B, C, A, B], 2), 3) == [C, A, B]
    assert ngram.find(request([A, B, C, D, E], 4), 3) == []  # no match: nothing known
