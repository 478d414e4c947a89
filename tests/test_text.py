"""Text out of the engine: incremental detokenization, stop strings, and BOS handling."""

from __future__ import annotations

import pytest
from conftest import train_tokenizer

from batchspec import EngineConfig, SamplingParams, SpecEngine, load_pair
from batchspec.core.detok import TextStream


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer()


def test_multibyte_characters_stream_whole(tok):
    text = "héllo 世界 🎉 ok"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # characters really are split across tokens
    stream, pieces = TextStream(tok), []
    for i in ids:
        stream.push(i)
        pieces.append(stream.take())
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)


def test_stop_string_is_held_back_then_cut(tok):
    ids = tok("a = 1\n\nb = 2", add_special_tokens=False)["input_ids"]
    stream, shown, stopped_at = TextStream(tok, stop=["\n\n"]), "", None
    for k, i in enumerate(ids):
        if stream.push(i):
            stopped_at = k
            break
        shown += stream.take()
        assert not shown.endswith("\n")  # a lone newline might start the stop string: held back
    assert stopped_at is not None and stream.text == "a = 1"
    assert shown + stream.take(final=True) == "a = 1"
    assert "\n\n" in tok.decode(ids[: stopped_at + 1]) and "\n\n" not in tok.decode(ids[:stopped_at])


def test_held_text_is_released_when_it_cannot_start_a_stop(tok):
    stream = TextStream(tok, stop=["STOP"])
    out = ""
    for i in tok("x ST y", add_special_tokens=False)["input_ids"]:
        assert not stream.push(i)
        out += stream.take()
    assert out + stream.take(final=True) == "x ST y"


@pytest.fixture(scope="module")
def engine(tiny_dirs):
    pair = load_pair(tiny_dirs["target"], tiny_dirs["draft"])
    return SpecEngine(pair, EngineConfig(drafter="draft_model", method="eqspec", batch_size=4, gamma=3))


def ascii_pair(text: str, start: int) -> str | None:
    """Two printable ASCII characters that occur in `text` after `start` (the random tiny models also
    emit broken UTF-8, whose replacement characters make poor stop strings)."""
    for k in range(start, len(text) - 1):
        if all(c.isascii() and c.isalnum() for c in text[k:k + 2]):
            return text[k:k + 2]
    return None


def test_stop_strings_cut_text_and_tokens(engine):
    prompts = ["def add(a, b):", "class Stack:", "    def push(self, item):", "    def pop(self):",
               "        self.items = []", "    return a + b"]
    free = engine.generate(prompts, SamplingParams(max_new_tokens=40, ignore_eos=True))
    tok = engine.pair.tokenizer
    checked = 0
    for prompt, out in zip(prompts, free):
        text = out.text
        stop = ascii_pair(text, 3)  # a string that really occurs in the unconstrained output
        if stop is None:
            continue
        cut = engine.generate([prompt], SamplingParams(max_new_tokens=40, ignore_eos=True, stop=("zzzq", stop)))[0]
        assert cut.finish_reason == "stop"
        assert cut.text == text[: text.index(stop)]
        n = len(cut.token_ids)
        assert cut.token_ids == out.token_ids[:n]  # the same tokens up to the one completing the stop string
        assert stop in tok.decode(cut.token_ids) and stop not in tok.decode(cut.token_ids[:-1])
        checked += 1
    assert checked >= 2


def test_streamed_text_adds_up_to_the_final_text(engine):
    prompts = ["def add(a, b):", "class Stack:"]
    sp = SamplingParams(max_new_tokens=30, ignore_eos=True, stop=("self",))
    pieces = {}
    finals = {}
    for out in engine.stream(prompts, sp):
        pieces[out.index] = pieces.get(out.index, "") + out.new_text
        if out.finished:
            finals[out.index] = out.output
    for i in range(2):
        assert pieces[i] == finals[i].text
        assert "self" not in finals[i].text


def test_stop_strings_need_a_tokenizer():
    from tiny import pair

    engine = SpecEngine(pair("llama"), EngineConfig(drafter="draft_model", method="autoregressive"))
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request([1, 2, 3], SamplingParams(stop=("x",)))
    with pytest.raises(ValueError, match="non-empty"):
        SamplingParams(stop=("",))


def test_chat_templated_text_gets_no_second_bos(engine):
    tok = engine.pair.tokenizer
    plain = engine.encode("def f():")
    assert plain[0] == tok.bos_token_id and plain.count(tok.bos_token_id) == 1
    templated = engine.encode(tok.bos_token + "def f():")
    assert templated == plain
    assert engine.encode("def f():", add_special_tokens=False) == plain[1:]
