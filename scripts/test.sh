#!/usr/bin/env bash
# Set up (first run only), lint, and run the whole test suite: on min(cores, 4) processes
# (pytest-xdist) unless the arguments say how many (-n / --numprocesses / -p no:xdist).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
ruff check .
workers=$(python -c 'import os; n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(); print(min(n or 1, 4))')
for arg in "$@"; do
    case "$arg" in -n|-n*|--numprocesses*|no:xdist) workers=1 ;; esac
done
if [ "$workers" -gt 1 ]; then
    set -- -n "$workers" "$@"
fi
exec python -m pytest "$@"
