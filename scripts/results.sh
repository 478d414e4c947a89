#!/usr/bin/env bash
# Regenerate docs/results/: the JSON behind README.md's results table, one command per row group.
#
#   bash scripts/results.sh [bundled|smollm2|all]      # default: all
#
# Sourcing this file defines the functions below and runs nothing. The commands are the ones the
# README's table shows, character for character; change both together. Timings are side by side
# within a run (bench's step pairing), but run nothing else on the machine meanwhile.
# On a 2-core CPU: bundled about an hour, smollm2 about an hour, once SmolLM2 is fetched
# (`batchspec models fetch smollm2-135m`).

# The bundled pair (batchspec/assets/default_pair): exactness; the default against every fixed γ and plain
# decoding at 1, 8, 32 rows, and against plain decoding at 2, 4, 16, 64 rows, with the twin; the policy on
# the recorded traces and walks (tests/traces/, tests/walks/, made by `batchspec trace record [--walk]`, see
# docs/scheduling.md); the
# default against transformers, on `generate`'s own workload, and the drafters on `echo`.
results_bundled() {
  batchspec verify --methods autoregressive,eqspec,exspec --batch-sizes 1,8,32 --num-prompts 32 --max-new-tokens 64 \
    --json docs/results/bundled_verify.json
  batchspec bench --methods autoregressive,eqspec --batch-sizes 1,8,32 --gamma 1,2,4 --drafters hybrid \
    --adaptive off,on --twin --num-prompts 64 --max-new-tokens 32 --repeat 3 --json docs/results/bundled_bench.json
  batchspec bench --methods autoregressive,eqspec --batch-sizes 2,4,16,64 --twin --num-prompts 64 \
    --max-new-tokens 32 --repeat 3 --json docs/results/bundled_sweep.json
  batchspec trace replay tests/traces/bundled_b1.json tests/traces/bundled_b8.json tests/traces/bundled_b32.json
  batchspec trace replay tests/walks/bundled_b1.json tests/walks/bundled_b8.json tests/walks/bundled_b32.json
  for B in 1 8 32; do
    batchspec bench --methods autoregressive,eqspec --batch-sizes "$B" --gamma 2,4 --drafters hybrid --adaptive off,on \
      --peers hf --twin --num-prompts 64 --max-new-tokens 32 --repeat 5 --json "docs/results/bundled_bench_b$B.json"
  done
  batchspec bench --methods autoregressive,eqspec --batch-sizes 8 --gamma 4 --drafters hybrid --adaptive off,on \
    --twin --num-prompts 8 --max-new-tokens 128 --repeat 5 --json docs/results/bundled_generate.json
  batchspec bench --methods autoregressive,eqspec --batch-sizes 1,8,32 --drafters draft_model,ngram,suffix,hybrid \
    --adaptive on --twin --num-prompts 24 --max-new-tokens 64 --repeat 3 --gamma 8 --workload echo \
    --json docs/results/bundled_drafters_echo.json
}

# SmolLM2-135M-Instruct alone (no draft model: the default drafter is its suffix lookup and the EAGLE head
# batchspec ships, batchspec/assets/heads/smollm2-135m, trained on none of these prompts), prompts through its
# chat template: exactness with the head; the default and the head alone (fixed γ = 4 and adaptive) against
# plain decoding at 1 and 8 rows, the default at 2, 4 and 16 rows, and at 32 and 64 rows (the chat and grounded
# sets together: 64 prompts), with the twin; the policy on the recorded traces and walks; plain decoding against transformers; the
# model-free drafters on the grounded set.
results_smollm2() {
  batchspec verify --target smollm2-135m --chat --prompts chat --methods autoregressive,eqspec,exspec \
    --batch-sizes 1,8,32 --drafter eagle --num-prompts 32 --max-new-tokens 32 --json docs/results/smollm2_verify_eagle.json
  batchspec bench --target smollm2-135m --chat --prompts chat --methods autoregressive,eqspec --batch-sizes 1,8 \
    --drafters hybrid,eagle,suffix --gamma 4 --adaptive off,on --siblings 3,0 --twin --num-prompts 16 --max-new-tokens 32 --repeat 2 \
    --json docs/results/smollm2_bench.json
  local mixed="${TMPDIR:-/tmp}/batchspec_chat_grounded.jsonl"
  cat batchspec/assets/chat.jsonl batchspec/assets/grounded.jsonl > "$mixed"
  batchspec bench --target smollm2-135m --chat --prompts "$mixed" --methods autoregressive,eqspec --batch-sizes 32,64 \
    --twin --num-prompts 64 --max-new-tokens 32 --repeat 2 --json docs/results/smollm2_default_large.json
  batchspec bench --target smollm2-135m --chat --prompts chat --methods autoregressive,eqspec --batch-sizes 2,4,16 \
    --twin --num-prompts 32 --max-new-tokens 32 --repeat 2 --json docs/results/smollm2_sweep.json
  # (the README's Xeon row: the same command on such a machine)
  batchspec bench --target smollm2-135m --chat --prompts chat --methods autoregressive,eqspec \
    --batch-sizes 1,2,4,8,16,32 --twin --num-prompts 32 --max-new-tokens 32 --repeat 2 \
    --json docs/results/smollm2_sweep_xeon.json
  batchspec trace replay tests/traces/smollm2_b1.json tests/traces/smollm2_b8.json tests/traces/smollm2_b32.json
  batchspec trace replay tests/walks/smollm2_b1.json tests/walks/smollm2_b4.json tests/walks/smollm2_b8.json tests/walks/smollm2_b32.json
  batchspec bench --target smollm2-135m --chat --prompts chat --methods autoregressive,eqspec --peers hf --twin \
    --batch-sizes 1,8,32 --num-prompts 32 --max-new-tokens 32 --repeat 2 --json docs/results/smollm2_default.json
  batchspec bench --target smollm2-135m --chat --prompts grounded --methods autoregressive,eqspec \
    --drafters ngram,suffix,hybrid --batch-sizes 1,8 --twin --num-prompts 16 --max-new-tokens 48 --repeat 2 \
    --json docs/results/smollm2_drafters_grounded.json
}

results_main() {
  local which="${1:-all}"
  case "$which" in
    bundled|smollm2|all) ;;
    *) echo "usage: bash scripts/results.sh [bundled|smollm2|all] (got '$which')" >&2; return 2 ;;
  esac
  source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
  cd "$ROOT"
  mkdir -p docs/results
  if [[ "$which" == bundled || "$which" == all ]]; then results_bundled; fi
  if [[ "$which" == smollm2 || "$which" == all ]]; then results_smollm2; fi
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  set -euo pipefail
  results_main "$@"
fi
