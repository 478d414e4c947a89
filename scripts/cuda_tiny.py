"""A minute's check of the EAGLE path on a device before a lease's long steps: a tiny random Llama
and a random EAGLE-3 head (a reduced vocabulary), greedy output of eqspec and exspec at 1, 3 and 8
rows against the target's own greedy decoding, in float32, adaptive and fixed γ; then one sampled
and one bfloat16 run for crashes only. Prints one line per cell and "tiny: ok" or the failures.

Usage: PYTHONPATH=.:tests python scripts/cuda_tiny.py [DEVICE]     (cpu to check it here first)"""
import sys
import tempfile

import torch
from tiny import make_model, prompts

from batchspec import EngineConfig, ModelPair, SamplingParams, SpecEngine
from batchspec.eagle.formats import save_head
from batchspec.eagle.head import new_head

device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
target = make_model("llama", 64, 2, seed=0).to(device)
pair = ModelPair(target, None, None, 256, ())
ids = prompts(12)
greedy = SamplingParams(max_new_tokens=12)
plain = SpecEngine(pair, EngineConfig(method="autoregressive", batch_size=1))
refs = [plain.generate([p], greedy)[0].token_ids for p in ids]
failed = []
with tempfile.TemporaryDirectory() as folder:
    save_head(new_head(target.cpu(), "eagle3", draft_vocab=200, seed=3), folder)
    target.to(device)
    for method in ("eqspec", "exspec"):
        for rows in (1, 3, 8):
            for adaptive in (False, True):
                engine = SpecEngine(pair, EngineConfig(method=method, batch_size=rows, gamma=3, adaptive=adaptive,
                                                       drafter=f"eagle:{folder}", debug=True))
                outs = [o.token_ids for o in engine.generate(ids, greedy)]
                same = sum(a == b for a, b in zip(outs, refs))
                print(f"{method} rows {rows} adaptive {adaptive}: {same}/{len(refs)} equal, "
                      f"drafted {engine.last_run.drafted}", flush=True)
                if same != len(refs):
                    failed.append((method, rows, adaptive))
    engine = SpecEngine(pair, EngineConfig(batch_size=4, gamma=3, drafter=f"eagle:{folder}"))
    engine.generate(ids, SamplingParams(max_new_tokens=12, temperature=0.8, seed=1))
    pair16 = ModelPair(make_model("llama", 64, 2, seed=0, dtype=torch.bfloat16).to(device), None, None, 256, ())
    SpecEngine(pair16, EngineConfig(batch_size=4, gamma=3, drafter=f"eagle:{folder}")).generate(ids, greedy)
print("tiny: ok" if not failed else f"tiny: FAILED {failed}")
