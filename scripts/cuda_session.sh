#!/usr/bin/env bash
# The CUDA measurements docs/cuda.md still lacks, sized for a lent GPU machine: each step has its
# own time limit, 550 s in all, inside the device tool's 600 s a call. Runs with the
# machine's own python3 and packages (torch, transformers, typer, rich: no install), from the
# repository root:  OUT=<folder for results> bash scripts/cuda_session.sh
#   1. verify in float32 and bfloat16, autoregressive included (the divergence note tells rounding);
#   2. bench on a fresh workload: the drafter forgets between runs, the whole workload warms up,
#      --twin gives the noise floor, fixed γ 4 beside the adaptive default and the HF peers;
#   3. the adaptive policy's profile and decisions (scripts/cuda_policy.py).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT="${OUT:-cuda_out}"
mkdir -p "$OUT"
bs=(python3 -c 'import sys; from batchspec.cli import app; sys.argv[0] = "batchspec"; app()')
common=(--device cuda --num-prompts 16 --max-new-tokens 48 --hf-check 2 --methods autoregressive,eqspec,exspec
        --batch-sizes 1,8,32)
step() {  # step SECONDS NAME command...: run with a limit, output to $OUT/NAME.log
  local limit=$1 name=$2; shift 2
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | grep -v "Loading weights" | tee "$OUT/$name.log" | tail -25
}
nvidia-smi -L
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
step 90 verify_fp32 "${bs[@]}" verify "${common[@]}" --dtype float32 --json "$OUT/verify_fp32.json"
step 90 verify_bf16 "${bs[@]}" verify "${common[@]}" --dtype bfloat16 --json "$OUT/verify_bf16.json"
step 180 bench_small "${bs[@]}" bench --device cuda --methods autoregressive,eqspec --batch-sizes 1,8 --gamma 4 \
  --adaptive off,on --peers hf --twin --num-prompts 16 --max-new-tokens 32 --repeat 3 --json "$OUT/bench_small.json"
step 140 bench_large "${bs[@]}" bench --device cuda --methods autoregressive,eqspec --batch-sizes 32,64 --gamma 4 \
  --adaptive off,on --peers hf --twin --num-prompts 64 --max-new-tokens 32 --repeat 3 --json "$OUT/bench_large.json"
step 50 policy python3 scripts/cuda_policy.py cuda
