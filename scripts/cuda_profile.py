"""torch.profiler over one generate of the adaptive default, fixed gamma 4 and AR at batch 32.

Usage: PYTHONPATH=. python scripts/cuda_profile.py DEVICE   (docs/gpu.md)"""
import sys

from torch.profiler import ProfilerActivity, profile

from batchspec import EngineConfig, SamplingParams, SpecEngine, load_pair
from batchspec.prompts import load_prompts

device = sys.argv[1]
pair = load_pair(device=device)
texts = load_prompts(limit=64)
params = SamplingParams(max_new_tokens=32, ignore_eos=True)
acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
for name, cfg in (("adaptive", {}), ("g4", dict(adaptive=False)), ("ar", dict(method="autoregressive"))):
    e = SpecEngine(pair, EngineConfig(batch_size=32, **cfg))
    e.generate(texts, params)
    e.generate(texts, params)
    with profile(activities=acts, with_stack=True) as p:
        e.generate(texts, params)
    ka = p.key_averages()
    print("=====", name, "by self device time", flush=True)
    print(ka.table(sort_by="self_device_time_total" if len(acts) > 1 else "self_cpu_time_total", row_limit=14,
                   max_name_column_width=60))
    print("=====", name, "by self cpu time", flush=True)
    print(ka.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))
    if name == "adaptive":
        kb = p.key_averages(group_by_stack_n=6)
        print(kb.table(sort_by="self_cpu_time_total", row_limit=6, max_name_column_width=60,
                       max_src_column_width=100))
