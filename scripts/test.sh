#!/usr/bin/env bash
# Set up (first run only), lint, and run the whole test suite.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
ruff check .
exec python -m pytest "$@"
