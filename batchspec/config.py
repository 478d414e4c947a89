"""Engine configuration: data, validated loudly when built."""

from __future__ import annotations

from dataclasses import dataclass, field

METHODS = ("autoregressive", "eqspec", "exspec")
FORWARDS = ("auto", "lean", "hf")
REFILLS = ("continuous", "none")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine batches and speculates.

    method        autoregressive (target only), eqspec (fixed batches, realigned every round)
                  or exspec (a window of sequences, batches formed from similar lengths).
    gamma         draft tokens proposed per round (ignored by autoregressive).
    batch_size    rows verified together in one target forward pass.
    window        exspec only: sequences kept in flight (>= batch_size); default 4 x batch_size.
    sort_by_length  admit prompts shortest first (outputs still return in input order).
    drafter       how drafts are proposed (batchspec.drafters): "hybrid" (default: suffix lookup
                  where it finds a match, a model elsewhere while it pays: the draft model, else
                  the target's EAGLE head), "draft_model", "ngram", "suffix", "eagle:<dir>" (an
                  EAGLE draft head), or "oracle:<p>", a synthetic drafter for overhead studies.
    forward       how models run: "auto" (batchspec's lean forward for Llama-family models, the
                  transformers modules otherwise), "lean" (require it) or "hf" (always the modules);
                  see batchspec.core.forward.
    refill        "continuous": a freed row is refilled from the queue at the next round boundary
                  (every method); "none": the founding paper's fixed batches, the next requests are
                  admitted only when the whole batch (exspec: the whole window) has finished.
    max_kv_tokens KV budget in tokens per model, allocated once at start-up as one row per resident
                  request (batch_size rows, or exspec's window) of max_kv_tokens / rows tokens each;
                  None: rows as long as the model context, at most half the free memory. A request
                  longer than a row is refused when it is added; others wait for a free row.
    max_prefill_tokens  at most this many prompt-token slots (rows x width) per prefill forward;
                  longer prompts are prefilled in chunks interleaved with decoding rounds.
    fuse_prefill  autoregressive and eqspec through the lean forward: a request admitted whose
                  unseen prompt fits max_prefill_tokens is prefilled inside the next round's target
                  pass and takes its first token from it (no forward of its own); False: always a
                  prefill forward apart.
    adaptive      plan each row's draft length (0..gamma) every round from measured step costs and
                  the rows' acceptance, maximising expected tokens per second (all 0: a plain
                  decoding round), verifying the drafts most likely to be accepted under the budget
                  that pays best (see sched/policy.py); gamma is then the most a row
                  drafts. Greedy output is unchanged; sampled output stays distributed as the
                  target's. A seeded sampled request is left out of the plan (it drafts and
                  verifies as with fixed gamma), so its sample does not depend on its batch.
    siblings      greedy rows: up to this many of a scoring drafter's runner-ups at each depth (an
                  EAGLE head's next-best tokens) verified beside its chain, in the same pass, chosen
                  by the cost table (with --no-adaptive: all of them); one taken where the chain's
                  draft was rejected commits a token more (sched/siblings.py). 0: chains only.
    budget        TETRIS: verify at most this many draft tokens per round across the batch, chosen by
                  estimated cumulative acceptance (only prefixes of rows' drafts); with adaptive the
                  policy otherwise chooses the budget itself each round (sched/policy.py).
    draft_window  the draft model's context per request: its first 4 tokens and its last
                  draft_window to 2 x draft_window (StreamingLLM's sinks and window; see
                  drafters/model.py), re-cut when it would grow past that; None: the whole request.
                  Drafts only propose, so no output changes; it bounds what a draft step attends
                  over and what the draft model catches up on (at the default, a prompt longer than
                  260 tokens enters it cut to 132).
    debug         check the KV layout invariants at every commit.
    profile       synchronise the device at stage boundaries so stage timers are exact on CUDA.
    """

    # Each field's metadata is how the command line shows it (batchspec/cli/options.py derives
    # one option per field from it): "help" (short; the docstring above is the long form),
    # "panel" (the --help panel, default "Engine"), "metavar", "none_as" (the value that means None),
    # "cli": False (no option: fuse_prefill is an ablation switch for tests and benchmarks).
    method: str = field(default="eqspec", metadata={
        "help": "autoregressive (target only), eqspec (fixed batches) or exspec (a window of sequences)",
        "metavar": "NAME"})
    gamma: int = field(default=4, metadata={
        "help": "Draft tokens per round (with --adaptive: the most a row drafts)", "metavar": "N"})
    batch_size: int = field(default=8, metadata={
        "help": "Rows verified together in one target pass", "metavar": "N"})
    window: int | None = field(default=None, metadata={
        "help": "exspec: sequences in flight (default: 4 x batch size)", "metavar": "N"})
    sort_by_length: bool = field(default=False, metadata={
        "help": "Admit prompts shortest first (outputs keep input order)"})
    drafter: str = field(default="hybrid", metadata={
        "help": "hybrid (suffix lookup where it matches, a model elsewhere while it pays: the draft model, else "
                "the target's shipped EAGLE head), draft_model, ngram[:min_n,max_n,k] (prompt lookup), suffix[:...] "
                "(suffix decoding over this and earlier requests), eagle[:<dir>] (an EAGLE draft head) or "
                "oracle:<p> (synthetic); parameters in docs/drafters.md",
        "metavar": "SPEC"})
    forward: str = field(default="auto", metadata={
        "help": "auto (batchspec's lean forward for Llama-family models, else transformers' modules), lean "
                "or hf", "panel": "Expert", "metavar": "NAME"})
    refill: str = field(default="continuous", metadata={
        "help": "continuous (a finished row is refilled at the next round) or none (the founding paper's "
                "fixed batches)", "panel": "Expert", "metavar": "NAME"})
    max_kv_tokens: int | None = field(default=None, metadata={
        "help": "KV budget per model in tokens, allocated once (default: rows as long as the model context, "
                "at most half the free memory)", "panel": "Expert",
        "metavar": "N"})
    max_prefill_tokens: int = field(default=2048, metadata={
        "help": "Prompt-token slots per prefill forward (longer prompts are prefilled in chunks)",
        "panel": "Expert", "metavar": "N"})
    fuse_prefill: bool = field(default=True, metadata={"cli": False})
    adaptive: bool = field(default=True, metadata={
        "help": "Choose each row's draft length (0..gamma) every round from measured costs and acceptance; "
                "--no-adaptive: every row drafts gamma"})
    siblings: int = field(default=3, metadata={
        "help": "Greedy rows: a drafter's runner-ups (at most N at each depth) verified beside its chain where "
                "the cost table says they pay; 0: chains only", "metavar": "N"})
    budget: int | None = field(default=None, metadata={
        "help": "TETRIS: verify at most N drafts per round across the batch, the likeliest to be accepted "
                "(default: none, or --adaptive's choice)", "panel": "Expert",
        "metavar": "N"})
    draft_window: int | None = field(default=128, metadata={
        "help": "The draft model's context: its first 4 tokens and its last N to 2N (StreamingLLM's sinks "
                "and window); 0 = all of it. Changes no output",
        "panel": "Expert", "metavar": "N", "none_as": 0})
    debug: bool = field(default=False, metadata={
        "help": "Check the KV layout invariants at every commit (slow)", "panel": "Expert"})
    profile: bool = field(default=False, metadata={
        "help": "CUDA: synchronise at stage boundaries for exact time shares", "panel": "Benchmark"})

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
        if self.refill not in REFILLS:
            raise ValueError(f"unknown refill {self.refill!r}; choose one of {', '.join(REFILLS)}")
        if self.max_kv_tokens is not None and (not isinstance(self.max_kv_tokens, int) or self.max_kv_tokens < 1):
            raise ValueError(f"max_kv_tokens must be a positive integer (tokens per model), got {self.max_kv_tokens!r}")
        if not isinstance(self.siblings, int) or self.siblings < 0:
            raise ValueError(f"siblings must be an integer >= 0 (runner-ups per depth), got {self.siblings!r}")
        if self.budget is not None and (not isinstance(self.budget, int) or self.budget < 1):
            raise ValueError(f"budget must be a positive integer (drafts verified per round), got {self.budget!r}")
        if self.draft_window is not None and (not isinstance(self.draft_window, int) or self.draft_window < 1):
            raise ValueError(f"draft_window must be a positive integer (tokens), or None for the whole context "
                             f"(--draft-window 0), got {self.draft_window!r}")
        if not isinstance(self.fuse_prefill, bool):
            raise ValueError(f"fuse_prefill must be True or False, got {self.fuse_prefill!r}")
        if not isinstance(self.max_prefill_tokens, int) or self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be a positive integer, got {self.max_prefill_tokens!r}")

    @property
    def speculative(self) -> bool:
        return self.method != "autoregressive"

    @property
    def effective_window(self) -> int:
        if self.method != "exspec":
            return self.batch_size
        return self.window if self.window is not None else 4 * self.batch_size
