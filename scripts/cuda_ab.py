"""Autoregressive and the adaptive default, step-paired (a round each in turn), per batch size: the
default's speed-up over the baseline per repeat, its draft stage and speculative row-rounds. With
OVERRIDES (EngineConfig fields, e.g. fuse_prefill=false) a third engine, the default with them,
runs in the same rotation and is reported the same way ("alt").

Usage: PYTHONPATH=. python scripts/cuda_ab.py DEVICE PROMPTS NEW_TOKENS REPEATS SIZES [OVERRIDES]
       (docs/gpu.md: cuda 64 32 3 8,32,64; or ... 8,32,64 fuse_prefill=false)"""
import contextlib
import sys

import torch

from batchspec import EngineConfig, SamplingParams, SpecEngine, load_pair
from batchspec.prompts import load_prompts

dev, n, new, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
sizes = [int(x) for x in sys.argv[5].split(",")]


def parse(value: str):
    return {"true": True, "false": False}.get(value.lower(), int(value) if value.isdigit() else value)


pairs = (kv.split("=") for kv in sys.argv[6].split(",")) if len(sys.argv) > 6 else ()
overrides = {k: parse(v) for k, v in pairs}
pair = load_pair(device=dev)
texts = load_prompts(limit=n)
params = SamplingParams(max_new_tokens=new, ignore_eos=True)
for bs in sizes:
    engs = {"ar": SpecEngine(pair, EngineConfig(method="autoregressive", batch_size=bs)),
            "def": SpecEngine(pair, EngineConfig(batch_size=bs))}
    if overrides:
        engs["alt"] = SpecEngine(pair, EngineConfig(batch_size=bs, **overrides))
    for e in engs.values():
        e.generate(texts, params)  # warm-up on the whole workload
    for rep in range(reps):
        order = list(engs) if rep % 2 == 0 else list(reversed(engs))
        for k in order:
            if engs[k].drafter is not None:
                engs[k].drafter.forget()
            engs[k].submit(texts, params)
        with contextlib.ExitStack() as st:
            recs = {k: st.enter_context(engs[k].recording()) for k in order}
            live = list(order)
            while live:
                for k in list(live):
                    engs[k].step()
                    if not engs[k].has_unfinished():
                        live.remove(k)
        if dev.startswith("cuda"):
            torch.cuda.synchronize()
        for k in [k for k in engs if k != "ar"]:
            r = recs[k]
            ad = r.summary()["adaptive"] or {}
            spec = sum(v for g, v in (ad.get("gamma_hist") or {}).items() if g != "0")
            ar = recs["ar"].wall
            print(f"bs {bs} rep {rep} {k} ratio {ar / r.wall:.3f} ar {ar:.3f} {k} {r.wall:.3f} "
                  f"draft {r.stage_time.get('draft', 0):.3f} spec_rr {spec} rounds {r.rounds}", flush=True)
