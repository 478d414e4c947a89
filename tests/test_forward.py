"""The lean forward computes what the transformers modules compute, on the layouts the engine uses."""

from __future__ import annotations

import pytest
import torch
from tiny import VOCAB, make_model, prompts, run_rows
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from batchspec import EngineConfig, ModelPair, SamplingParams, SpecEngine
from batchspec.core.forward import HFForward, LeanForward, lean_unsupported, make_forward
from batchspec.core.linear import matmul
from batchspec.core.runner import row_inputs


def model_for(arch: str, dtype=torch.float32):
    if arch in ("llama", "qwen3", "gpt2"):
        return make_model(arch, 64, 2, seed=0, dtype=dtype)
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2)
    if arch == "qwen2":  # biases on q, k, v
        return Qwen2ForCausalLM(Qwen2Config(**common)).to(dtype).eval()
    if arch == "mistral":
        return MistralForCausalLM(MistralConfig(**common, sliding_window=None)).to(dtype).eval()
    raise ValueError(arch)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "mistral"])
# ([40, 3], 2): a 40-token row is past FOLD_TOKENS (the unfolded attention) and on kernels' ladder;
# ([40], 2): one whole prompt, attended as causal without a mask; ([7], 40): a later chunk of one, not
@pytest.mark.parametrize("lengths,extra", [([5, 1, 9, 3], 4), ([6, 6], 1), ([7], 3), ([40, 3], 2), ([40], 2),
                                           ([7], 40)])
def test_lean_matches_transformers_modules(arch, lengths, extra):
    model = model_for(arch)
    assert lean_unsupported(model) is None
    hf_first, hf_second, lengths = run_rows(HFForward(model), model, lengths, extra)
    lean_first, lean_second, _ = run_rows(LeanForward(model), model, lengths, extra)
    for i, n in enumerate(lengths):  # padding columns' logits are meaningless; content must agree
        torch.testing.assert_close(lean_first[i, :n], hf_first[i, :n], rtol=1e-5, atol=1e-5)
        assert torch.equal(lean_first[i, :n].argmax(-1), hf_first[i, :n].argmax(-1))
    torch.testing.assert_close(lean_second, hf_second, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(lean_second).all()  # no NaN leaks from padding columns through the cache


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("kernel", ["linear", "mm", "dnn"])
def test_lean_matches_transformers_under_each_kernel(arch, kernel, monkeypatch):
    """Whichever kernel the plan takes at every count (oneDNN's on packed copies of the weights,
    q/k/v biases included), the lean forward computes what the modules compute."""
    from batchspec.core import forward, kernels

    if kernel == "dnn" and kernels.ONEDNN is None:
        pytest.skip("this torch has no oneDNN linear")
    counts = frozenset(range(1, kernels.COUNTS[-1] + 1))
    plan = kernels.Plan(tuple(range(kernels.COUNTS[-1] + 1)), counts if kernel == "mm" else frozenset(),
                        counts if kernel == "dnn" else frozenset())
    monkeypatch.setattr(forward, "kernel_plan", lambda weights, **kw: plan)
    model = model_for(arch)
    with torch.no_grad():
        for name, bias in model.named_parameters():
            if name.endswith("bias"):  # (transformers starts them at zero)
                bias.normal_(0, 0.2)
    lean = LeanForward(model)
    assert (lean.layers[0][2].packed is not None) == (kernel == "dnn")
    for lengths, extra in (([5, 1, 9, 3], 4), ([40, 3], 2)):
        hf_first, hf_second, lengths = run_rows(HFForward(model), model, lengths, extra)
        lean_first, lean_second, _ = run_rows(lean, model, lengths, extra)
        for i, n in enumerate(lengths):
            torch.testing.assert_close(lean_first[i, :n], hf_first[i, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lean_second, hf_second, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_rows_match_each_row_run_alone(arch):
    """Each row of a ragged batch gets the logits it gets when it runs alone, unpadded."""
    model = model_for(arch)
    forward = make_forward(model)
    lengths, extra = [5, 1, 9, 3], 2
    gen = torch.Generator().manual_seed(1)
    ids, more = torch.randint(0, VOCAB, (4, 9), generator=gen), torch.randint(0, VOCAB, (4, extra), generator=gen)
    first, second, _ = run_rows(forward, model, lengths, extra, ids=ids, more=more)
    for i, n in enumerate(lengths):
        alone_first, alone_second, _ = run_rows(forward, model, [n], extra, ids=ids[i:i + 1, :n], more=more[i:i + 1])
        torch.testing.assert_close(first[i, :n], alone_first[0, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(second[i], alone_second[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
def test_greedy_tokens_equal_through_either_forward(arch):
    model = model_for(arch)
    pair = ModelPair(model, None, None, VOCAB, ())
    ids = prompts(12, seed=3)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    outs = {}
    for forward in ("hf", "lean"):
        engine = SpecEngine(pair, EngineConfig(drafter="draft_model",
                                               method="autoregressive", batch_size=5, forward=forward))
        outs[forward] = [o.token_ids for o in engine.generate(ids, params)]
    assert outs["lean"] == outs["hf"]


def test_row_inputs_docstring_example():
    positions, visible = row_inputs([3, 5], 2, 6, "cpu")
    assert positions.tolist() == [[3, 4], [5, 6]]
    assert visible[:, 0].int().tolist() == [[[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]],
                                            [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]]


def test_forward_choice():
    gpt2, llama = model_for("gpt2"), model_for("llama")
    assert "gpt2" in lean_unsupported(gpt2)
    assert isinstance(make_forward(gpt2, "auto"), HFForward)
    assert isinstance(make_forward(llama, "auto"), LeanForward)
    assert isinstance(make_forward(llama, "hf"), HFForward)
    with pytest.raises(ValueError, match="lean forward does not support"):
        make_forward(gpt2, "lean")
    with pytest.raises(ValueError, match="unknown forward"):
        EngineConfig(drafter="draft_model", forward="fast")
    torch.manual_seed(0)
    windowed = MistralForCausalLM(MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                                sliding_window=16))
    assert "sliding window" in lean_unsupported(windowed)


def test_fused_weights_are_shared_with_the_modules(tmp_path):
    """The lean forward fuses q/k/v and gate/up without copying: the modules' weights are views
    into the fused matrices, built once per model however many engines run it, and the model
    still saves and reloads as before."""
    model = model_for("llama")
    attn = model.model.layers[0].self_attn
    q_before = attn.q_proj.weight.detach().clone()
    lean = make_forward(model, "auto")
    assert make_forward(model, "lean") is lean
    fused = lean.layers[0][1]
    assert attn.q_proj.weight.data_ptr() == fused.weight.data_ptr()
    assert attn.k_proj.weight.data_ptr() == fused.weight[fused.sizes[0]:].data_ptr()
    assert torch.equal(attn.q_proj.weight, q_before)
    model.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reloaded.state_dict().values()))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fresh_rows_attend_causally_unmasked(arch, monkeypatch):
    """Prompts fed from column 0 in the padded layout (little padding, so not packed) attend with
    SDPA's causal flag instead of the mask, and each row still gets its logits alone; a pass
    whose rows start later keeps the mask."""
    from batchspec.core import forward as fw

    model = model_for(arch)
    lengths, extra = [40, 37, 39], 3  # more than FOLD_TOKENS columns, 1 - 116 / 120 padding: not packed
    gen = torch.Generator().manual_seed(2)
    ids, more = torch.randint(0, VOCAB, (3, 40), generator=gen), torch.randint(0, VOCAB, (3, extra), generator=gen)
    calls, sdpa = [], fw.F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, **kw):
        calls.append((q.shape[0], is_causal, attn_mask is None))
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    monkeypatch.setattr(fw.F, "scaled_dot_product_attention", spy)
    first, second, _ = run_rows(LeanForward(model), model, lengths, extra, ids=ids, more=more)
    layers = len(LeanForward(model).layers)
    calls = [c for c in calls if c[0] == 3]  # (the lean forward's own checks run a row alone)
    assert calls == [(3, True, True)] * layers + [(3, False, False)] * layers  # prompts causal, then masked
    monkeypatch.setattr(fw.F, "scaled_dot_product_attention", sdpa)
    for i, n in enumerate(lengths):
        alone_first, alone_second, _ = run_rows(LeanForward(model), model, [n], extra, ids=ids[i:i + 1, :n],
                                                more=more[i:i + 1])
        torch.testing.assert_close(first[i, :n], alone_first[0, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(second[i], alone_second[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
def test_packed_forward_equals_padded(arch, monkeypatch):
    """Computing only the real tokens of a ragged input (core/rows.py PACK_SHARE) changes nothing."""
    from batchspec.core import rows

    model = model_for(arch)
    lengths, extra = [5, 1, 9, 3], 3
    monkeypatch.setattr(rows, "PACK_SHARE", 0.0)  # never pack
    padded = run_rows(LeanForward(model), model, lengths, extra)
    monkeypatch.setattr(rows, "PACK_SHARE", 1.0)  # always pack
    packed = run_rows(LeanForward(model), model, lengths, extra)
    for i, n in enumerate(lengths):
        torch.testing.assert_close(packed[0][i, :n], padded[0][i, :n], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[1], padded[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
def test_prefill_attention_by_row_equals_padded(arch, monkeypatch):
    """Prefill chunks (more than ROW_ATTENTION_TOKENS columns) attend row by row: the same as the
    padded layout, for rows fed from column 0 (causal over themselves) and rows continuing their
    prompt (a later chunk, which reads its mask row), next to idle rows."""
    from batchspec.core import forward as fw
    from batchspec.core.rows import RowBatch, RowKV
    from batchspec.core.runner import kv_shape

    model = model_for(arch)
    chunks = (([0, 0, 0], [40, 7, 0]), ([40, 7, 0], [36, 1, 50]))  # (starts, counts) of two passes

    def run(threshold: int) -> list[torch.Tensor]:
        monkeypatch.setattr(fw, "ROW_ATTENTION_TOKENS", threshold)
        gen = torch.Generator().manual_seed(0)
        kv = RowKV(*kv_shape(model), 3, 128, model.dtype, model.device)
        kv.make_clean([0, 1, 2], 128)
        outs = []
        for starts, counts in chunks:
            batch = RowBatch(kv, [0, 1, 2], starts, counts)
            assert batch.packed is not None  # (the path that attends by row)
            positions, visible = row_inputs(starts, max(counts), batch.width, model.device)
            ids = torch.randint(0, VOCAB, (3, max(counts)), generator=gen)
            outs.append(LeanForward(model)(ids, positions, batch, visible))
        return outs

    by_row, padded = run(32), run(10**9)
    for (_, counts), a, b in zip(chunks, by_row, padded):
        for i, n in enumerate(counts):
            torch.testing.assert_close(a[i, :n], b[i, :n], rtol=1e-5, atol=1e-5)


def test_prefill_attends_by_row_on_a_cpu_only():
    """On a GPU one padded attention call beats a call per row (docs/gpu.md: at 64 rows on an H100
    the calls by row took 0.44 s of a 1.16 s run); decoding widths never attend by row."""
    from batchspec.core.forward import ROW_ATTENTION_TOKENS, attends_by_row

    kv = RowSpans([0, 0], [ROW_ATTENTION_TOKENS + 1, 20])
    wide = ROW_ATTENTION_TOKENS + 1
    assert attends_by_row(wide, kv, torch.device("cpu"))
    assert not attends_by_row(wide, kv, torch.device("cuda"))
    assert not attends_by_row(ROW_ATTENTION_TOKENS, RowSpans([0, 0], [32, 32]), torch.device("cpu"))
    assert not attends_by_row(wide, object(), torch.device("cpu"))  # a KV without rows to read


class RowSpans:
    """A stand-in for `RowBatch` where only its rows' spans matter."""

    def __init__(self, starts: list[int], counts: list[int]) -> None:
        self.row_spans = (list(range(len(starts))), starts, counts)

    def read_row(self, layer: int, i: int):
        raise AssertionError("not read")


def test_verify_attends_by_row_where_the_padded_layout_wastes_more_than_a_call():
    """`attends_by_row`'s docstring examples: 8 rows verifying 9 tokens, widths 445 on average and
    910 at the widest, by row; 235 and 354, padded; one token a row at 445 and 910, padded; on a
    GPU never."""
    from batchspec.core.forward import attends_by_row

    cpu = torch.device("cpu")
    skewed = [910, 160, 300, 420, 250, 700, 380, 440]  # mean 445
    assert sum(skewed) == 8 * 445
    assert attends_by_row(9, RowSpans([w - 9 for w in skewed], [9] * 8), cpu)
    assert not attends_by_row(9, RowSpans([w - 9 for w in skewed], [9] * 8), torch.device("cuda"))
    even = [354, 200, 210, 220, 230, 190, 240, 236]  # mean 235
    assert sum(even) == 8 * 235
    assert not attends_by_row(9, RowSpans([w - 9 for w in even], [9] * 8), cpu)
    assert not attends_by_row(1, RowSpans([w - 1 for w in skewed], [1] * 8), cpu)
    # rows fed fewer tokens than the widest row's count waste its padding queries too
    assert attends_by_row(9, RowSpans([500, 500, 500, 500], [9, 1, 1, 1]), cpu)
    assert not attends_by_row(9, RowSpans([500, 500, 500, 500], [9, 9, 9, 9]), cpu)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("feeds", [[5, 1, 0, 3], [4, 4, 4, 4]])
def test_verify_attention_by_row_equals_padded(arch, feeds, monkeypatch):
    """A verify pass (rows after their KV: fed 1-5 tokens, one row idle, packed; or 4 each, in the
    padded layout) attends row by row, grouped query heads folded, as the padded layout does."""
    from batchspec.core import forward as fw
    from batchspec.core.rows import RowBatch, RowKV
    from batchspec.core.runner import kv_shape

    model = model_for(arch)
    prompts = [60, 7, 33, 90]

    def run(waste: int) -> torch.Tensor:
        monkeypatch.setattr(fw, "ROW_WASTE_PAIRS", waste)
        gen = torch.Generator().manual_seed(3)
        kv = RowKV(*kv_shape(model), 4, 128, model.dtype, model.device)
        kv.make_clean([0, 1, 2, 3], 128)
        for starts, counts in (([0] * 4, prompts), (prompts, feeds)):
            batch = RowBatch(kv, [0, 1, 2, 3], starts, counts)
            positions, visible = row_inputs(starts, max(counts), batch.width, model.device)
            ids = torch.randint(0, VOCAB, (4, max(counts)), generator=gen)
            out = LeanForward(model)(ids, positions, batch, visible)
        assert (batch.packed is not None) == (0 in feeds)
        assert fw.attends_by_row(max(feeds), batch, model.device) == (waste == 0)
        return out

    by_row, padded = run(0), run(10**9)
    for i, n in enumerate(feeds):
        torch.testing.assert_close(by_row[i, :n], padded[i, :n], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
@pytest.mark.parametrize("feeds", [[40, 1, 0, 1, 1], [5, 1, 1, 0, 3]])
def test_rows_fed_one_token_attend_together(arch, feeds, monkeypatch):
    """In a pass attending row by row, the rows fed one token after their KV (decoding rows beside a
    prompt that joins them, rows that verify no draft) are attended in one padded call where it
    pays (`GROUP_WASTE_PAIRS`): the same as one call per row and as the padded layout, an idle row
    among them."""
    from batchspec.core import forward as fw
    from batchspec.core.rows import RowBatch, RowKV
    from batchspec.core.runner import kv_shape

    model = model_for(arch)
    prompts = [0 if feeds[0] == 40 else 60, 7, 33, 90, 21]  # row 0 either joins now or verifies

    def run(group: bool, waste: int) -> torch.Tensor:
        monkeypatch.setattr(fw, "GROUP_WASTE_PAIRS", 10**9 if group else 0)
        monkeypatch.setattr(fw, "ROW_WASTE_PAIRS", waste)
        monkeypatch.setattr(fw, "ROW_ATTENTION_TOKENS", 32 if waste == 0 else 10**9)
        gen = torch.Generator().manual_seed(5)
        kv = RowKV(*kv_shape(model), 5, 160, model.dtype, model.device)
        kv.make_clean(list(range(5)), 160)
        forward = LeanForward(model)
        first = [p if p else 1 for p in prompts]  # (a row joining now holds one stale token, never read)
        for starts, counts in (([0] * 5, first), (prompts, feeds)):
            batch = RowBatch(kv, list(range(5)), starts, counts)
            positions, visible = row_inputs(starts, max(counts), batch.width, model.device)
            ids = torch.randint(0, VOCAB, (5, max(counts)), generator=gen)
            out = forward(ids, positions, batch, visible)
        assert fw.attends_by_row(max(feeds), batch, model.device) == (waste == 0)
        grouped = forward._row_masks(batch, visible)[1]
        assert (grouped is not None) == group
        if grouped is not None:
            assert grouped[-1] == {i for i, n in enumerate(feeds) if n == 1}
        return out

    together, each, padded = run(True, 0), run(False, 0), run(True, 10**9)
    for i, n in enumerate(feeds):
        torch.testing.assert_close(together[i, :n], each[i, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(together[i, :n], padded[i, :n], rtol=1e-5, atol=1e-5)


def test_rows_fed_one_token_group_only_where_the_call_wastes_less_than_it_saves():
    """`GROUP_WASTE_PAIRS`' examples: a prompt joining 16 decoding rows, grouped; 32 rows of which
    28 verify 2 tokens, the 4 others by row (their call would read all 32 rows' keys)."""
    forward = LeanForward(model_for("llama"))

    def grouped(starts: list[int], counts: list[int]) -> bool:
        kv = RowSpans(starts, counts)
        kv.contiguous = True
        width = max(s + c for s, c in zip(starts, counts))
        visible = torch.ones(len(starts), 1, max(counts), width, dtype=torch.bool)
        return forward._row_masks(kv, visible)[1] is not None

    decoding = [300 + 25 * i for i in range(16)]
    assert grouped([0] + decoding, [30] + [1] * 16)
    verifying = [300 + 12 * i for i in range(32)]
    assert not grouped(verifying, [2] * 28 + [1] * 4)
    assert not grouped([0, 400], [30, 1])  # one such row: nothing to save


def test_folded_attention_takes_the_output_layout_cuda_returns(monkeypatch):
    """CUDA's memory-efficient SDPA kernel (float32) returns [B, H, n, D] laid out as [B, n, H, D]:
    unfolding the grouped query heads from that needs a copy (a `view` raised on an H200)."""
    from batchspec.core import forward as fw

    model = model_for("qwen2")  # 4 query heads over 2 KV heads: the folded path
    expected = run_rows(LeanForward(model), model, [5, 1, 9, 3], 4)
    sdpa = fw.F.scaled_dot_product_attention

    def cuda_layout(*args, **kwargs):
        return sdpa(*args, **kwargs).transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(fw.F, "scaled_dot_product_attention", cuda_layout)
    got = run_rows(LeanForward(model), model, [5, 1, 9, 3], 4)
    for a, b in zip(got[:2], expected[:2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_cuda_attention_leaves_out_cudnn(monkeypatch):
    """On CUDA the forward passes run without cuDNN's SDPA kernel (a plan built per new shape:
    speculation at 0.39x plain decoding at batch 32 on an H200); on a CPU nothing is restricted.
    Both forwards attend inside that choice (here with every device taken for CUDA)."""
    from batchspec.core import forward as fw
    from batchspec.core.forward import attention_kernels

    seen, inside = [], [False]
    sdpa = fw.F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        if inside[0]:  # (run_rows also runs the model once to learn its KV shape)
            seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    def watched(forward):
        def call(*args, **kwargs):
            inside[0] = True
            try:
                return forward(*args, **kwargs)
            finally:
                inside[0] = False
        return call

    with monkeypatch.context() as m:
        m.setattr(fw.F, "scaled_dot_product_attention", recording)
        m.setattr(fw, "attention_kernels", lambda device: attention_kernels(torch.device("cuda")))
        for forward in (LeanForward, HFForward):
            seen.clear()
            model = model_for("llama")
            run_rows(watched(forward(model)), model, [5, 1, 9, 3], 2)
            assert seen and not any(seen), forward.__name__

    assert torch.backends.cuda.cudnn_sdp_enabled()
    with attention_kernels(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with attention_kernels(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled()


@pytest.mark.parametrize("shape", [(1, 24), (2, 24), (3, 1, 24), (2, 16, 24), (33, 24), (0, 24)])
@pytest.mark.parametrize("bias", [False, True])
def test_matmul_equals_linear(shape, bias):
    """`matmul` (W @ x^T for a few tokens, one token fed as two) computes F.linear's numbers and shape,
    on either side of its token threshold and for an empty input, also where its output is left
    a transposed view (`contiguous=False`, the o_proj/down/gate-up outputs of the lean forward)."""
    torch.manual_seed(0)
    x, weight = torch.randn(*shape), torch.randn(40, 24)
    b = torch.randn(40) if bias else None
    out = matmul(x, weight, b)
    expected = torch.nn.functional.linear(x, weight, b)
    assert out.shape == expected.shape and out.is_contiguous()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(matmul(x.double(), weight.double()), torch.nn.functional.linear(x.double(),
                                                                                              weight.double()))
    view = matmul(x, weight, b, contiguous=False)  # (W @ x^T's transpose as it is, where that runs)
    assert view.shape == expected.shape
    torch.testing.assert_close(view, expected, rtol=1e-5, atol=1e-5)
