"""EAGLE heads: the target's hidden states the runner returns, and the head's batched ragged step."""

from __future__ import annotations

import pytest
import torch
from tiny import VOCAB, make_model

from batchspec.core.request import Request
from batchspec.core.runner import ModelRunner
from batchspec.eagle.head import eagle3_layers, new_head
from batchspec.sampling import SamplingParams

torch.set_num_threads(1)


def requests(lengths: list[int], seed: int = 0) -> list[Request]:
    gen = torch.Generator().manual_seed(seed)
    reqs = []
    for i, n in enumerate(lengths):
        ids = torch.randint(0, VOCAB, (n,), generator=gen).tolist()
        reqs.append(Request(index=i, token_ids=ids, params=SamplingParams(), stop_ids=frozenset(), slot=i))
    return reqs


@pytest.mark.parametrize("forward", ["lean", "hf"])
@pytest.mark.parametrize("layers,lengths,extra", [
    ((2,), [5, 1, 9, 3], [2, 1, 3, 2]),  # ragged: the lean forward packs the real tokens
    ((0, 1, 2), [5, 1, 9, 3], [2, 1, 3, 2]),
    ((1, 2), [4, 4], [1, 1]),  # uniform rows: the padded layout
])
def test_feed_hidden_matches_output_hidden_states(forward, layers, lengths, extra):
    """feed(hidden=...) returns HF's output_hidden_states at every fed column, row by row, in two
    feeds (prompts, then a few more tokens each at its own offset)."""
    model = make_model("llama", 64, 2, seed=0)
    b, n1, n2 = len(lengths), max(lengths), max(extra)
    reqs = requests([n + e for n, e in zip(lengths, extra)])
    runner = ModelRunner(model, "target", VOCAB, rows=b, capacity=32, forward=forward)
    first = torch.tensor([r.token_ids[:n] + [0] * (n1 - n) for r, n in zip(reqs, lengths)])
    logits, states = runner.feed(reqs, first, lengths, logits="all", hidden=layers)
    runner.commit(reqs, lengths)
    second = torch.tensor([r.token_ids[n:] + [0] * (n2 - len(r.token_ids[n:])) for r, n in zip(reqs, lengths)])
    last, states2 = runner.feed(reqs, second, extra, logits="last", hidden=layers)
    assert states.shape == (b, n1, 64 * len(layers)) and states2.shape == (b, n2, 64 * len(layers))
    for i, r in enumerate(reqs):
        with torch.no_grad():
            out = model(input_ids=torch.tensor([r.token_ids]), output_hidden_states=True)
        want = torch.cat([out.hidden_states[j][0] for j in layers], dim=-1)  # [len, F]
        n, e = lengths[i], extra[i]
        torch.testing.assert_close(states[i, :n], want[:n], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(states2[i, :e], want[n:n + e], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(last[i], out.logits[0, -1], rtol=1e-4, atol=1e-4)


def test_feed_hidden_skips_idle_rows():
    """Rows at slots 0 and 2 (slot 1 idle in the range): the states come back in the batch's order."""
    model = make_model("llama", 64, 2, seed=0)
    reqs = requests([3, 3, 3])
    reqs[1].slot = 2
    rows = [reqs[0], reqs[1]]
    runner = ModelRunner(model, "target", VOCAB, rows=3, capacity=8)
    ids = torch.tensor([r.token_ids for r in rows])
    _, states = runner.feed(rows, ids, [3, 2], logits="none", hidden=(2,))
    for i, (r, c) in enumerate(zip(rows, [3, 2])):
        with torch.no_grad():
            want = model(input_ids=torch.tensor([r.token_ids[:c]]), output_hidden_states=True).hidden_states[2][0]
        torch.testing.assert_close(states[i, :c], want, rtol=1e-4, atol=1e-4)


def test_feed_without_hidden_returns_logits_alone():
    model = make_model("llama", 64, 2, seed=0)
    reqs = requests([4])
    runner = ModelRunner(model, "target", VOCAB, rows=1, capacity=16)
    out = runner.feed(reqs, torch.tensor([reqs[0].token_ids]), [4], logits="last")
    assert isinstance(out, torch.Tensor) and out.shape == (1, VOCAB)
    with pytest.raises(ValueError, match="within 0..2"):
        runner.feed(reqs, torch.tensor([[1]]), [1], logits="last", hidden=(3,))


@pytest.mark.parametrize("kind,draft_vocab", [("eagle", None), ("eagle", 100), ("eagle3", 100), ("eagle3", None)])
def test_head_batched_step_equals_each_row_alone(kind, draft_vocab):
    """A ragged batched step (rows at different offsets, different counts) gives each row the
    logits it gets alone, in two steps (a catch-up, then one drafted entry per row)."""
    target = make_model("llama", 64, 4, seed=0)
    head = new_head(target, kind, draft_vocab=draft_vocab, seed=1)
    if draft_vocab:
        head.set_vocab(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:draft_vocab].sort().values)
    width = 64 * len(head.spec.layers)
    gen = torch.Generator().manual_seed(2)
    counts, starts = [5, 1, 3], [0, 4, 2]
    tokens = torch.randint(0, VOCAB, (3, 5), generator=gen)
    feats = torch.randn(3, 5, width, generator=gen)
    prefix_tokens = torch.randint(0, VOCAB, (3, 4), generator=gen)
    prefix_feats = torch.randn(3, 4, width, generator=gen)
    with torch.no_grad():
        kv = head.new_kv(rows=3, capacity=4)  # (grows on demand)
        for i in range(3):  # each row's committed prefix, alone
            if starts[i]:
                head.step(kv, [i], prefix_tokens[i:i + 1, :starts[i]], prefix_feats[i:i + 1, :starts[i]], [0])
        logits, out = head.step(kv, [0, 1, 2], tokens, feats, starts, counts)
        # `last`: the same step (rewriting the same columns) with each row's last entry's logits only
        at_last, out_again = head.step(kv, [0, 1, 2], tokens, feats, starts, counts, last=True)
        assert at_last.shape == (3, 1, logits.shape[-1]) and torch.equal(out_again, out)
        torch.testing.assert_close(at_last[:, 0], logits[torch.arange(3), torch.tensor(counts) - 1])
        nxt = torch.randint(0, VOCAB, (3, 1), generator=gen)
        starts2 = [s + c for s, c in zip(starts, counts)]
        last = out[torch.arange(3), torch.tensor(counts) - 1][:, None]
        logits2, _ = head.step(kv, [0, 1, 2], nxt, last, starts2)
        for i in range(3):
            alone = head.new_kv()
            if starts[i]:
                head.step(alone, [0], prefix_tokens[i:i + 1, :starts[i]], prefix_feats[i:i + 1, :starts[i]], [0])
            a_logits, a_out = head.step(alone, [0], tokens[i:i + 1, :counts[i]], feats[i:i + 1, :counts[i]],
                                        [starts[i]])
            torch.testing.assert_close(logits[i, :counts[i]], a_logits[0], rtol=1e-5, atol=1e-5)
            a2, _ = head.step(alone, [0], nxt[i:i + 1], a_out[:, -1:], [starts2[i]])
            torch.testing.assert_close(logits2[i], a2[0], rtol=1e-5, atol=1e-5)
            # and the training forward (no KV) on the same entries: one sequence from column 0
            seq_t = torch.cat([prefix_tokens[i, :starts[i]], tokens[i, :counts[i]]])[None]
            seq_f = torch.cat([prefix_feats[i, :starts[i]], feats[i, :counts[i]]])[None]
            (t_logits, _), = head(seq_t, seq_f)
            torch.testing.assert_close(t_logits[0, starts[i]:], a_logits[0], rtol=1e-5, atol=1e-5)
    assert logits.shape[-1] == (draft_vocab or VOCAB)


def test_training_time_test_matches_chained_steps():
    """forward(steps=2)'s step-1 output at entry e is what drafting one entry past base e - 1
    gives: the committed entries 0..e-1, then (token e, the head's own output of entry e - 1)."""
    target = make_model("llama", 64, 4, seed=0)
    head = new_head(target, "eagle3", seed=3)
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, VOCAB, (1, 6), generator=gen)
    feats = torch.randn(1, 6, 3 * 64, generator=gen)
    with torch.no_grad():
        (_, out0), (logits1, _) = head(tokens, feats, steps=2)
        for e in range(1, 6):
            kv = head.new_kv()
            _, o = head.step(kv, [0], tokens[:, :e], feats[:, :e], [0])
            chained, _ = head.step(kv, [0], tokens[:, e:e + 1], o[:, -1:], [e])
            torch.testing.assert_close(chained[0, 0], logits1[0, e], rtol=1e-5, atol=1e-5)


def test_eagle3_layers_and_bad_input():
    assert eagle3_layers(30) == (2, 15, 27)
    target = make_model("llama", 64, 4, seed=0)
    head = new_head(target, "eagle", seed=0)
    with pytest.raises(ValueError, match="counts"):
        head.step(head.new_kv(), [0], torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, 64), [0], [3])
    with pytest.raises(ValueError, match="draft_vocab|drafts over"):
        head.set_vocab(torch.arange(10))
