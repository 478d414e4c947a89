#!/usr/bin/env bash
# Regenerate the README's results (bundled pair, this machine): verify tables, the benchmark with
# the Hugging Face peers, and the EXSPEC study. Writes docs/results/*.json and docs/*.png.
# Takes about 30 minutes on a 2-core CPU; run nothing else meanwhile (timings are side by side).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
mkdir -p docs/results

batchspec bench --methods autoregressive,eqspec,exspec --batch-sizes 1,4,8,16,32 --gamma 3 --peers hf \
  --num-prompts 32 --max-new-tokens 64 --repeat 2 --json docs/results/bench.json --plots docs

batchspec verify --methods autoregressive,eqspec,exspec --batch-sizes 1,2,8,32 --gamma 3 \
  --num-prompts 32 --max-new-tokens 64 --json docs/results/verify.json
batchspec verify --temperature 1.0 --methods eqspec --batch-sizes 8 --gamma 3 --num-prompts 2 --samples 1500 \
  --json docs/results/verify_sampling.json

batchspec bench --methods eqspec,exspec --window 1x,4x --batch-sizes 4,8,16,32 --gamma 3 \
  --num-prompts 64 --max-new-tokens 64 --json docs/results/exspec_bundled.json
batchspec bench --methods eqspec,exspec --window 1x,4x --batch-sizes 4,8,16,32 --gamma 3 \
  --num-prompts 64 --max-new-tokens 64 --prompt-tokens 32 --json docs/results/exspec_same_length.json

# Smaller γ at batch 8, where γ = 3 is past the analytic limit on this CPU.
batchspec bench --methods autoregressive,eqspec,exspec --batch-sizes 8 --gamma 1,2 --peers hf \
  --num-prompts 32 --max-new-tokens 64 --repeat 2 --json docs/results/bench_bs8_gamma.json
