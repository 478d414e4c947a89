#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment in .venv. Sourced by demo.sh and test.sh.
# torch is pinned first: on a machine without CUDA, torch==2.13.0 resolves to the CPU build, and
# the project's own "torch>=2.5" is then already satisfied (no CUDA wheels are pulled).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
VENV="$ROOT/.venv"
STAMP="$VENV/.batchspec-installed"
WANT="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/env.sh" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
    "$VENV/bin/python" -m pip install --quiet -e "$ROOT[test]"
    echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
