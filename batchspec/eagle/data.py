"""Training data for an EAGLE head: the target's own features, recorded while it writes.

A `Sequence` is one text the target has read: tokens x_0..x_m, and at each fed position p < m the
target's features f_p (the layers the head reads), its final normed state (whose LM head gives
its next-token distribution) and that distribution's argmax. Two sources:

* generated: the target answers prompts (greedy and sampled), recording its features as it goes
  (the prompt's in the prefill pass, each answer token's in its decoding step): no second pass;
* teacher-forced text: one prefill pass over a text (JSONL rows {"text": ...}), far cheaper per
  token, but the text is not what the target would write.

The head's entries are e = p - 1 for p = 1..m - 1: (token x_p, feature f_{p-1}); its target is the
target's distribution at p (final state at p, argmax at p).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.request import Request
from ..core.runner import ModelRunner, padded_ids
from ..prompts import jsonl_rows
from ..sampling import SamplingParams


@dataclass
class Sequence:
    tokens: torch.Tensor  # [m + 1] long: x_0..x_m
    features: torch.Tensor  # [m, F] bfloat16: the head's input features f_0..f_{m-1}
    final: torch.Tensor | None  # [m, H] bfloat16 final normed states (None: features are them, EAGLE-1)
    argmax: torch.Tensor  # [m] long: the target's greedy next token at each position (-1: not recorded,
    # a prompt position before the last: its logits would cost a pass of the LM head for nothing)
    start: int  # first position of the target's own text (the answer; 0 for teacher-forced text)

    @property
    def entries(self) -> int:
        """Head entries with a target: e = 0..m - 2."""
        return max(0, self.features.shape[0] - 1)


def read_texts(path: str | Path) -> tuple[list[str], list[str]]:
    """A JSONL file's rows: {"prompt": ...} (answered by the target) and {"text": ...} (read as is)."""
    prompts, texts = [], []
    for lineno, row in jsonl_rows(path):
        if isinstance(row, dict) and isinstance(row.get("text"), str):
            texts.append(row["text"])
        elif isinstance(row, dict) and isinstance(row.get("prompt"), str):
            prompts.append(row["prompt"])
        else:
            raise ValueError(f'{path}:{lineno}: expected {{"prompt": "..."}} or {{"text": "..."}}')
    return prompts, texts


def _split(features: torch.Tensor, layers: tuple[int, ...], final: int, width: int):
    """Runner states [.., (layers + maybe final) * H] -> (head features, final or None)."""
    if layers == (final,):
        return features, None
    return features[..., : len(layers) * width], features[..., len(layers) * width:]


def record(target, prompts: list[list[int]], layers: tuple[int, ...], max_new: int, temperature: float = 0.0,
           seed: int = 0, stop_ids: tuple[int, ...] = (), batch: int = 16, progress=None,
           deadline: float | None = None) -> list[Sequence]:
    """The target answers each prompt (token ids) in batches of `batch` rows, recording features.
    Temperature 0: greedy; else sampled with a generator seeded by `seed`. No batch starts after
    `deadline` (a time.perf_counter() value)."""
    text = target.config.get_text_config()
    final, width = text.num_hidden_layers, text.hidden_size
    asked = layers if final in layers else (*layers, final)
    vocab = target.get_output_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(seed)
    out = []
    for lo in range(0, len(prompts), batch):
        if deadline is not None and time.perf_counter() > deadline:
            break
        group = prompts[lo:lo + batch]
        longest = max(map(len, group)) + max_new
        runner = ModelRunner(target, "target", vocab, rows=len(group), capacity=longest + 1, forward="auto")
        reqs = [Request(i, list(p), SamplingParams(), frozenset(), slot=i) for i, p in enumerate(group)]
        counts = [len(p) for p in group]
        logits, states = runner.feed(reqs, padded_ids(group, target.device), counts, logits="last", hidden=asked)
        runner.commit(reqs, counts)
        feats = [[states[i, :c]] for i, c in enumerate(counts)]
        tops = [[None] for _ in group]  # argmax at each fed position: filled from the logits below
        # prompt positions: only the last one's greedy token (the answer's first) is recorded
        tops_prefill = [torch.cat([torch.full((c - 1,), -1, dtype=torch.long, device=logits.device),
                                   logits[i].argmax(-1, keepdim=True)]) for i, c in enumerate(counts)]
        live = list(range(len(group)))
        for _ in range(max_new):
            if temperature > 0:
                probs = torch.softmax(logits.float() / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=gen)[:, 0]
            else:
                nxt = logits.argmax(-1)
            for k, i in enumerate(live):
                reqs[i].token_ids.append(int(nxt[k]))
            live_next = [i for k, i in enumerate(live) if int(nxt[k]) not in stop_ids
                         and len(reqs[i].token_ids) < counts[i] + max_new]
            if not live_next:
                break
            rows = [reqs[i] for i in live_next]
            ids = torch.tensor([[r.token_ids[-1]] for r in rows], device=target.device)
            logits, states = runner.feed(rows, ids, [1] * len(rows), logits="last", hidden=asked)
            runner.commit(rows, [1] * len(rows))
            for k, i in enumerate(live_next):
                feats[i].append(states[k, :1])
                tops[i].append(logits[k].argmax(-1, keepdim=True))
            live = live_next
            if progress is not None:
                progress(len(rows))
        for i, r in enumerate(reqs):
            states_i = torch.cat(feats[i])  # [m, F(+H)]
            top = torch.cat([tops_prefill[i]] + [t for t in tops[i][1:]])
            f, fin = _split(states_i, layers, final, width)
            out.append(Sequence(torch.tensor(r.token_ids), f.to(torch.bfloat16).cpu(),
                                None if fin is None else fin.to(torch.bfloat16).cpu(), top.cpu(), counts[i]))
    return out


def read(target, texts: list[list[int]], layers: tuple[int, ...], window: int = 1024) -> list[Sequence]:
    """Teacher-forced texts (token ids), one prefill pass each (cut into windows of `window`)."""
    cut = [ids[i:i + window] for ids in texts for i in range(0, len(ids), window) if len(ids[i:i + window]) > 2]
    text = target.config.get_text_config()
    final, width = text.num_hidden_layers, text.hidden_size
    asked = layers if final in layers else (*layers, final)
    vocab = target.get_output_embeddings().weight.shape[0]
    out = []
    for ids in cut:
        runner = ModelRunner(target, "target", vocab, rows=1, capacity=len(ids), forward="auto")
        req = Request(0, list(ids), SamplingParams(), frozenset(), slot=0)
        # the last token is fed too: the sequence keeps m = len - 1 features and drops x_m's
        logits, states = runner.feed([req], torch.tensor([ids], device=target.device), [len(ids)], logits="all",
                                     hidden=asked)
        f, fin = _split(states[0, :-1], layers, final, width)
        out.append(Sequence(torch.tensor(ids), f.to(torch.bfloat16).cpu(),
                            None if fin is None else fin.to(torch.bfloat16).cpu(), logits[0, :-1].argmax(-1).cpu(), 0))
    return out


def vocab_by_frequency(seqs: list[Sequence], vocab: int) -> torch.Tensor:
    """[V] target ids, the most frequent first, counted over what the target predicts and writes."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for s in seqs:
        counts += torch.bincount(s.argmax[s.argmax >= 0], minlength=vocab)[:vocab]
        counts += torch.bincount(s.tokens[s.start:], minlength=vocab)[:vocab]
    return counts.argsort(descending=True, stable=True)


def coverage(seqs: list[Sequence], ids: torch.Tensor, vocab: int) -> float:
    """Share of the target's greedy tokens (over the answers) that `ids` holds."""
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[ids] = True
    hit = total = 0
    for s in seqs:
        top = s.argmax[max(0, s.start - 1):]
        hit += int(mask[top].sum())
        total += top.numel()
    return hit / max(1, total)
