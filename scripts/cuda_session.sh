#!/usr/bin/env bash
# The CUDA measurements docs/gpu.md still lacks, sized for a lent GPU machine: each step has its
# own time limit, 570 s in all, inside the device tool's 600 s a call. Runs with the
# machine's own python3 and packages (torch, transformers, typer, rich: no install), from the
# repository root:  OUT=<folder for results> bash scripts/cuda_session.sh
#   1. verify in float32, autoregressive included (bfloat16 rounds with the batch's shape: docs/gpu.md);
#   2. bench on a fresh workload: the drafter forgets between runs, the whole workload warms up,
#      --twin gives the noise floor, fixed γ 4 beside the adaptive default and the HF peers;
#   3. the model-free drafters and the draft model on the repetitive workload (the drafters' table);
#   4. the default step-paired with autoregressive and with itself without fused prefill
#      (scripts/cuda_ab.py: the prompts prefilled inside the round's pass, never run on a GPU before);
#   5. the adaptive policy's profile and decisions (scripts/cuda_policy.py).
# DEVICE=cpu SMOKE=1 runs every step on a CPU with tiny sizes, to check the commands before a lease.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT="${OUT:-cuda_out}"
DEVICE="${DEVICE:-cuda}"
mkdir -p "$OUT"
if [[ "${SMOKE:-}" ]]; then n8=2 n16=2 n64=4 new=4 rep=1 bsl=4; else n8=8 n16=16 n64=64 new=32 rep=3 bsl=32,64; fi
bs=(python3 -c 'import sys; from batchspec.cli import app; sys.argv[0] = "batchspec"; app()')
common=(--device "$DEVICE" --num-prompts $n16 --max-new-tokens $new --hf-check 2 --methods autoregressive,eqspec,exspec
        --batch-sizes 1,8,32)
step() {  # step SECONDS NAME command...: run with a limit, output appended to $OUT/session.log
  local limit=$1 name=$2; shift 2   # (one log: the device tool returns at most 8 files)
  echo "=== $name (limit ${limit}s, at ${SECONDS}s)" | tee -a "$OUT/session.log"
  timeout "$limit" "$@" 2>&1 | grep -v "Loading weights" | tee -a "$OUT/session.log" | tail -25
}
nvidia-smi -L
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
step 80 verify_fp32 "${bs[@]}" verify "${common[@]}" --dtype float32 --json "$OUT/verify_fp32.json"
step 130 bench_small "${bs[@]}" bench --device "$DEVICE" --methods autoregressive,eqspec --batch-sizes 1,8 --gamma 4 \
  --adaptive off,on --peers hf --twin --num-prompts $n8 --max-new-tokens $new --repeat 2 --json "$OUT/bench_small.json"
step 130 bench_large "${bs[@]}" bench --device "$DEVICE" --methods autoregressive,eqspec --batch-sizes $bsl --gamma 4 \
  --adaptive off,on --peers hf --twin --num-prompts $n64 --max-new-tokens $new --repeat $rep --json "$OUT/bench_large.json"
step 110 drafters_echo "${bs[@]}" bench --device "$DEVICE" --methods autoregressive,eqspec --batch-sizes 1,8 --gamma 4 \
  --drafters draft_model,ngram,suffix,hybrid --adaptive on --workload echo --num-prompts $n16 --max-new-tokens $new \
  --repeat $rep --json "$OUT/drafters_echo.json"
step 90 fuse_ab python3 scripts/cuda_ab.py "$DEVICE" $n64 $new 2 ${bsl/#/8,} fuse_prefill=false
step 30 policy python3 scripts/cuda_policy.py "$DEVICE" $n64 $new
echo "=== done at ${SECONDS}s" | tee -a "$OUT/session.log"
