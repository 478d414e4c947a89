#!/usr/bin/env bash
# Set up (first run only) and generate with the bundled model pair: completions and a stats line.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec batchspec generate --num-prompts 8 --max-new-tokens 64 "$@"
