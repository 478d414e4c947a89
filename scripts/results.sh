#!/usr/bin/env bash
# Regenerate the README's results (bundled pair, this machine): verify tables, the benchmark with
# the Hugging Face peers, and the EXSPEC study. Writes docs/results/*.json and docs/*.png.
# Takes about 40 minutes on a 2-core CPU; run nothing else meanwhile (timings are side by side).
# Since wave 8 `bench` is adaptive unless told `--adaptive off`: the commands of earlier waves that
# name no --adaptive measured fixed γ then, and measure the adaptive policy now.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
mkdir -p docs/results

batchspec bench --methods autoregressive,eqspec,exspec --batch-sizes 1,4,8,16,32 --gamma 3 --peers hf \
  --num-prompts 32 --max-new-tokens 64 --repeat 2 --json docs/results/bench.json --plots docs

# The peer table (batch sizes 1, 8, 32) once more with three interleaved repeats.
batchspec bench --methods autoregressive,eqspec,exspec --batch-sizes 1,8,32 --gamma 3 --peers hf \
  --num-prompts 32 --max-new-tokens 64 --repeat 3 --json docs/results/bench_peers.json

# The same methods through the transformers modules (--forward hf) beside batchspec's lean forward.
batchspec bench --methods autoregressive,eqspec,exspec --batch-sizes 1,8 --gamma 3 --forward auto,hf --peers hf \
  --num-prompts 32 --max-new-tokens 64 --repeat 2 --json docs/results/bench_forward.json

batchspec verify --methods autoregressive,eqspec,exspec --batch-sizes 1,2,8,32 --gamma 3 \
  --num-prompts 32 --max-new-tokens 64 --json docs/results/verify.json
batchspec verify --temperature 1.0 --methods eqspec --batch-sizes 8 --gamma 3 --num-prompts 2 --samples 1500 \
  --json docs/results/verify_sampling.json

batchspec bench --methods eqspec,exspec --window 1x,4x --batch-sizes 4,8,16,32 --gamma 3 \
  --num-prompts 64 --max-new-tokens 64 --json docs/results/exspec_bundled.json
batchspec bench --methods eqspec,exspec --window 1x,4x --batch-sizes 4,8,16,32 --gamma 3 \
  --num-prompts 64 --max-new-tokens 64 --prompt-tokens 32 --json docs/results/exspec_same_length.json

# Other γ at batch 8.
batchspec bench --methods autoregressive,eqspec,exspec --batch-sizes 8 --gamma 2,4 --peers hf \
  --num-prompts 32 --max-new-tokens 64 --repeat 2 --json docs/results/bench_bs8_gamma.json

# Adaptive against fixed γ, the default drafter, with the peers (wave 4), then every fixed γ.
batchspec bench --methods autoregressive,eqspec --batch-sizes 1,2,4,8,16,32,64 --gamma 4 --drafters hybrid \
  --adaptive off,on --peers hf --num-prompts 64 --max-new-tokens 32 --repeat 2 --json docs/results/wave4_adaptive.json
batchspec bench --methods autoregressive,eqspec --batch-sizes 1,2,4,8,16,32,64 --gamma 1,2,3,4 --drafters hybrid \
  --adaptive off,on --num-prompts 64 --max-new-tokens 32 --repeat 2 --json docs/results/wave4_gamma.json
batchspec bench --methods autoregressive,eqspec --batch-sizes 1,8,32 --gamma 8 --drafters draft_model,ngram,suffix,hybrid \
  --workload echo --num-prompts 24 --max-new-tokens 64 --repeat 2 --json docs/results/wave4_drafters_echo.json
batchspec verify --methods autoregressive,eqspec,exspec --batch-sizes 1,2,8,32 --num-prompts 32 --max-new-tokens 64 \
  --json docs/results/verify_wave4.json

# Wave 5: adaptive against fixed γ 2 and 4 with the peers; the drafters on three workloads (hybrid on suffix).
batchspec bench --methods autoregressive,eqspec --batch-sizes 1,2,4,8,16,32,64 --gamma 2,4 --drafters hybrid \
  --adaptive off,on --peers hf --num-prompts 64 --max-new-tokens 32 --repeat 5 --json docs/results/wave5_adaptive.json
for w in echo twice plain; do
  g=8; [ "$w" = plain ] && g=4
  batchspec bench --methods autoregressive,eqspec --batch-sizes 1,8,32 --drafters draft_model,ngram,suffix,hybrid \
    --adaptive off,on --num-prompts 24 --max-new-tokens 64 --repeat 2 --gamma "$g" --workload "$w" \
    --json "docs/results/wave5_drafters_$w.json"
done
batchspec verify --methods autoregressive,eqspec,exspec --batch-sizes 1,2,8,32 --num-prompts 32 --max-new-tokens 64 \
  --json docs/results/verify_wave5.json
SERVERS="ar spec adaptive hf" ./scripts/serve_bench.sh docs/results/serve_wave5
# Wave 5, again: the serving table over three runs (medians).
SERVERS="ar spec hf" REPEAT=3 ./scripts/serve_bench.sh docs/results/serve_wave5_r3
# Wave 6: the adaptive policy after the hybrid's lookahead and the gain scale (wave6_adaptive.json was run
# with --repeat 3 one commit before the final code).
batchspec bench --methods autoregressive,eqspec --batch-sizes 1,2,4,8,16,32,64 --gamma 2,4 --drafters hybrid \
  --adaptive off,on --peers hf --num-prompts 64 --max-new-tokens 32 --repeat 2 --json docs/results/wave6_adaptive_final.json
for w in plain echo twice; do
  g=8; [ "$w" = plain ] && g=4
  batchspec bench --methods autoregressive,eqspec --batch-sizes 1,8,32 --drafters ngram,suffix,hybrid \
    --adaptive on --num-prompts 24 --max-new-tokens 64 --repeat 3 --gamma "$g" --workload "$w" \
    --json "docs/results/wave6_adaptive_$w.json"
done
# From wave 7 on, each wave measures issue 19's table and issue 20's echo cells with the same commands:
adaptive_table() {  # NAME -> docs/results/NAME_adaptive.json
  batchspec bench --methods autoregressive,eqspec --batch-sizes 1,2,4,8,16,32,64 --gamma 2,4 --drafters hybrid \
    --adaptive off,on --peers hf --num-prompts 64 --max-new-tokens 32 --repeat 3 --json "docs/results/$1_adaptive.json"
}
echo_cells() {  # NAME -> docs/results/NAME_adaptive_echo.json
  batchspec bench --methods autoregressive,eqspec --batch-sizes 1,8,32 --drafters ngram,suffix,hybrid \
    --adaptive on --num-prompts 24 --max-new-tokens 64 --repeat 3 --gamma 8 --workload echo \
    --json "docs/results/$1_adaptive_echo.json"
}
all_drafters() {  # NAME REPEATS -> docs/results/NAME_adaptive_{echo,plain}.json
  for w in echo plain; do
    g=8; [ "$w" = plain ] && g=4
    batchspec bench --methods autoregressive,eqspec --batch-sizes 1,8,32 --drafters draft_model,ngram,suffix,hybrid \
      --adaptive on --num-prompts 24 --max-new-tokens 64 --repeat "$2" --gamma "$g" --workload "$w" \
      --json "docs/results/$1_adaptive_$w.json"
  done
}
# Wave 7: the hybrid's gate weighs the model against the rounds it replaces; speed-ups paired per repeat.
for w in plain twice; do
  g=8; [ "$w" = plain ] && g=4
  batchspec bench --methods autoregressive,eqspec --batch-sizes 1,8,32 --drafters draft_model,suffix,hybrid \
    --gamma "$g" --workload "$w" --num-prompts 24 --max-new-tokens 64 --repeat 3 --adaptive off \
    --json "docs/results/wave7_hybrid_$w.json"
done
adaptive_table wave7
echo_cells wave7
# Wave 8: a lookup's catch-up left out of what the policy measures, ragged passes priced by their
# longest row; adaptive becomes the default (commands above that do not name --adaptive measured
# fixed γ: add --adaptive off to reproduce them).
adaptive_table wave8
echo_cells wave8
batchspec bench --methods autoregressive,eqspec --batch-sizes 1 --gamma 4 --drafters hybrid --adaptive off,on \
  --num-prompts 64 --max-new-tokens 32 --repeat 5 --json docs/results/wave8_adaptive_bs1.json
# Wave 9 (an Intel Xeon): the lean forward's kernel measured per CPU; plain plans kept only as long
# as replanning costs; the guard's first measurements against a prior; rows cut short between draft steps.
adaptive_table wave9
echo_cells wave9
# Wave 10 (the Xeon): a draft model's catch-up shared by the rounds it will draft.
adaptive_table wave10
all_drafters wave10 3
# Wave 11 (the AMD EPYC): kernels timed over every matrix, speculative rounds charged their replanning,
# serve's rounds on the main thread.
adaptive_table wave11
echo_cells wave11
SERVERS="ar spec hf" REPEAT=2 ./scripts/serve_bench.sh docs/results/serve_wave11
# Wave 12 (the AMD EPYC): the kernel timed at every token count up to 12, a lookup's indexing priced.
adaptive_table wave12
echo_cells wave12
# Wave 13 (the AMD EPYC): a linear over n tokens may run over more rows where the CPU's BLAS is
# faster at the larger count; the serving table's cells at concurrency 8 and 32 at least 64 requests.
SERVERS="ar spec hf" REPEAT=2 ./scripts/serve_bench.sh docs/results/serve_wave13
SERVERS="ar spec hf" CONCURRENCIES=8 ./scripts/serve_bench.sh docs/results/serve_wave13_c8
adaptive_table wave13
echo_cells wave13
# Wave 14: counts above 32 tokens planned too (a ladder 40..256, core/kernels.py).
adaptive_table wave14
echo_cells wave14
# From wave 15 on: the same table with five repeats, and every drafter on both workloads.
adaptive_five() {  # NAME -> docs/results/NAME_adaptive.json
  batchspec bench --methods autoregressive,eqspec --batch-sizes 1,2,4,8,16,32,64 --gamma 2,4 --drafters hybrid \
    --adaptive off,on --peers hf --num-prompts 64 --max-new-tokens 32 --repeat 5 --json "docs/results/$1_adaptive.json"
}
five_repeats() {  # NAME -> docs/results/NAME_adaptive{,_echo,_plain}.json
  adaptive_five "$1"
  all_drafters "$1" 5
}
# Wave 15: the hybrid's gate charged its share of the draft model's catch-ups.
five_repeats wave15
# Wave 16: prefill chunks attend row by row; verify costs learnt per batch size and depth.
five_repeats wave16
# Wave 17: a depth's verify scale relative to the shared one; profiles keep the fastest repeat.
five_repeats wave17
# Wave 18: a row that would leave its cohort while requests wait is charged its share of a prefill
# forward (issue 19's table first, the drafter tables on the same code in the session after).
adaptive_five wave18
all_drafters wave18 5
# From wave 19 on, with a second autoregressive engine per batch size (`--twin`): its ratio to the
# first is the run's noise floor. issue19_twin WAVE: issue 19's table; drafters_twin WAVE: issue 20's.
issue19_twin() {
  batchspec bench --methods autoregressive,eqspec --batch-sizes 1,2,4,8,16,32,64 --gamma 2,4 --drafters hybrid \
    --adaptive off,on --peers hf --twin --num-prompts 64 --max-new-tokens 32 --repeat 5 \
    --json "docs/results/$1_adaptive.json"
}
issue19_at() {  # SIZES NAME: issue 19's command at the batch sizes SIZES, into docs/results/NAME.json
  batchspec bench --methods autoregressive,eqspec --batch-sizes "$1" --gamma 2,4 --drafters hybrid \
    --adaptive off,on --peers hf --twin --num-prompts 64 --max-new-tokens 32 --repeat 5 \
    --json "docs/results/$2.json"
}
issue19_8to64() {  # issue 19's command at batch 8-64 only, into docs/results/$1.json
  issue19_at 8,16,32,64 "$1"
}
drafters_twin() {
  for w in echo plain; do
    g=8; [ "$w" = plain ] && g=4
    batchspec bench --methods autoregressive,eqspec --batch-sizes 1,8,32 --drafters draft_model,ngram,suffix,hybrid \
      --adaptive on --twin --num-prompts 24 --max-new-tokens 64 --repeat 5 --gamma "$g" --workload "$w" \
      --json "docs/results/$1_adaptive_$w.json"
  done
}
# Wave 19: the same code, issue 19's table again with the twin.
issue19_twin wave19
# Wave 20: bench's peak memory from the kernel's high-water mark (no sampling thread beside the timed
# code); the drafter tables again, then issue 19's table on the same code and day.
drafters_twin wave20
issue19_twin wave20
# Wave 21: the same engine; bench reports each speculative cell's round gain (its rounds that
# verified drafts against the plain rounds of the same batch sizes in the same run).
drafters_twin wave21
issue19_twin wave21
# Wave 22: the same engine; bench now runs the engines of a batch size together, a round each in
# turn (--pairing steps, the default), so the machine's drift falls on every side of a ratio alike.
issue19_twin wave22
drafters_twin wave22
# Wave 23: ModelGate measures both sides in turn before comparing them (the hybrid only): issue 19's
# table again, and the drafter table's suffix and hybrid rows.
issue19_twin wave23
for w in echo plain; do
  g=8; [ "$w" = plain ] && g=4
  batchspec bench --methods autoregressive,eqspec --batch-sizes 1,8,32 --drafters suffix,hybrid \
    --adaptive on --twin --num-prompts 24 --max-new-tokens 64 --repeat 5 --gamma "$g" --workload "$w" \
    --json "docs/results/wave23_adaptive_$w.json"
done
# `batchspec generate`'s own workload as a bench table (waves 22 and 23: wave22_default.json, wave23_default.json)
batchspec bench --methods autoregressive,eqspec --batch-sizes 8 --gamma 4 --drafters hybrid --adaptive off,on --twin \
  --num-prompts 8 --max-new-tokens 128 --repeat 5 --json docs/results/wave23_default.json
# Wave 24: settled plain plans, transposed views in the lean forward, suffix proposals matched again
# (k 16): issue 19's table, the drafter tables (the draft_model rows again in a run of their own, after
# the draft prefill's record counted rows), batch 1 on echo with γ ≤ 16, generate's workload, verify.
issue19_twin wave24
drafters_twin wave24
for w in echo plain; do
  g=8; [ "$w" = plain ] && g=4
  batchspec bench --methods autoregressive,eqspec --batch-sizes 1,8,32 --drafters draft_model \
    --adaptive on --twin --num-prompts 24 --max-new-tokens 64 --repeat 5 --gamma "$g" --workload "$w" \
    --json "docs/results/wave24_adaptive_${w}_draft_model.json"
done
batchspec bench --methods autoregressive,eqspec --batch-sizes 1 --drafters ngram,suffix,hybrid \
  --adaptive on --twin --num-prompts 24 --max-new-tokens 64 --repeat 5 --gamma 16 --workload echo \
  --json docs/results/wave24_adaptive_echo_g16.json
batchspec bench --methods autoregressive,eqspec --batch-sizes 8 --gamma 4 --drafters hybrid --adaptive off,on --twin \
  --num-prompts 8 --max-new-tokens 128 --repeat 5 --json docs/results/wave24_default.json
batchspec verify --methods autoregressive,eqspec,exspec --batch-sizes 1,2,8,32 --num-prompts 32 --max-new-tokens 64 \
  --json docs/results/verify_wave24.json
# Wave 25: docs/results/wave25_adaptive_rateguard.json is issue 19's table (`issue19_twin`) measured on
# commit f7492fb (a guard on the rate the plan promised), reverted by a8e5459 (README, "Where the
# draft model loses"); it is evidence for that decision, not a table of the current code, so it is not
# regenerated here.
# Wave 25: a request's drafts after the first priced by its own record (later_factors): issue 19's table at
# batch 1-8, and the draft model alone on echo at 8 and 32.
batchspec bench --methods autoregressive,eqspec --batch-sizes 1,2,4,8 --gamma 2,4 --drafters hybrid \
  --adaptive off,on --peers hf --twin --num-prompts 64 --max-new-tokens 32 --repeat 5 \
  --json docs/results/wave25_adaptive_1to8.json
batchspec bench --methods autoregressive,eqspec --batch-sizes 8,32 --drafters draft_model \
  --adaptive on --twin --num-prompts 24 --max-new-tokens 64 --repeat 5 --gamma 8 --workload echo \
  --json docs/results/wave25_adaptive_echo_draft_model.json
# Wave 26: the draft model prefills new requests only where a fresh plan would draft too
# (AdaptivePolicy.speculates): the draft model alone on echo at 8 and 32, issue 19's table at 16-64
# (with wave 25's later_factors), and the drafter tables.
batchspec bench --methods autoregressive,eqspec --batch-sizes 8,32 --drafters draft_model \
  --adaptive on --twin --num-prompts 24 --max-new-tokens 64 --repeat 5 --gamma 8 --workload echo \
  --json docs/results/wave26_adaptive_echo_draft_model.json
batchspec bench --methods autoregressive,eqspec --batch-sizes 16,32,64 --gamma 2,4 --drafters hybrid \
  --adaptive off,on --peers hf --twin --num-prompts 64 --max-new-tokens 32 --repeat 5 \
  --json docs/results/wave26_adaptive_16to64.json
drafters_twin wave26
# Wave 26, then: a lookup's indexing shared over the rounds likely to draft (AdaptivePolicy.index_share),
# issue 19's table at 8-64 on that code (the drafter tables above were measured before it, on 2ea95b8).
issue19_8to64 wave26_adaptive_index_share
# Wave 27: docs/results/wave27_catchup_{echo,plain}.json are the drafter tables (`drafters_twin`) measured on
# commit 115a08e (the draft model's catch-up priced by the drafting record), reverted by f258120 (README,
# "Wave 27"); evidence for that decision, not tables of the current code, so not regenerated here.
# Wave 27: the suffix trie's faster indexing (1290d55): the drafter tables and issue 19's table at 8-64.
drafters_twin wave27
issue19_8to64 wave27_adaptive_8to64
# Wave 28: the kernel plan times the count after each step of its ladder (core/kernels.py): the drafter
# tables and issue 19's table at 8-64 on the profile measured again with the new plan.
drafters_twin wave28
issue19_8to64 wave28_adaptive_8to64
# Wave 28, then: the step-cost profile timed in sweeps (bench/costs.py `fastest`): the drafter tables and
# issue 19's table at 8-64 on the final code.
drafters_twin wave28_final
issue19_8to64 wave28_final_adaptive_8to64
batchspec verify --methods autoregressive,eqspec,exspec --batch-sizes 1,8,32 --num-prompts 32 --max-new-tokens 64 \
  --json docs/results/verify_wave28.json
verify_exact() {  # exactness at 1, 8 and 32 for every method, into docs/results/$1.json
  batchspec verify --methods autoregressive,eqspec,exspec --batch-sizes 1,8,32 --num-prompts 32 --max-new-tokens 64 \
    --json "docs/results/$1.json"
}
# Wave 29: prompts fed from column 0 attend causally in the padded layout (c10b23f): the drafter tables,
# issue 19's table at 8-64 and verify on that code; then the same after verify passes over rows of unequal
# width attend row by row (the final code).
drafters_twin wave29
issue19_8to64 wave29_adaptive_8to64
verify_exact verify_wave29
drafters_twin wave29_final
issue19_8to64 wave29_final_adaptive_8to64
verify_exact verify_wave29_final
# Wave 30: measured on 184cbe0 (a draft depth not yet measured at a batch size borrowed the relative scale of
# the deepest shallower depth measured there), reverted by 4119280 (docs/drafters.md, "Wave 30"): evidence for
# that decision, not tables of the current code, so not regenerated here:
#   drafters_twin wave30; issue19_8to64 wave30_adaptive_8to64; verify_exact verify_wave30; and issue 19's
#   command at --batch-sizes 1,2,4 into wave30_adaptive_1to4.json.
# Then issue 19's command at batch 2 and 4 on the reverted (current) code:
batchspec bench --methods autoregressive,eqspec --batch-sizes 2,4 --gamma 2,4 --drafters hybrid \
  --adaptive off,on --peers hf --twin --num-prompts 64 --max-new-tokens 32 --repeat 5 \
  --json docs/results/wave30_reverted_2to4.json
# Wave 31: a lookup's shared index priced at a round's intake, gain_scale over ~100 speculative rounds (15dbc81):
# issue 19's command at 1, 2, 4 and at 8-64, the drafter tables, verify; on a GPU scripts/cuda_session.sh
# (docs/results/cuda_h100_wave31/).
issue19_at 1,2,4 wave31_adaptive_1to4
issue19_8to64 wave31_adaptive_8to64
drafters_twin wave31
verify_exact verify_wave31
# Wave 32: prompts prefilled inside the round's target pass (`EngineConfig.fuse_prefill`, 1f015fa..) and a
# round carrying one plain without a plan after a plain round (5a6733e); measured on the Intel Xeon:
issue19_8to64 wave32_adaptive_8to64
issue19_at 1,2,4 wave32_adaptive_1to4
drafters_twin wave32
verify_exact verify_wave32
# Wave 33: a hybrid's lookup drafts judged by their own acceptance record and each copy's match
# confidence (641c00f); measured on the Intel Xeon:
issue19_8to64 wave33_adaptive_8to64
issue19_at 1,2,4 wave33_adaptive_1to4
drafters_twin wave33
verify_exact verify_wave33
# ... and batch 1 alone on the final code (e877100):
issue19_at 1 wave33_adaptive_1_final
# Wave 34: rounds at a standing length where a plan costs more than it earns (sched/standing.py);
# measured on the Intel Xeon:
issue19_at 1,2,4 wave34_adaptive_1to4
issue19_8to64 wave34_adaptive_8to64
drafters_twin wave34
verify_exact verify_wave34
# ... and batch 1 alone on the final code (09f396f):
issue19_at 1 wave34_adaptive_1_final
# Wave 35: a hybrid's rows stand at one length per source (its lookup's, its draft model's);
# measured on the Intel Xeon:
drafters_twin wave35
issue19_8to64 wave35_adaptive_8to64
issue19_at 1,2,4 wave35_adaptive_1to4
verify_exact verify_wave35
# ... and batch 8-64 a second time, on the same code:
issue19_8to64 wave35_adaptive_8to64_second
# Wave 36: a hybrid's lookahead priced when the policy asks whether to look up (cfe383b); measured on
# the Intel Xeon:
issue19_8to64 wave36_adaptive_8to64
issue19_at 1,2,4 wave36_adaptive_1to4
drafters_twin wave36
verify_exact verify_wave36
# ... and batch 1 on `plain` again, the four drafters (docs/results/wave36_adaptive_plain_b1_rerun.json):
#   batchspec bench --methods autoregressive,eqspec --batch-sizes 1 --drafters draft_model,ngram,suffix,hybrid \
#     --adaptive on --twin --num-prompts 24 --max-new-tokens 64 --repeat 2 --gamma 4 --workload plain \
#     --json docs/results/wave36_adaptive_plain_b1_rerun.json
# ... and batch 1 alone, 2 repeats, no peers (docs/results/wave36_adaptive_1_rerun.json):
#   batchspec bench --methods autoregressive,eqspec --batch-sizes 1 --gamma 2,4 --drafters hybrid --adaptive off,on \
#     --twin --num-prompts 64 --max-new-tokens 32 --repeat 2 --json docs/results/wave36_adaptive_1_rerun.json
# Wave 37: the hybrid's model gate averages over ~33 rounds, and a new request's draft-model catch-up is
# priced by the share of rows the lookup finds nothing for (aacfb02); measured on the Intel Xeon:
issue19_at 1,2,4 wave37_adaptive_1to4
issue19_8to64 wave37_adaptive_8to64
drafters_twin wave37
verify_exact verify_wave37
# ... and batch 1 a second time, on the same code:
issue19_at 1 wave37_adaptive_1_second
# Wave 38: rounds stand only where the policy lets at least a quarter of planned rounds speculate
# (755eb62); measured on the Intel Xeon on 2ee8e2e, whose change to the hybrid's gate (a catch-up
# priced by how often it lets the model draft) was then reverted:
issue19_at 1,2,4 wave38_adaptive_1to4
issue19_8to64 wave38_adaptive_8to64
drafters_twin wave38
verify_exact verify_wave38
# ... and batch 1 a second time, on the same code, then after the revert:
issue19_at 1 wave38_adaptive_1_second
issue19_at 1 wave38_adaptive_1_reverted
# Wave 39: the standing length is learnt from the plans' lengths, before the draft model's cut;
# measured on an AMD EPYC (2 cores, ~3x slower per token than the Xeon), batch 1 only:
issue19_at 1 wave39_adaptive_1
# ... and `echo` at batch 1, then 8 and 32, suffix against hybrid:
batchspec bench --methods autoregressive,eqspec --batch-sizes 1 --drafters suffix,hybrid --adaptive on --twin \
  --num-prompts 24 --max-new-tokens 64 --repeat 3 --gamma 8 --workload echo --json docs/results/wave39_echo_1.json
batchspec bench --methods autoregressive,eqspec --batch-sizes 8,32 --drafters suffix,hybrid --adaptive on --twin \
  --num-prompts 24 --max-new-tokens 64 --repeat 3 --gamma 8 --workload echo --json docs/results/wave39_echo_8_32.json
# ... and exactness on the final code of wave 39:
verify_exact verify_wave39
# Wave 40: one-token rows attend together in a pass that attends row by row (a prompt joining
# decoding rows); issue 19's command at 16, 32 and 64 on the AMD EPYC:
issue19_at 16,32,64 wave40_adaptive_16to64
# ... and at 8, after it (the final code):
issue19_at 8 wave40_adaptive_8
# ... and exactness on the final code of wave 40:
verify_exact verify_wave40
# Wave 41 (the AMD EPYC, engine code unchanged from wave 40): issue 20's drafters on `plain`, 3 repeats:
batchspec bench --methods autoregressive,eqspec --batch-sizes 1,8,32 --drafters draft_model,ngram,suffix,hybrid \
  --adaptive on --twin --num-prompts 24 --max-new-tokens 64 --repeat 3 --gamma 4 --workload plain \
  --json docs/results/wave41_drafters_plain.json
# Wave 42 (the AMD EPYC, engine code unchanged from wave 40): issue 19's command at 2 and 4 rows,
# which the EPYC had not measured, and `generate`'s own workload (the default) as a bench table:
issue19_at 2,4 wave42_adaptive_2to4
batchspec bench --methods autoregressive,eqspec --batch-sizes 8 --gamma 4 --drafters hybrid --adaptive off,on --twin \
  --num-prompts 8 --max-new-tokens 128 --repeat 5 --json docs/results/wave42_default.json
# ... and issue 20's drafters on `echo` on the EPYC, 3 repeats:
batchspec bench --methods autoregressive,eqspec --batch-sizes 1,8,32 --drafters draft_model,ngram,suffix,hybrid \
  --adaptive on --twin --num-prompts 24 --max-new-tokens 64 --repeat 3 --gamma 8 --workload echo \
  --json docs/results/wave42_drafters_echo.json
# Wave 43: the draft model's window (`--draft-window`, default 128) against its whole context, on
# both workloads, adaptive (draft_model and hybrid) and fixed γ = 4 (draft_model), 3 repeats:
batchspec bench --methods autoregressive,eqspec --batch-sizes 1,8,32 --drafters draft_model,hybrid --adaptive on \
  --draft-window 128,0 --twin --num-prompts 24 --max-new-tokens 64 --repeat 3 --gamma 8 --workload echo \
  --json docs/results/wave43_draft_window_echo.json
batchspec bench --methods autoregressive,eqspec --batch-sizes 1,8,32 --drafters draft_model,hybrid --adaptive on \
  --draft-window 128,0 --twin --num-prompts 24 --max-new-tokens 64 --repeat 3 --gamma 4 --workload plain \
  --json docs/results/wave43_draft_window_plain.json
batchspec bench --methods autoregressive,eqspec --batch-sizes 1,8,32 --drafters draft_model --adaptive off \
  --draft-window 128,0 --twin --num-prompts 24 --max-new-tokens 64 --repeat 3 --gamma 4 --workload plain \
  --json docs/results/wave43_draft_window_fixed.json
# ... and exactness on the final code of wave 43 (the draft model's window of 128, the default):
verify_exact verify_wave43
# ... and, with the window (the default), `suffix` against the hybrid on `echo`, and issue 19's command at 32 rows:
batchspec bench --methods autoregressive,eqspec --batch-sizes 1 --drafters suffix,hybrid --adaptive on --twin \
  --num-prompts 24 --max-new-tokens 64 --repeat 3 --gamma 8 --workload echo --json docs/results/wave43_echo_1.json
batchspec bench --methods autoregressive,eqspec --batch-sizes 8,32 --drafters suffix,hybrid --adaptive on --twin \
  --num-prompts 24 --max-new-tokens 64 --repeat 3 --gamma 8 --workload echo --json docs/results/wave43_echo_8_32.json
issue19_at 32 wave43_adaptive_32
issue19_at 1 wave43_adaptive_1
# Wave 44 (the AMD EPYC, engine code of wave 43): issue 20's drafters with the draft model's window
# (the default), all four drafters with the twin on both workloads, 3 repeats:
batchspec bench --methods autoregressive,eqspec --batch-sizes 1,8,32 --drafters draft_model,ngram,suffix,hybrid \
  --adaptive on --twin --num-prompts 24 --max-new-tokens 64 --repeat 3 --gamma 4 --workload plain \
  --json docs/results/wave44_drafters_plain.json
batchspec bench --methods autoregressive,eqspec --batch-sizes 1,8,32 --drafters draft_model,ngram,suffix,hybrid \
  --adaptive on --twin --num-prompts 24 --max-new-tokens 64 --repeat 3 --gamma 8 --workload echo \
  --json docs/results/wave44_drafters_echo.json
