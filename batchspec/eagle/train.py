"""Self-distillation of an EAGLE head: predict the target's next-token distribution (and, EAGLE-1,
its next feature) from its features, on data the target wrote or read (`eagle/data.py`).

Loss per entry e (token x_{e+1}, hidden input h_e; target state at position e + 1):
    CE(softmax(target logits over the draft vocabulary), head logits)
    + reg_weight * SmoothL1(head output, target feature at e + 1)          (EAGLE-1 only)
summed over `ttt` training-time-test steps (EAGLE-3: step s drafts from the head's own outputs of
step s - 1, `EagleHead.forward`), step s weighted decay**s.

The schedule is fixed when training starts (`total` steps: given, or measured from a time budget
after a few steps) and saved with every checkpoint, so `--resume` continues the same schedule:
linear warm-up, then cosine decay to 10 %. Batches are drawn from a generator seeded by
(seed, step), so a resumed run sees the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from .data import Sequence
from .head import EagleHead


@dataclass
class TrainConfig:
    lr: float = 1e-3
    warmup: int = 30  # steps
    batch: int = 8  # windows per step
    window: int = 256  # entries per window
    ttt: int = 1  # training-time-test steps (1: plain teacher forcing)
    decay: float = 0.8  # weight of ttt step s: decay**s
    reg_weight: float = 1.0  # EAGLE-1's feature regression (the CE has weight 1)
    noise: float = 0.0  # EAGLE-1's feature noise (uniform, +-noise x the feature's RMS)
    # EAGLE-1: keep a reduced LM head at the target's rows, as the full-vocabulary head is the
    # target's own (the paper's setting; 9.4 M of SmolLM2's 13.6 M head weights at N = 16384)
    freeze_lm_head: bool = False
    total: int | None = None  # steps; None: measured from the time budget
    seed: int = 0
    weight_decay: float = 0.0


@dataclass
class TrainState:
    step: int = 0
    total: int | None = None
    seconds: float = 0.0  # training time spent so far (all runs)
    history: list[dict] = field(default_factory=list)  # [{step, loss, top1}] every few steps


def lr_at(step: int, total: int, config: TrainConfig) -> float:
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    frac = min(1.0, (step - config.warmup) / max(1, total - config.warmup))
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def windows(seqs: list[Sequence], size: int) -> list[tuple[int, int, int]]:
    """(sequence, first entry, entries) of every window: each sequence's entries cut into pieces of
    at most `size` (a window's entries attend only within it)."""
    return [(i, lo, min(size, s.entries - lo)) for i, s in enumerate(seqs) for lo in range(0, s.entries, size)]


class Batch:
    """b windows right-padded to n entries: tokens [b, n], features [b, n, F], targets: final
    states [b, n, H] (or features), argmax [b, n], mask [b, n] (real entries)."""

    def __init__(self, seqs: list[Sequence], picks: list[tuple[int, int, int]], device) -> None:
        n = max(k for _, _, k in picks)
        b = len(picks)
        s0 = seqs[picks[0][0]]
        width = s0.features.shape[1]
        final_width = (s0.final if s0.final is not None else s0.features).shape[1]
        self.tokens = torch.zeros(b, n, dtype=torch.long)
        self.features = torch.zeros(b, n, width)
        self.final = torch.zeros(b, n, final_width)
        self.argmax = torch.zeros(b, n, dtype=torch.long)
        self.mask = torch.zeros(b, n, dtype=torch.bool)
        for row, (i, lo, k) in enumerate(picks):
            s = seqs[i]
            fin = s.final if s.final is not None else s.features
            self.tokens[row, :k] = s.tokens[lo + 1:lo + 1 + k]  # entry e: token x_{e+1}
            self.features[row, :k] = s.features[lo:lo + k].float()  # ... feature f_e
            self.final[row, :k] = fin[lo + 1:lo + 1 + k].float()  # target: state at e + 1
            self.argmax[row, :k] = s.argmax[lo + 1:lo + 1 + k]
            self.mask[row, :k] = True
        for name in ("tokens", "features", "final", "argmax", "mask"):
            setattr(self, name, getattr(self, name).to(device))


def target_logits(head: EagleHead, final: torch.Tensor) -> torch.Tensor:
    """The target's logits over the draft vocabulary [..., V_draft] from its final states [..., H]."""
    weight = head.target_head if head.d2t is None else head.target_head[head.target_ids]
    return F.linear(final.to(weight.dtype), weight)


def draft_to_target(head: EagleHead, ids: torch.Tensor) -> torch.Tensor:
    return ids if head.d2t is None else ids + head.d2t[ids]


def mixed(head: EagleHead) -> torch.autocast:
    """Autocast to the target's half precision when the head keeps float32 weights over a bfloat16
    or float16 target (`recipe.py` records in bfloat16 where the CPU has AMX / AVX512-BF16)."""
    half = head.embed is not None and head.embed.dtype in (torch.bfloat16, torch.float16)
    enabled = half and head.q_proj.weight.dtype == torch.float32
    device = head.q_proj.weight.device.type
    return torch.autocast(device, dtype=head.embed.dtype if enabled else torch.bfloat16, enabled=enabled)


def losses(head: EagleHead, batch: Batch, config: TrainConfig, train: bool = True) -> tuple[torch.Tensor, list]:
    """(the loss, per ttt step: correct [b, n] bool, the head's greedy token == the target's)."""
    with mixed(head), warnings.catch_warnings():
        # (autocast feeds RMSNorm bfloat16 inputs with float32 weights: correct, unfused, and warned of)
        warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
        return _losses(head, batch, config, train)


def _losses(head: EagleHead, batch: Batch, config: TrainConfig, train: bool) -> tuple[torch.Tensor, list]:
    feats = batch.features
    if train and config.noise > 0 and head.spec.kind == "eagle":
        rms = feats.pow(2).mean(-1, keepdim=True).sqrt()
        feats = feats + (torch.rand_like(feats) * 2 - 1) * config.noise * rms
    steps = head(batch.tokens, feats, steps=config.ttt)
    with torch.no_grad():
        p = torch.softmax(target_logits(head, batch.final).float(), dim=-1)  # [b, n, V_draft]
    total, correct = 0.0, []
    for s, (logits, out) in enumerate(steps):
        mask = batch.mask.clone()
        mask[:, :s] = False  # no chain behind the first s entries
        count = mask.sum().clamp(min=1)
        ce = -(p * torch.log_softmax(logits.float(), dim=-1)).sum(-1)
        loss = (ce * mask).sum() / count
        if head.spec.kind == "eagle" and config.reg_weight:
            reg = F.smooth_l1_loss(out.float(), batch.final, reduction="none").mean(-1)
            loss = loss + config.reg_weight * (reg * mask).sum() / count
        total = total + config.decay ** s * loss
        correct.append((draft_to_target(head, logits.argmax(-1)) == batch.argmax) & mask)  # (-1: never)
    return total, correct


class Trainer:
    def __init__(self, head: EagleHead, train: list[Sequence], config: TrainConfig) -> None:
        if not train:
            raise ValueError("no training data")
        self.head, self.seqs, self.config = head, train, config
        self.windows = windows(train, config.window)
        if not self.windows:
            raise ValueError("the training sequences hold no entries (each needs at least 3 tokens)")
        if config.freeze_lm_head and head.lm_head is not None and head.spec.kind == "eagle":
            head.lm_head.weight.requires_grad_(False)
        params = [p for p in head.parameters() if p.requires_grad]
        self.optim = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
        self.state = TrainState(total=config.total)

    def batch_at(self, step: int) -> Batch:
        gen = torch.Generator().manual_seed(self.config.seed * 1_000_003 + step)
        picks = torch.randint(0, len(self.windows), (self.config.batch,), generator=gen).tolist()
        return Batch(self.seqs, [self.windows[i] for i in picks], self.head.q_proj.weight.device)

    def step(self) -> dict:
        state, config = self.state, self.config
        total = state.total or max(config.warmup + 1, 1000)
        lr = lr_at(state.step, total, config)
        for group in self.optim.param_groups:
            group["lr"] = lr
        self.head.train()
        batch = self.batch_at(state.step)
        loss, correct = losses(self.head, batch, config)
        self.optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), 1.0)
        self.optim.step()
        state.step += 1
        top1 = float(correct[0].sum()) / max(1, int((batch.mask & (batch.argmax >= 0)).sum()))
        return {"step": state.step, "loss": float(loss.detach()), "top1": top1, "lr": lr}

    def run(self, seconds: float | None, checkpoint=None, every_s: float = 180.0, on_step=None,
            clock=time.perf_counter) -> TrainState:
        """Train until `state.total` steps, or the time budget is spent; `checkpoint(self)` every
        `every_s` seconds and at the end. Without a given total, the schedule is fixed from
        `seconds` when the warm-up ends (the learning rate does not depend on it before), at the
        pace of the warm-up's last two thirds: the first steps run slower (allocation, caches)."""
        state, config = self.state, self.config
        started = clock()
        last_save = started
        spent0 = state.seconds
        mark, fix_at = max(1, config.warmup // 3), max(2, config.warmup)
        spent_at_mark = 0.0
        while state.total is None or state.step < state.total:
            t0 = clock()
            info = self.step()
            state.seconds += clock() - t0
            if state.step == mark:
                spent_at_mark = state.seconds
            if state.total is None and state.step == fix_at and seconds is not None:
                per = (state.seconds - spent_at_mark) / (fix_at - mark)
                state.total = max(state.step + 1, state.step + int((seconds - state.seconds) / per))
            if state.step % 10 == 0 or state.step == 1:
                state.history.append(info)
            if on_step is not None:
                on_step(info, state)
            now = clock()
            if checkpoint is not None and now - last_save > every_s:
                checkpoint(self)
                last_save = now
            if seconds is not None and state.seconds - spent0 >= seconds and state.total is not None \
                    and state.step < state.total:
                break  # out of time before the schedule's end: a later --resume finishes it
        if checkpoint is not None:
            checkpoint(self)
        return state

    # ----------------------------------------------------------------------------- checkpoints
    def save(self, path: Path) -> None:
        torch.save({"head": self.head.state_dict(), "optim": self.optim.state_dict(),
                    "state": asdict(self.state), "config": asdict(self.config)}, path)

    def load(self, path: Path) -> None:
        blob = torch.load(path, map_location="cpu", weights_only=False)
        self.head.load_state_dict(blob["head"])
        self.optim.load_state_dict(blob["optim"])
        self.state = TrainState(**blob["state"])
        self.config = TrainConfig(**blob["config"])
        self.windows = windows(self.seqs, self.config.window)  # (the batches follow the saved config)


def _chain(ok: torch.Tensor, b: int) -> int:
    """Drafts accepted in a round from entry b: depths 0, 1, ... while ok[depth, b + depth]."""
    gamma, k = ok.shape
    a = 0
    while a < gamma and b + a < k and bool(ok[a, b + a]):
        a += 1
    return a


@torch.no_grad()
def evaluate(head: EagleHead, seqs: list[Sequence], gamma: int = 4, window: int = 512) -> dict:
    """Held-out agreement on the target's own greedy text (`Sequence.start` on): teacher-forced
    top-1 (the head's greedy token from the target's true features = the target's), and drafts
    accepted per verify pass at γ = `gamma` by greedy chain drafting as decoding walks the text:
    a round starts at the answer's first entry, the head drafts from its own outputs
    (`EagleHead.forward`'s ttt steps), draft s is accepted while drafts 0..s are all the target's
    greedy tokens, and the next round starts after the a accepted drafts and the target's token.
    Tokens per pass = accepted + 1. Rounds start where the last one's drafts went wrong, so they
    accept less than the mean over every start (`accepted_every_start`): on SmolLM2's chat answers
    0.48 against 0.59, and the engine measures 0.45.

    Worked example, γ = 2, ok[s, e] (depth s correct from entry e), entries 0..5:
        ok[0] = 1 0 1 1 0 1,  ok[1] = 0 1 1 0 1 0
        round at 0: ok[0, 0] yes, ok[1, 1] yes -> 2 accepted; next at 3
        round at 3: ok[0, 3] yes, ok[1, 4] yes -> 2; next at 6 (done): 2 rounds, 2.0 accepted each"""
    head.eval()
    config = TrainConfig(ttt=gamma, window=window)
    hits = total = 0
    accepted = rounds = every = starts = 0
    hist = [0] * (gamma + 1)
    for s in seqs:
        for _, lo, k in windows([s], window):
            batch = Batch([s], [(0, lo, k)], head.q_proj.weight.device)
            _, correct = losses(head, batch, config, train=False)
            ok = torch.stack([c[0] for c in correct])  # [gamma, k]: depth s correct at entry e
            first = max(0, s.start - 2 - lo)  # entries whose token is the answer's (or the last prompt token)
            hits += int(ok[0, first:].sum())
            total += max(0, k - first)
            for b in range(first, k - gamma + 1):
                every += _chain(ok, b)
                starts += 1
            b = first
            while b < k - gamma + 1:
                a = _chain(ok, b)
                accepted += a
                hist[a] += 1
                rounds += 1
                b += a + 1
    return {"top1": hits / max(1, total), "accepted": accepted / max(1, rounds),
            "tokens_per_pass": 1 + accepted / max(1, rounds), "positions": total, "rounds": rounds,
            "accept_hist": hist, "accepted_every_start": every / max(1, starts), "gamma": gamma}
