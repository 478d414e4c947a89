"""The adaptive policy's cost table, its corrections and decisions after two runs at batch 32 and 8.

Usage: PYTHONPATH=. python scripts/cuda_policy.py DEVICE [PROMPTS NEW_TOKENS]   (docs/gpu.md; 64 x 32)"""
import sys
import time

from batchspec import EngineConfig, SamplingParams, SpecEngine, load_pair
from batchspec.prompts import load_prompts

device = sys.argv[1]
pair = load_pair(device=device)
n, new = (int(a) for a in sys.argv[2:4]) if len(sys.argv) > 3 else (64, 32)
texts = load_prompts(limit=n)
params = SamplingParams(max_new_tokens=new, ignore_eos=True)
for bs in (32, 8):
    e = SpecEngine(pair, EngineConfig(batch_size=bs))
    for _ in range(2):
        t = time.perf_counter()
        e.generate(texts, params)
        print(bs, "run", round(time.perf_counter() - t, 3), flush=True)
    c = e.policy.table
    print("rows", c.rows, "cols", c.cols, "token_s", c.token_s)
    print("verify_s ms", {k: round(v * 1e3, 2) for k, v in c.verify_s.items()})
    print("draft_s ms", {k: round(v * 1e3, 2) for k, v in c.draft_s.items()})
    print("scales", {k: round(v, 3) for k, v in c.scale.items()})
    s = e.last_run.summary()
    print("adaptive", s.get("adaptive"), flush=True)
    print("stage", {k: round(v, 3) for k, v in e.timer.totals.items()}, flush=True)
