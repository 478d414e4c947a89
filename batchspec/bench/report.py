"""The benchmark's Markdown table."""

from __future__ import annotations


def _x(value, fmt="{:.2f}", suffix="") -> str:
    return "-" if value is None else fmt.format(value) + suffix


def markdown_table(results: list[dict]) -> str:
    head = ("| method | drafter | bs | γ | tokens/s (min–max) | speedup | vs bs1 | vs hf_generate | vs hf_assisted "
            "| accept | tok/round | prefill/draft/verify/align/other % | ideal | efficiency | peak MB |")
    lines = [head, "|" + "|".join(["---"] * 15) + "|"]
    for r in results:
        share = r.get("time_share")
        stages = ("prefill", "draft", "verify", "align", "other")
        shares = "/".join(f"{100 * share.get(k, 0.0):.0f}" for k in stages) if share else "-"
        drafter = r.get("drafter") or "-"
        if r.get("synthetic"):
            drafter += " (synthetic)"
        tps = f"{r['tokens_per_s']:.1f} ({r['tokens_per_s_min']:.1f}–{r['tokens_per_s_max']:.1f})"
        lines.append(
            f"| {r['method']} | {drafter} | {r['batch_size']} | {r['gamma'] or '-'} | {tps} "
            f"| {_x(r.get('speedup'))} | {_x(r.get('speedup_vs_bs1'))} | {_x(r.get('vs_hf_generate'))} "
            f"| {_x(r.get('vs_hf_assisted'))} | {_x(r.get('acceptance_rate'), '{:.3f}')} "
            f"| {_x(r.get('tokens_per_round'))} | {shares} | {_x(r.get('ideal_speedup'))} "
            f"| {_x(r.get('efficiency'))} | {r['peak_memory_mb']:.0f} |"
        )
    return "\n".join(lines)


def noise_floor(results: list[dict]) -> list[str]:
    """One note per batch size that ran a twin (`bench --twin`): what a second, identical
    autoregressive engine measured against the first, the spread a speed-up of 1.0 has in this run.

    >>> noise_floor([{"method": "autoregressive[twin]", "twin": True, "batch_size": 8, "speedup": 1.03,
    ...               "speedup_runs": [0.94, 1.03, 1.08]}])  # doctest: +NORMALIZE_WHITESPACE
    ['noise floor at batch size 8: a second, identical autoregressive engine made 1.03x the first
      (per repeat 0.94-1.08): speed-ups within that of 1.0 do not tell the cells apart']
    """
    notes = []
    for r in results:
        if r.get("twin") and r.get("speedup"):
            runs = r.get("speedup_runs") or [r["speedup"]]
            notes.append(f"noise floor at batch size {r['batch_size']}: a second, identical autoregressive engine "
                         f"made {r['speedup']:.2f}x the first (per repeat {min(runs):.2f}-{max(runs):.2f}): speed-ups "
                         "within that of 1.0 do not tell the cells apart")
    return notes


def scheduling_table(results: list[dict]) -> str:
    """How batches were laid out: rows moved to keep a batch together, rows idle in a verify pass,
    query columns padded for rows drafting fewer tokens, and how full the batches were; and whether
    the rounds that verified drafts made tokens faster than the plain rounds of the same batch sizes
    in the same runs (`core.stats.round_gain`, with the share of their time it covers)."""
    rows = [r for r in results if r["method"].split("[")[0] in ("eqspec", "exspec")
            and r.get("moved_rows_per_round") is not None]
    if not rows:
        return ""
    lines = ["| method | drafter | bs | γ | window | tokens/s | moved rows/round | idle rows/round "
             "| padding tokens/round | mean occupancy | speculative rounds' gain (coverage) |",
             "|" + "|".join(["---"] * 11) + "|"]
    for r in rows:
        rounds = r.get("adaptive") or {}
        gain = _x(rounds.get("round_gain")) + (f" ({rounds['round_gain_coverage']:.0%})"
                                                if rounds.get("round_gain") is not None else "")
        lines.append(
            f"| {r['method']} | {r.get('drafter') or '-'} | {r['batch_size']} | {r['gamma']} "
            f"| {r.get('window') or '-'} | {r['tokens_per_s']:.1f} "
            f"| {r['moved_rows_per_round']:.2f} | {r['idle_rows_per_round']:.2f} "
            f"| {r['padding_tokens_per_round']:.1f} | {r['mean_batch_occupancy']:.2f} | {gain} |"
        )
    return "\n".join(lines)
