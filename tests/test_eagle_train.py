"""Training an EAGLE head: recorded data is the target's own, a few steps lower the loss, a resumed
run continues the same schedule (and lands on the same weights), and the command runs end to end."""

from __future__ import annotations

import json
import random

import pytest
import torch
from tiny import VOCAB, make_model

from batchspec.eagle.data import read, record, vocab_by_frequency
from batchspec.eagle.head import new_head
from batchspec.eagle.train import Batch, TrainConfig, Trainer, evaluate, losses, lr_at

torch.set_num_threads(1)


def data(target, layers, n: int = 6, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 12))] for _ in range(n)]
    return prompts, record(target, prompts, layers, max_new=14, batch=4)


def test_recorded_features_are_the_targets():
    target = make_model("llama", 64, 4, seed=0)
    head = new_head(target, "eagle3")
    prompts, seqs = data(target, head.spec.layers, n=3)
    for p, s in zip(prompts, seqs):
        assert s.start == len(p) and s.tokens.shape[0] == s.features.shape[0] + 1
        with torch.no_grad():
            out = target(input_ids=s.tokens[None, :-1], output_hidden_states=True)
        want = torch.cat([out.hidden_states[i][0] for i in head.spec.layers], dim=-1)
        torch.testing.assert_close(s.features.float(), want, rtol=2e-2, atol=2e-2)  # (kept in bfloat16)
        assert torch.equal(s.argmax[s.start - 1:], out.logits[0, s.start - 1:].argmax(-1))
        assert bool((s.argmax[:s.start - 1] == -1).all())  # (prompt positions but the last: not recorded)
        assert torch.equal(s.tokens[s.start:], s.argmax[s.start - 1:])  # greedy: the answer is its argmax
    texts = read(target, [p + [1, 2, 3] for p in prompts], head.spec.layers)
    assert all(t.start == 0 and t.final is not None for t in texts)


def small_trainer(seqs, head, total: int = 8) -> Trainer:
    return Trainer(head, seqs, TrainConfig(lr=1e-2, warmup=2, batch=4, window=16, ttt=2, total=total, seed=1))


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_few_steps_lower_the_loss(kind):
    target = make_model("llama", 64, 4, seed=0)
    layers = new_head(target, kind).spec.layers
    _, seqs = data(target, layers)
    head = new_head(target, kind, draft_vocab=128, vocab_ids=vocab_by_frequency(seqs, VOCAB))
    trainer = small_trainer(seqs, head, total=25)
    fixed = Batch(seqs, trainer.windows[:4], "cpu")
    with torch.no_grad():
        before = float(losses(head, fixed, trainer.config, train=False)[0])
    trainer.run(None)
    with torch.no_grad():
        after = float(losses(head, fixed, trainer.config, train=False)[0])
    assert after < 0.9 * before
    report = evaluate(head, seqs[:2], gamma=3)
    assert 0 <= report["top1"] <= 1 and sum(report["accept_hist"]) == report["rounds"]


def test_the_report_walks_rounds_as_decoding_does(monkeypatch):
    """`evaluate`'s docstring example: rounds start after the last round's accepted drafts and the
    target's token, not at every entry (which would average 1.0 accepted here, not 2.0)."""
    import batchspec.eagle.train as train

    target = make_model("llama", 64, 4, seed=0)
    head = new_head(target, "eagle", seed=1)
    m = 7  # 6 entries
    seq = train.Sequence(torch.zeros(m + 1, dtype=torch.long), torch.zeros(m, 64), None,
                         torch.zeros(m, dtype=torch.long), 2)
    ok = [torch.tensor([[1, 0, 1, 1, 0, 1]], dtype=torch.bool), torch.tensor([[0, 1, 1, 0, 1, 0]], dtype=torch.bool)]
    monkeypatch.setattr(train, "losses", lambda *a, **k: (torch.tensor(0.0), ok))
    report = train.evaluate(head, [seq], gamma=2)
    assert (report["rounds"], report["accepted"], report["accept_hist"]) == (2, 2.0, [0, 0, 2])
    assert report["accepted_every_start"] == 1.0 and report["top1"] == 4 / 6


def test_resume_continues_the_same_schedule(tmp_path):
    target = make_model("llama", 64, 4, seed=0)
    _, seqs = data(target, (4,))

    def fresh():
        return new_head(target, "eagle", seed=2)

    straight = small_trainer(seqs, fresh())
    lrs = [straight.step()["lr"] for _ in range(8)]
    assert lrs == [lr_at(s, 8, straight.config) for s in range(8)]
    first = small_trainer(seqs, fresh())
    for _ in range(4):
        first.step()
    first.save(tmp_path / "checkpoint.pt")
    resumed = Trainer(fresh(), seqs, TrainConfig())  # (config and schedule come from the checkpoint)
    resumed.load(tmp_path / "checkpoint.pt")
    assert resumed.state.step == 4 and resumed.state.total == 8
    assert [resumed.step()["lr"] for _ in range(4)] == lrs[4:]
    for a, b in zip(straight.head.parameters(), resumed.head.parameters()):
        assert torch.equal(a, b)


def test_a_time_budget_fixes_the_schedule_at_the_warm_ups_later_pace():
    target = make_model("llama", 64, 4, seed=0)
    _, seqs = data(target, (4,), n=2)
    trainer = Trainer(new_head(target, "eagle", seed=2), seqs, TrainConfig(warmup=9, batch=2, window=16))
    now = [0.0]
    real = trainer.step

    def step():  # (an injected clock: the first 3 steps take 10 s, later ones 1 s)
        info = real()
        now[0] += 10.0 if trainer.state.step <= 3 else 1.0
        return info

    trainer.step = step
    state = trainer.run(40.0, clock=lambda: now[0])
    # 36 s spent by step 9, at 1 s a step since step 3: 4 more steps fit (not 40 / (36 / 9) = 10 in all)
    assert state.total == 13 and state.step == 13 and state.seconds == 40.0


def test_the_head_never_trains_the_target():
    target = make_model("llama", 64, 4, seed=0)
    before = [p.clone() for p in target.parameters()]
    head = new_head(target, "eagle")
    assert not any(p is target.get_input_embeddings().weight for p in head.parameters())
    _, seqs = data(target, head.spec.layers, n=2)
    small_trainer(seqs, head, total=2).run(None)
    assert all(torch.equal(a, b) for a, b in zip(before, target.parameters()))


def test_held_out_sets_are_held_out_whole_and_never_trained_on():
    from batchspec.eagle.recipe import Recipe, _sources
    from batchspec.eagle.sources import package_docs
    from batchspec.prompts import load_prompts

    class Plain:  # a tokenizer without a chat template: prompts are read as they are
        chat_template = None

        def __call__(self, text):
            return {"input_ids": [len(text) % VOCAB, 1]}

    sets, texts, own, earlier = _sources(Recipe(data="grounded,self:5", eval="chat"), Plain())
    chat, grounded = len(load_prompts("chat")), len(load_prompts("grounded"))
    assert [(len(ids), held) for ids, held in sets] == [(chat, chat), (grounded, 8)] and own == 5
    with pytest.raises(ValueError, match="both training data"):
        _sources(Recipe(data="chat", eval="chat"), Plain())
    with pytest.raises(ValueError, match="not a prompt set"):
        _sources(Recipe(data="chat", eval="mine.jsonl"), Plain())
    with pytest.raises(ValueError, match="ask:N needs a chat model"):
        _sources(Recipe(data="ask:3"), Plain())
    sets, texts, own, _ = _sources(Recipe(data="docs"), Plain())
    assert not sets and not own and len(texts) == len(package_docs()) > 10


def test_ask_n_draws_every_form_and_topic_pair_once_before_repeating():
    from batchspec.eagle.recipe import Recipe, _sources
    from batchspec.eagle.sources import FORMS, TOPICS, instructions

    pairs = len(FORMS) * len(TOPICS)
    made = instructions(pairs + 3, seed=2)
    assert len(set(made[:pairs])) == pairs and made[pairs:] == made[:3] and made == instructions(pairs + 3, seed=2)
    assert instructions(5, seed=3) != made[:5]

    class Chat:
        chat_template = "{{ messages }}"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return [7, len(messages[0]["content"]) % VOCAB]

    sets, _, own, _ = _sources(Recipe(data="ask:40", holdout=4), Chat())
    assert [(len(ids), held) for ids, held in sets] == [(40, 4)] and own == 0


def test_the_default_data_is_what_made_the_shipped_head():
    """`--data auto`: a chat target answers 2,000 `ask` instructions and reads `docs`; any other
    target completes the bundled prompts and reads `docs`."""
    from batchspec.eagle.recipe import Recipe, _sources
    from batchspec.eagle.sources import package_docs
    from batchspec.prompts import load_prompts

    class Tok:
        def __init__(self, template):
            self.chat_template = template

        def __call__(self, text):
            return {"input_ids": [len(text) % VOCAB, 1]}

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return [7, len(messages[0]["content"]) % VOCAB]

    assert Recipe().data == "auto"
    docs = len(package_docs())
    sets, texts, own, _ = _sources(Recipe(), Tok("{{ messages }}"))
    assert [(len(ids), held) for ids, held in sets] == [(2000, 8)] and len(texts) == docs and own == 0
    sets, texts, _, _ = _sources(Recipe(), Tok(None))
    assert [len(ids) for ids, _ in sets] == [len(load_prompts("bundled"))] and len(texts) == docs


def test_a_float32_head_trains_under_autocast_over_a_bfloat16_target():
    from batchspec.eagle.train import mixed

    target = make_model("llama", 64, 2, seed=0)
    assert not mixed(new_head(target, "eagle", seed=1))._enabled
    half = make_model("llama", 64, 2, seed=0, dtype=torch.bfloat16)
    head = new_head(half, "eagle", seed=1, dtype=torch.float32)
    assert head.q_proj.weight.dtype == torch.float32 and mixed(head)._enabled
    _, seqs = data(half, head.spec.layers, n=3)
    loss, _ = losses(head, Batch(seqs, [(0, 0, seqs[0].entries)], "cpu"), TrainConfig())
    loss.backward()
    assert head.q_proj.weight.grad.dtype == torch.float32 and torch.isfinite(loss)


@pytest.mark.slow
def test_train_draft_command(tiny_dirs, tmp_path):
    from typer.testing import CliRunner

    from batchspec.cli import app
    from batchspec.eagle.formats import load_head
    from batchspec.models import load_pair

    out = tmp_path / "head"
    args = ["train-draft", "--target", tiny_dirs["target"], "--out", str(out), "--data", "bundled", "--minutes",
            "0.25", "--max-new-tokens", "8", "--samples", "2", "--draft-vocab", "64"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["draft_vocab"] == 64 and report["steps"] > 0 and "tokens_per_pass" in report["held_out"]
    head = load_head(out, load_pair(tiny_dirs["target"], need_draft=False).target)
    assert head.draft_vocab == 64
    steps = report["steps"]
    result = CliRunner().invoke(app, args + ["--resume"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "report.json").read_text())["steps"] >= steps
    bad = CliRunner().invoke(app, ["train-draft", "--target", tiny_dirs["target"], "--out", str(out), "--data",
                                   "nope.jsonl"])
    assert bad.exit_code == 2 and "neither a prompt set" in bad.output
