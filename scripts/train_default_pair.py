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
    draft:  hidden 192, 2 layers, 3 heads / 1 KV head,  MLP 512   (~1.6M parameters)

Training
    stage ``target``: next-token cross-entropy on random 512-token windows, AdamW, warm-up then
    cosine decay, bfloat16 autocast on CPU.
    stage ``draft``: distillation from the target. The draft is trained on (a) corpus windows
    with the KL divergence to the target's token distribution and (b) the target's own greedy
    continuations of corpus prefixes, the text a speculative drafter actually has to predict,
    with cross-entropy on the target's tokens.
    stage ``export``: bfloat16 weights, tokenizer files and the held-out prompt file are written
    into ``batchspec/assets/``.

Reproduce (about 2 h 15 min on a 2-core AMD EPYC, 24 GB RAM)::

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
DRAFT = dict(hidden_size=192, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1,
             intermediate_size=512)

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
                rec["heldout_loss"] = round(eval_fn(), 4)
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
    """The target's greedy continuations of `n` random corpus prefixes: [n, prefix + new]."""
    from transformers import DynamicCache

    model.eval()
    out = []
    for _ in range(0, n, 32):
        starts = rng.integers(0, len(data) - prefix - 1, size=32)
        ids = torch.from_numpy(np.stack([data[s:s + prefix] for s in starts]).astype(np.int64))
        cache = DynamicCache()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids, past_key_values=cache, use_cache=True).logits[:, -1]
            for _ in range(new):
                nxt = logits.argmax(-1, keepdim=True)
                ids = torch.cat([ids, nxt], 1)
                logits = model(nxt, past_key_values=cache, use_cache=True).logits[:, -1]
        out.append(ids)
    return torch.cat(out)[:n]


def stage_draft(args) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(WORK / "tokenizer")
    teacher = AutoModelForCausalLM.from_pretrained(WORK / "target", dtype=torch.float32).eval()
    train_ids = np.load(WORK / "train_ids.npy")
    held_ids = np.load(WORK / "held_ids.npy")
    rng = np.random.default_rng(args.seed + 1)

    t0 = time.time()
    gen_path = WORK / "greedy_continuations.pt"
    if gen_path.exists():
        generated = torch.load(gen_path)
    else:
        generated = greedy_continuations(teacher, train_ids, args.gen_samples, 128, 256, rng)
        torch.save(generated, gen_path)
    log({"stage": "draft_data", "sequences": len(generated), "seconds": round(time.time() - t0)})

    torch.manual_seed(args.seed)
    model = make_model(DRAFT, tokenizer)
    stream = batches(train_ids, args.batch, rng)

    def loss_fn():
        batch = next(stream)
        pick = torch.from_numpy(rng.integers(0, len(generated), size=args.batch // 2))
        gen = generated[pick]
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            teacher_logp = F.log_softmax(teacher(batch[:, :-1]).logits.float(), -1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            student = F.log_softmax(model(batch[:, :-1]).logits.float(), -1)
            student_gen = model(gen[:, :-1]).logits.float()
        kd = F.kl_div(student, teacher_logp, log_target=True, reduction="batchmean") / SEQ
        # Only the continuation part of the generated text is the target's greedy output.
        ce = F.cross_entropy(student_gen[:, 127:].reshape(-1, VOCAB), gen[:, 128:].reshape(-1))
        return kd + ce

    seconds = train_loop(model, args.draft_steps, 2e-3, loss_fn, "draft",
                         eval_fn=lambda: evaluate(model, held_ids), ckpt=WORK / "draft_ckpt.pt")
    model.save_pretrained(WORK / "draft")
    log({"stage": "draft_done", "seconds": round(seconds + time.time() - t0 - seconds)})


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", choices=["target", "draft", "export", "all"], default="all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--target-steps", type=int, default=1000)
    parser.add_argument("--draft-steps", type=int, default=800)
    parser.add_argument("--gen-samples", type=int, default=2048)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    WORK.mkdir(parents=True, exist_ok=True)
    stages = ["target", "draft", "export"] if args.stage == "all" else [args.stage]
    for stage in stages:
        globals()[f"stage_{stage}"](args)


if __name__ == "__main__":
    main()
