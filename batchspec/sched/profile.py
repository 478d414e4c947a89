"""Measuring the cost table (`costs.py`) once per (models, device, dtype, threads) and keeping it.

A few forwards per grid point through the engine's own forward, every point timed once per sweep
and the fastest run kept (`core/timing.py`: other work on the machine only ever adds time), within
PROFILE_BUDGET_S. The grid: rows 1 and the batch size (and 8 between them for larger batches), by
1 .. γ + 1 tokens per row (and, for a drafter whose rows may verify s runner-ups per depth beside
their drafts, 1 + 2γ and 1 + γ(1 + s): siblings widen a pass past γ + 1, where a CPU's cost per token
changes, e.g. SmolLM2 at 2 rows: 1.51x a plain pass at 5 tokens, 1.85x at 9, 3.24x at 17); one
ragged pass (one row fed γ + 1 tokens, the rest 1) for `token_s`, and at each row count above 1 one
row fed 2 tokens, the rest 1, for `first_s`; the drafter's step at each row count through its own
`step_probe` (none for a lookup). Kept in memory and on disk (`batchspec/cache.py`); a table read
from disk is measured again when a plain pass now runs in under STALE of what it says (it was taken
at a busy moment: see `stale`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import cache
from ..core.forward import LEAN_REVISION, make_forward
from ..core.timing import fastest, kv_buffer, step_runner, step_time
from .costs import CostTable

PROFILE_BUDGET_S = 8.0  # seconds the timed sweeps may take after the first
STALE = 0.9  # a table read from disk is measured again when a plain pass now takes less than this share of it
CONTEXT = 128  # keys each profiled row attends over
_TABLES: dict[tuple, CostTable] = {}


def profile_rows(batch_size: int) -> tuple[int, ...]:
    """1 and the batch size, and 8 between them for a larger batch: V is far from linear in rows
    on a CPU below 8 (matrix-vector kernels) and close to it above."""
    return tuple(sorted({1, batch_size} | ({8} if batch_size > 16 else set())))


def profile_cols(gamma: int, siblings: int = 0) -> tuple[int, ...]:
    """1 .. γ + 1, and with s siblings per depth 1 + 2γ and 1 + γ(1 + s) (see the module docstring)."""
    wide = {1 + 2 * gamma, 1 + gamma * (1 + siblings)} if siblings else set()
    return tuple(sorted(set(range(1, gamma + 2)) | wide))


def cost_table(target, drafter, draft_model, batch_size: int, gamma: int, forward: str = "auto",
               siblings: int = 0) -> CostTable:
    """The cost table of `target` with `drafter` (`Drafter.step_probe`; `draft_model` names its model
    in the cache key, None for a lookup) at rows `profile_rows(batch_size)` by `profile_cols`."""
    rows, cols = profile_rows(batch_size), profile_cols(gamma, siblings)
    label = drafter.label if drafter is not None else None
    key = (id(target), id(draft_model), label, str(target.device), str(target.dtype), torch.get_num_threads(),
           rows, cols, forward)
    if key in _TABLES:
        return _TABLES[key]
    kernels = [plan.key() if (plan := getattr(make_forward(m, forward), "plan", None)) else None
               for m in (target, draft_model) if m is not None]
    path = cache.profile_path(target, draft_model, {"rows": rows, "cols": cols, "context": CONTEXT, "drafter": label,
                                                    "forward": forward, "kernels": kernels, "lean": LEAN_REVISION,
                                                    "table": 4})
    table = _read(path)
    if table is None or stale(table, lambda b: step_time(target, b, CONTEXT, 1, 3, forward)):
        table = measure(target, drafter, rows, cols, forward, gamma + 1)
        cache.write(path, table.to_json())
    _TABLES[key] = table
    return table


def stale(table: CostTable, plain_now: Callable[[int], float]) -> bool:
    """Whether a kept table was measured at a busy moment: a plain pass at some row count b
    (`plain_now(b)`, timed only until one is found) now runs in under STALE of the time the table
    says. Other work only ever adds time, and what it adds to the plain pass skews the table's
    shape the harmful way: V(b, n) / V(b, 1) reads flat, so drafts look cheap. Seen on SmolLM2: a
    kept table read 54 ms for a 1-row pass of 1 to 4 tokens, where a quiet machine times 32 ms for
    1 and 42.5 for 5; the check at load, itself on a busy machine, did not fall under 0.7 of it,
    and the default made 0.92x plain decoding at 32 rows on that table and 0.99x once it was
    measured again. 0.9 leaves a busy table less room.

    Example, STALE 0.9: the table says 40 ms at one row, a plain pass now takes 32 -> 32 < 36: stale.
    Now 38 (a busy check, or the table is right) -> kept."""
    return any(plain_now(b) < STALE * table.verify_s[(b, 1)] for b in table.rows)


def _read(path) -> CostTable | None:
    data = cache.read(path)
    try:
        return CostTable.from_json(data) if data is not None else None
    except (KeyError, TypeError, ValueError):
        return None  # from another version: measure again


def measure(target, drafter, rows: tuple[int, ...], cols: tuple[int, ...], forward: str = "auto",
            chain: int | None = None) -> CostTable:
    """Time the grid now (see the module docstring); `chain`: the widest pass without siblings (the
    ragged pass's row, default the widest column)."""
    b, n = rows[-1], chain or cols[-1]
    width = CONTEXT + cols[-1]
    buffers = {r: kv_buffer(target, r, width) for r in rows}
    runners = {("verify", r, c): step_runner(target, r, CONTEXT, c, forward, kv=buffers[r]) for r in rows for c in cols}
    if b > 1 and n > 1:  # one row fed n tokens, the others 1: what a packed pass saves per token
        runners[("ragged", b, n)] = step_runner(target, b, CONTEXT, 1, forward, first=n, kv=buffers[b])
    for r in (r for r in rows if r > 1 and n > 1):  # one row fed 2 tokens: what a pass adds once a row drafts
        runners[("first", r, 2)] = step_runner(target, r, CONTEXT, 1, forward, first=2, kv=buffers[r])
    probes = {r: drafter.step_probe(r, CONTEXT) if drafter is not None else None for r in rows}
    runners.update({("draft", r, 1): p for r, p in probes.items() if p is not None})
    timed = fastest(runners, 5, PROFILE_BUDGET_S)
    verify = {(r, c): timed[("verify", r, c)] for r in rows for c in cols}
    for i, r in enumerate(rows):  # a noisy machine can time a bigger pass faster: more never costs less
        for j, c in enumerate(cols):
            verify[(r, c)] = max([verify[(r, c)]] + ([verify[(rows[i - 1], c)]] if i else [])
                                 + ([verify[(r, cols[j - 1])]] if j else []))
    token_s = 0.0
    if ("ragged", b, n) in timed:
        token_s = max(0.0, (verify[(b, n)] - timed[("ragged", b, n)]) / ((b - 1) * (n - 1)))
    draft = {r: timed[("draft", r, 1)] for r in rows if ("draft", r, 1) in timed}
    first = {r: min(max(0.0, timed[("first", r, 2)] - verify[(r, 1)]), verify[(r, 2)] - verify[(r, 1)])
             for r in rows if ("first", r, 2) in timed}  # (one row fed 2 never costs more than every row)
    return CostTable(rows, cols, verify, draft, token_s, first)
