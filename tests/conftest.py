"""Shared fixtures: a tiny tokenizer and a tiny target/draft pair saved to disk like a hub model."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

# Measurements (step-cost profiles, kernel plans: batchspec/cache.py) go to a folder of this
# session's own, never the user's cache, and are shared by the processes the tests start: with the
# cache off, every Ray actor and subprocess timed the kernels again (~20 s an actor on the EPYC).
os.environ["BATCHSPEC_CACHE"] = tempfile.mkdtemp(prefix="batchspec-test-cache-")
atexit.register(shutil.rmtree, os.environ["BATCHSPEC_CACHE"], ignore_errors=True)

TEXT = """def add(a, b):
    return a + b

class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()
""" * 4


def train_tokenizer(vocab: int = 300, extra_text: str = ""):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<|bos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT + extra_text], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|endoftext|>")


def save_llama(path, tokenizer, hidden: int, layers: int, seed: int, vocab: int | None = None, max_pos: int = 128):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab or len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_pos, initializer_range=0.2,
                      eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """{"target", "draft", "padded_draft", "other_tokenizer"}: paths of tiny saved models.

    The tokenizer has no pad token (as many real ones); padded_draft has an embedding matrix
    larger than the vocabulary; other_tokenizer is a model with a different vocabulary."""
    root = tmp_path_factory.mktemp("tiny")
    tok = train_tokenizer()
    dirs = {
        "target": save_llama(root / "target", tok, 64, 2, seed=0),
        "draft": save_llama(root / "draft", tok, 32, 1, seed=1),
        "padded_draft": save_llama(root / "padded_draft", tok, 32, 1, seed=1, vocab=len(tok) + 64),
        "other_tokenizer": save_llama(root / "other", train_tokenizer(310, "while True:\n    pass\n"), 32, 1,
                                      seed=3),
    }
    return dirs
