"""The benchmark: grid runner, step costs, peers, report and plots."""

from __future__ import annotations

from statistics import mean

from ..config import EngineConfig
from ..core.forward import lean_unsupported
from .costs import ideal_speedup, step_costs
from .machine import machine_info
from .report import markdown_table, noise_floor
from .runner import Bench, Cell, measure_costs, plan, summarize


def run_bench(pair, prompts: list[list[int]], params, *, methods, batch_sizes, gammas, drafters=("draft_model",),
              peers: bool = False, repeat: int = 1, windows=("4x",), forwards=("auto",), refills=("continuous",),
              adaptives=(True,), budgets=("none",), sort_by_length=False, profile=False, progress=None,
              engine_options: dict | None = None, twin: bool = False, pairing: str = "steps",
              draft_windows=(EngineConfig.draft_window,), siblings=(EngineConfig.siblings,)) -> dict:
    """Run the grid and return the JSON-ready report: {machine, config, notes, results}. twin: a
    second autoregressive engine per batch size, the run's noise floor (`plan`, `noise_floor`).
    pairing: how the cells of a repeat share the machine (`Bench.measure`)."""
    cells, notes = plan(list(methods), list(batch_sizes), list(gammas), list(drafters), peers, list(windows),
                        list(forwards), list(refills), list(adaptives), list(budgets), twin, list(draft_windows),
                        list(siblings))
    if pair.draft is None and any(c.method == "hf_assisted" for c in cells):
        cells = [c for c in cells if c.method != "hf_assisted"]
        notes.append("hf_assisted was not run: assisted generation needs a draft model, and none was loaded")
    new_tokens = sorted({p.max_new_tokens for p in params})
    if peers and len(new_tokens) > 1:
        raise ValueError("the transformers peers take one max_new_tokens for a whole batch; drop --peers with a "
                         "range of --max-new-tokens")
    bench = Bench(pair, prompts, params, sort_by_length=sort_by_length, profile=profile, progress=progress,
                  engine_options=engine_options)
    runs = bench.measure(cells, repeat, pairing)
    context = int(mean(len(p) for p in prompts) + mean(new_tokens) / 2)
    if progress:
        progress("measuring step costs", 1, 1)
    costs = measure_costs(pair, cells, context)
    device = pair.target.device
    timers_exact = device.type != "cuda" or profile
    results = summarize(runs, costs, pair)
    notes.extend(noise_floor(results))
    if not timers_exact:
        for r in results:
            r["time_share"] = None
        notes.append("time shares omitted: on CUDA they need --profile (device sync at stage boundaries)")
    if any(r["synthetic"] for r in results):
        notes.append("rows marked synthetic use the oracle drafter, which knows the target's output: "
                     "they measure system overhead at a chosen acceptance rate, not a real drafter")
    lengths = [len(p) for p in prompts]
    config = {
        "target": pair.target_name, "draft": pair.draft_name, "dtype": str(pair.target.dtype).replace("torch.", ""),
        "num_prompts": len(prompts),
        "prompt_tokens": {"min": min(lengths), "mean": mean(lengths), "max": max(lengths)},
        "max_new_tokens": params[0].max_new_tokens if len(new_tokens) == 1 else
                          {"min": new_tokens[0], "mean": mean(p.max_new_tokens for p in params), "max": new_tokens[-1]},
        "temperature": params[0].temperature, "top_k": params[0].top_k, "top_p": params[0].top_p,
        "methods": list(methods), "batch_sizes": list(batch_sizes), "gammas": list(gammas),
        "drafters": list(drafters), "peers": ["hf_generate", "hf_assisted"] if peers else [], "repeat": repeat,
        "pairing": pairing,
        "windows": list(windows), "forwards": list(forwards), "refills": list(refills), "adaptives": list(adaptives),
        "budgets": list(budgets), "twin": twin, "draft_windows": list(draft_windows),
        "siblings": list(siblings),
        **(engine_options or {}),
        "auto_forward": {name: "lean" if lean_unsupported(m) is None else f"hf ({lean_unsupported(m)})"
                         for name, m in (("target", pair.target), ("draft", pair.draft)) if m is not None},
        "sort_by_length": sort_by_length, "profile_sync": profile and device.type == "cuda",
        "timers_exact": timers_exact, "cost_context_tokens": context,
        "step_costs": {f"bs={bs},gamma={g},forward={f}": c for (bs, g, f), c in costs.items()},
    }
    return {"machine": machine_info(device), "config": config, "notes": notes, "results": results}


__all__ = ["Bench", "Cell", "ideal_speedup", "markdown_table", "plan", "run_bench", "step_costs", "summarize"]
