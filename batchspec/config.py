"""Engine configuration: data, validated loudly when built."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("autoregressive", "eqspec", "exspec")
FORWARDS = ("auto", "lean", "hf")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine batches and speculates.

    method        autoregressive (target only), eqspec (fixed batches, realigned every round)
                  or exspec (a window of sequences, batches formed from similar lengths).
    gamma         draft tokens proposed per round (ignored by autoregressive).
    batch_size    rows verified together in one target forward pass.
    window        exspec only: sequences kept in flight (>= batch_size); default 4 x batch_size.
    sort_by_length  admit prompts shortest first (outputs still return in input order).
    drafter       how drafts are proposed: "draft_model" (the draft model) or "oracle:<p>",
                  a synthetic drafter for overhead studies (see batchspec.drafters.oracle).
    forward       how models run: "auto" (batchspec's lean forward for Llama-family models, the
                  transformers modules otherwise), "lean" (require it) or "hf" (always the modules);
                  see batchspec.core.forward.
    debug         check the batch layout invariants after every alignment (slow).
    profile       synchronise the device at stage boundaries so stage timers are exact on CUDA.
    """

    method: str = "eqspec"
    gamma: int = 5
    batch_size: int = 8
    window: int | None = None
    sort_by_length: bool = False
    drafter: str = "draft_model"
    block_size: int = 16
    forward: str = "auto"
    debug: bool = False
    profile: bool = False

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if not isinstance(self.gamma, int) or self.gamma < 1:
            raise ValueError(f"gamma must be an integer >= 1 (draft tokens per round), got {self.gamma!r}")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {self.batch_size!r}")
        if self.window is not None:
            if self.method != "exspec":
                raise ValueError("window applies to method 'exspec' only; drop it or use --method exspec")
            if self.window < self.batch_size:
                raise ValueError(f"window ({self.window}) must be >= batch_size ({self.batch_size})")
        if self.forward not in FORWARDS:
            raise ValueError(f"unknown forward {self.forward!r}; choose one of {', '.join(FORWARDS)}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    @property
    def speculative(self) -> bool:
        return self.method != "autoregressive"

    @property
    def effective_window(self) -> int:
        if self.method != "exspec":
            return self.batch_size
        return self.window if self.window is not None else 4 * self.batch_size
