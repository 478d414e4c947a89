"""Sampling parameters, logits -> probabilities, and per-request random numbers.

The same `probabilities` function turns draft logits into q and target logits into p, so both
models see identical temperature / top-k / top-p processing over the real vocabulary.
Temperature 0 is greedy: the distribution becomes one-hot at the argmax and every sampling
step below degenerates to argmax, so greedy is the same code path (with a fast path that
skips the softmax when a whole batch is greedy).

Randomness is per request: each request owns a `torch.Generator` seeded from its `seed`, and
every round draws a fixed number of uniforms from it. A seeded request's output therefore
depends only on its prompt, parameters and seed, not on the batch it shares. Uniforms are
float64 and `sample` inverts a float64 CDF, so tokens with probability far below float32's
resolution near 1 (~6e-8) are still drawn at their rate.

No function here reads a tensor back to the host (no `.item()`, `bool(tensor)`, ...): which
branches run is decided from Python facts about the batch (`BatchSampling.any_*`) or not at
all, so sampling a drafted token costs no device sync.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """What to generate for one request.

    temperature 0 means greedy decoding; top_k 0 and top_p 1.0 disable those filters.
    Generation stops after `max_new_tokens` tokens or at the first EOS / stop token, which is
    included in the output, or when the text contains one of the `stop` strings: the text is cut
    before it, and the token that completed it is the last one.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0 and self.temperature < float("inf")):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def request_seed(run_seed: int, index: int) -> int:
    """Seed of request `index` in a run seeded with `run_seed`: reproducible, distinct per request."""
    return random.Random(run_seed * 1_000_003 + index).getrandbits(63)


def make_generator(seed: int | None) -> torch.Generator:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed if seed is not None else random.getrandbits(63))
    return gen


def draw_uniforms(generators: list[torch.Generator | None], count: int, device) -> torch.Tensor:
    """[B, count] float64 uniforms in [0, 1), row i drawn from generators[i]; zeros for greedy rows (None)."""
    zeros = torch.zeros(count, dtype=torch.float64)
    rows = [torch.rand(count, generator=g, dtype=torch.float64) if g is not None else zeros for g in generators]
    return torch.stack(rows).to(device=device)


@dataclass
class BatchSampling:
    """Per-row sampling parameters of a batch as tensors: temperature, top_k, top_p all [B].

    The bools are facts about the whole batch, known on the host so that no branch has to ask
    the device. Built by hand without them, the any_* default to True, which is always correct
    (it only skips no work)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    all_greedy: bool
    any_greedy: bool = True  # some row has temperature 0
    any_top_k: bool = True  # some row has top_k > 0
    any_top_p: bool = True  # some row has top_p < 1

    @classmethod
    def of(cls, params: list[SamplingParams], device) -> BatchSampling:
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            all_greedy=all(p.greedy for p in params),
            any_greedy=any(p.greedy for p in params),
            any_top_k=any(p.top_k > 0 for p in params),
            any_top_p=any(p.top_p < 1 for p in params),
        )


def probabilities(logits: torch.Tensor, sp: BatchSampling) -> torch.Tensor:
    """logits [B, k, V] -> probabilities [B, k, V] (float32) after temperature, top-k, top-p.

    Greedy rows (temperature 0) get a one-hot distribution at the argmax. Ties at the top-k
    threshold are kept, so the result is a deterministic function of the logits.
    """
    logits = logits.float()
    greedy = sp.temperature == 0
    temp = torch.where(greedy, torch.ones_like(sp.temperature), sp.temperature)
    x = logits / temp[:, None, None]
    vocab = x.shape[-1]
    if sp.any_top_k or sp.any_top_p:
        # Filters act on the sorted row: top-k keeps ranks < k, then top-p keeps the shortest
        # prefix of the top-k distribution whose mass reaches top_p (as transformers does).
        sorted_x, _ = x.sort(dim=-1, descending=True)
        k = torch.where(sp.top_k > 0, sp.top_k.clamp(max=vocab), torch.full_like(sp.top_k, vocab))
        rank = torch.arange(vocab, device=x.device)
        sorted_x = sorted_x.masked_fill(rank >= k[:, None, None], float("-inf"))
        sorted_p = torch.softmax(sorted_x, dim=-1)
        mass_before = sorted_p.cumsum(-1) - sorted_p
        # A row with top_p = 1 keeps its whole top-k even where float32 rounding puts the mass
        # before a tail token at 1, so its result does not depend on the other rows' filters.
        in_p = (mass_before < sp.top_p[:, None, None]) | (sp.top_p >= 1)[:, None, None]
        n_keep = (in_p & (rank < k[:, None, None])).sum(-1, keepdim=True)
        threshold = sorted_x.gather(-1, n_keep.clamp(min=1) - 1)
        x = x.masked_fill(x < threshold, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if sp.any_greedy:
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None, None], one_hot, probs)
    return probs


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [..., V] (rows need not be normalised), u [...] in [0, 1).

    Returns token ids [...]. Deterministic in (probs, u); never returns a zero-probability token.
    The CDF and u * total are float64: in float32 the CDF cannot rise by less than ~6e-8 near 1,
    so tokens with less mass than that (after the bulk of the row) would never be drawn.
    """
    cdf = probs.to(torch.float64).cumsum(-1)
    target = (u.to(torch.float64) * cdf[..., -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # idx = V when u * total rounds up to total: take the last token with mass. Any idx < V has
    # cdf[idx] > cdf[idx - 1], so mass there, so it is at most that last token: the minimum
    # changes only the overflow case, and needs no host-side check.
    vocab = torch.arange(probs.shape[-1], device=probs.device)
    last = torch.where(probs > 0, vocab, -1).amax(-1)
    return torch.minimum(idx, last)
