"""The draft model's windowed context (`EngineConfig.draft_window`, drafters/model.py): a row
holds its request's first SINKS tokens and its last W to 2W, and is cut again when a feed would
take it past that. Worked examples against the draft model run by transformers on the cut text,
and exactness of whole runs whose rows are cut over and over (sampling: test_sampling.py)."""

from __future__ import annotations

import pytest
import torch
from test_equivalence import run, workload
from tiny import ARCH_PARAMS, make_model, pair

from batchspec import EngineConfig, ModelPair, SamplingParams, SpecEngine
from batchspec.core.request import Request
from batchspec.core.runner import ModelRunner
from batchspec.drafters.base import RoundOutcome
from batchspec.drafters.model import SINKS, DraftModelDrafter
from batchspec.sampling import BatchSampling

CPU = torch.device("cpu")
GREEDY = BatchSampling.of([SamplingParams()], CPU)
W = 4
WINDOW = 8  # whole runs: rows of 12 to 20 tokens


@pytest.fixture(scope="module")
def draft():
    return make_model("llama", 32, 1, seed=1).eval()


@torch.no_grad()
def greedy(model, text: list[int], n: int) -> list[int]:
    """The draft model's own n greedy tokens after `text`, run by transformers from position 0."""
    out = list(text)
    for _ in range(n):
        out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(text):]


def drafter(model) -> DraftModelDrafter:
    return DraftModelDrafter(ModelRunner(model, "draft", 256, rows=2, capacity=64, debug=True), window=W)


def test_a_long_prompt_enters_the_row_cut_to_its_sinks_and_window(draft):
    """A 30-token prompt prefilled up to its newest token (t0..t28): the row holds t0..t3 and
    t25..t28 (8 tokens); drafting then feeds t29 and drafts what the draft model drafts after
    t0..t3 t25..t29 from position 0."""
    tokens = list(range(10, 40))
    req = Request(0, list(tokens), SamplingParams(max_new_tokens=8), frozenset())
    req.slot = 0
    d = drafter(draft)
    d.prefill([req], [29])
    assert req.kv_len["draft"] == SINKS + W and d.unseen(req) == d.feeds(req) == 1
    out = d.propose([req], [3], None, GREEDY)
    assert out.tokens[0].tolist() == greedy(draft, tokens[:SINKS] + tokens[25:30], 3)


def test_a_row_is_cut_again_when_a_feed_would_outgrow_it(draft):
    """The row holds 8 tokens (SINKS + W); 6 more arrive unseen (a lookup drafted them, say):
    8 + 6 > SINKS + 2W = 12, so the feed cuts the row again to t0..t3 and the last W tokens, and
    what it then drafts is the draft model's after that text. Committed, the row counts what it
    holds, and nothing is unseen but what came after."""
    tokens = list(range(10, 40))
    req = Request(0, list(tokens), SamplingParams(max_new_tokens=16), frozenset())
    req.slot = 1
    d = drafter(draft)
    d.prefill([req], [29])
    req.token_ids.extend([50, 51, 52, 53, 54])  # t30..t34: 6 unseen with t29
    assert d.unseen(req) == 6 and d.feeds(req) == SINKS + W
    out = d.propose([req], [2], None, GREEDY)
    text = req.token_ids[:SINKS] + req.token_ids[-W:]
    assert out.tokens[0].tolist() == greedy(draft, text, 2)
    d.observe([req], RoundOutcome([2], [2]))  # both drafts accepted: d1 was fed, d2 was not
    assert req.kv_len["draft"] == SINKS + W + 1
    req.token_ids.extend(out.tokens[0].tolist() + [7])  # d1 d2 and the bonus token
    assert d.unseen(req) == 2


def test_an_emptied_row_starts_again_from_the_first_token(draft):
    """A row whose KV the engine dropped (a LongRoPE switch, a request preempted) skips nothing:
    a request that now fits the window is fed whole again."""
    tokens = list(range(10, 40))
    req = Request(0, list(tokens), SamplingParams(max_new_tokens=8), frozenset())
    req.slot = 0
    d = drafter(draft)
    d.prefill([req], [29])
    req.kv_len["draft"] = 0
    del req.token_ids[10:]  # (now shorter than SINKS + 2W)
    assert d.unseen(req) == d.feeds(req) == 10
    out = d.propose([req], [2], None, GREEDY)
    assert out.tokens[0].tolist() == greedy(draft, req.token_ids, 2)


def test_without_a_window_the_row_holds_the_whole_request(draft):
    tokens = list(range(10, 40))
    req = Request(0, list(tokens), SamplingParams(max_new_tokens=8), frozenset())
    req.slot = 0
    d = DraftModelDrafter(ModelRunner(draft, "draft", 256, rows=2, capacity=64), window=None)
    d.prefill([req], [29])
    assert req.kv_len["draft"] == 29 and d.feeds(req) == 1
    assert d.propose([req], [2], None, GREEDY).tokens[0].tolist() == greedy(draft, tokens, 2)


def counting_cuts(monkeypatch) -> list[int]:
    """Counts the feeds that cut a row (one count per row cut)."""
    cuts = [0]
    recut = DraftModelDrafter._recut

    def counted(self, req, unseen):
        out = recut(self, req, unseen)
        cuts[0] += out
        return out

    monkeypatch.setattr(DraftModelDrafter, "_recut", counted)
    return cuts


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCH_PARAMS)
def test_windowed_draft_model_is_exact(arch, monkeypatch):
    """Prompts of 1-60 tokens, 20 new tokens and a window of 8 (rows of 12 to 20 tokens): longer
    prompts are cut on entry and rows again as they grow. The drafts change no output; they are
    accepted less often than the whole context's (these random models hang on every position),
    but at every length."""
    cuts = counting_cuts(monkeypatch)
    base, ids, refs = workload(arch)
    p = ModelPair(base.target, pair(arch, "perturbed").draft, None, base.vocab_size, base.eos_token_ids)
    for method, bs, adaptive in (("eqspec", 1, False), ("eqspec", 3, True), ("eqspec", 32, True),
                                 ("exspec", 8, False)):
        engine = SpecEngine(p, EngineConfig(drafter="draft_model", method=method, batch_size=bs, gamma=3,
                                            adaptive=adaptive, draft_window=WINDOW, debug=True))
        n = max(8, 4 * bs)
        assert [o.token_ids for o in run(engine, ids[:n])] == refs[:n], f"{arch} {method} bs={bs}"
    assert cuts[0] > 0
    assert all(engine.stats.accept_hist[a] for a in range(4)), engine.stats.accept_hist  # (fixed γ = 3)


@pytest.mark.slow
def test_windowed_hybrid_is_exact(monkeypatch):
    """The hybrid's draft model catches up on what its lookup drafted: cut like any feed."""
    cuts = counting_cuts(monkeypatch)
    base, ids, refs = workload("llama")
    p = ModelPair(base.target, pair("llama", "perturbed").draft, None, base.vocab_size, base.eos_token_ids)
    for bs in (1, 8):
        engine = SpecEngine(p, EngineConfig(drafter="hybrid", batch_size=bs, gamma=3, draft_window=2, debug=True,
                                            adaptive=False))
        assert [o.token_ids for o in run(engine, ids)] == refs
    assert cuts[0] > 0

