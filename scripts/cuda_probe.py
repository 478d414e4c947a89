"""Where a round's time goes: AR vs the adaptive default vs fixed gamma 4 (and cProfile unless a 5th argument).

Usage: PYTHONPATH=. python scripts/cuda_probe.py DEVICE BATCH PROMPTS NEW_TOKENS [noprof]
(docs/gpu.md: the numbers it gave on an H200.) Engines are reused across runs and the drafter
does not forget, so a suffix trie has seen the same prompts' answers: speculative figures are an
upper bound (`batchspec bench` forgets between runs)."""
import cProfile
import pstats
import sys
import time

import torch

from batchspec import EngineConfig, SamplingParams, SpecEngine, load_pair
from batchspec.prompts import load_prompts

device, bs, n, new = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
pair = load_pair(device=device)
texts = load_prompts(limit=n)
params = SamplingParams(max_new_tokens=new, ignore_eos=True)
cfgs = {"ar": dict(method="autoregressive"), "adaptive": dict(), "g4": dict(adaptive=False)}
engines = {k: SpecEngine(pair, EngineConfig(batch_size=bs, **v)) for k, v in cfgs.items()}
for e in engines.values():
    e.generate(texts, params)
for rep in range(2):
    for k, e in engines.items():
        sync()
        t = time.perf_counter()
        outs = e.generate(texts, params)
        sync()
        dt = time.perf_counter() - t
        print(k, rep, f"{sum(len(o.token_ids) for o in outs) / dt:.0f} tok/s {dt:.3f} s", flush=True)
for k in (("ar", "adaptive") if len(sys.argv) < 6 else ()):
    pr = cProfile.Profile()
    pr.enable()
    engines[k].generate(texts, params)
    sync()
    pr.disable()
    print("=====", k, flush=True)
    pstats.Stats(pr).sort_stats("tottime").print_stats(22)
    if k == "adaptive":
        pstats.Stats(pr).sort_stats("cumulative").print_stats(35)
