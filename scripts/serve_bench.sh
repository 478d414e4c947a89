#!/usr/bin/env bash
# The serving table: `batchspec loadtest` against `batchspec serve` (autoregressive, the speculative
# default, which is adaptive, and with --no-adaptive: fixed γ) and `transformers serve --continuous-batching`,
# on the same model, dtype and machine, at several concurrencies, servers measured alternately.
#
#   scripts/serve_bench.sh OUT_DIR        # writes OUT_DIR/<server>_c<N>_r<K>.json and OUT_DIR/table.md
#
# One server runs at a time: for every repeat and concurrency each server is started, waited for,
# load-tested (an untimed warm-up wave, then the timed requests) and stopped; the order of the
# servers reverses at every cell so that drift on a shared machine falls on all of them alike.
# Run nothing else meanwhile. Settings (environment variables):
#   TARGET          model [default: the bundled target]          DTYPE       [float32]
#   CONCURRENCIES   [1 8 32]                                     MAX_TOKENS  [64] (greedy)
#   REQUESTS        timed requests per cell [32 at concurrency 1, else max(64, 4 x concurrency): at 8,
#                   32 requests were 5-8 s a cell, short enough for one slow spell to move it 20 %]
#   REPEAT          [1]           SERVERS  [ar spec hf] (and fixed)      PORT [8123]
#   BATCH           --max-batch-size of batchspec serve [32]
#   SPEC_ARGS       extra options of the speculative server, e.g. "--gamma 3" [none: EngineConfig's defaults]
#   STREAM          --stream or --no-stream [--stream: TTFT and inter-token latency need it]
#   CHAT            1: load-test /v1/chat/completions (each prompt one user message, the model's chat
#                   template; the bundled pair has one) instead of /v1/completions [unset]; use its own OUT_DIR
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"

OUT="${1:?usage: scripts/serve_bench.sh OUT_DIR}"
mkdir -p "$OUT"
TARGET="${TARGET:-$(python -c 'from batchspec.models import default_target; print(default_target())')}"
DTYPE="${DTYPE:-float32}"
CONCURRENCIES="${CONCURRENCIES:-1 8 32}"
MAX_TOKENS="${MAX_TOKENS:-64}"
REPEAT="${REPEAT:-1}"
SERVERS="${SERVERS:-ar spec hf}"
PORT="${PORT:-8123}"
BATCH="${BATCH:-32}"
SPEC_ARGS="${SPEC_ARGS:-}"
STREAM="${STREAM:---stream}"
CHAT_ARG=()
if [ -n "${CHAT:-}" ]; then CHAT_ARG=(--chat); fi
URL="http://127.0.0.1:$PORT"

# transformers serve needs fastapi, uvicorn, openai and pydantic (batchspec's own dependencies) and,
# to load a model with a device_map even on a CPU, accelerate: the project's `bench` extra.
python -c 'import accelerate' 2>/dev/null || python -m pip install --quiet -e "$ROOT[bench]"
python -c 'from transformers.utils.import_utils import is_serve_available as ok; assert ok()' \
  || { echo "transformers serve is unavailable: pip install 'transformers[serving]'" >&2; exit 1; }

start_server() {  # $1: ar | spec | hf; writes the log to $OUT/<server>.log
  local log="$OUT/$1.log"
  case "$1" in
    ar)   batchspec serve --target "$TARGET" --dtype "$DTYPE" --method autoregressive --max-batch-size "$BATCH" \
            --port "$PORT" >>"$log" 2>&1 & ;;
    spec) # shellcheck disable=SC2086
          batchspec serve --target "$TARGET" --dtype "$DTYPE" --max-batch-size "$BATCH" $SPEC_ARGS \
            --port "$PORT" >>"$log" 2>&1 & ;;
    fixed) # shellcheck disable=SC2086
          batchspec serve --target "$TARGET" --dtype "$DTYPE" --max-batch-size "$BATCH" $SPEC_ARGS --no-adaptive \
            --port "$PORT" >>"$log" 2>&1 & ;;
    hf)   transformers serve --continuous-batching --device cpu --dtype "$DTYPE" --host 127.0.0.1 --port "$PORT" \
            "$TARGET" >>"$log" 2>&1 & ;;
    *)    echo "unknown server $1" >&2; exit 2 ;;
  esac
  SERVER_PID=$!
  for _ in $(seq 1 600); do
    if curl -sf "$URL/health" >/dev/null 2>&1; then return 0; fi
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then echo "$1 server exited; see $log" >&2; exit 1; fi
    sleep 0.5
  done
  echo "$1 server did not come up in 300 s; see $log" >&2
  exit 1
}

stop_server() {
  kill "$SERVER_PID" 2>/dev/null || true
  wait "$SERVER_PID" 2>/dev/null || true
  SERVER_PID=
}
SERVER_PID=
trap 'if [ -n "$SERVER_PID" ]; then stop_server; fi' EXIT

order=($SERVERS)
for rep in $(seq 1 "$REPEAT"); do
  for c in $CONCURRENCIES; do
    requests="${REQUESTS:-$(( c == 1 ? 32 : (4 * c > 64 ? 4 * c : 64) ))}"
    for server in "${order[@]}"; do
      echo "== repeat $rep, concurrency $c: $server ($requests requests)" >&2
      start_server "$server"
      batchspec loadtest --url "$URL" --model "$TARGET" --concurrency "$c" --requests "$requests" \
        --max-tokens "$MAX_TOKENS" --temperature 0 "$STREAM" "${CHAT_ARG[@]}" --json "$OUT/${server}_c${c}_r${rep}.json" \
        || echo "loadtest against $server at concurrency $c reported failures (see the JSON)" >&2
      stop_server
    done
    order=($(printf '%s\n' "${order[@]}" | tac))  # the next cell runs the servers in reverse
  done
done

python - "$OUT" <<'EOF' | tee "$OUT/table.md"
import sys
from batchspec.server.loadtest import comparison_table
print(comparison_table(sys.argv[1], {"ar": "batchspec serve, autoregressive", "spec": "batchspec serve, default",
                                     "fixed": "batchspec serve --no-adaptive",
                                     "hf": "transformers serve --continuous-batching"}, baseline="hf"))
EOF
