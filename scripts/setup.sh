#!/usr/bin/env bash
# Install stoker into the current Python environment (activate a venv first if you want one).
#   scripts/setup.sh          the pipeline's dependencies
#   scripts/setup.sh test     plus the test dependencies (pytest, moto[server])
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# torch first, pinned: an unpinned torch pulls several GB of CUDA packages. Any torch>=2.4
# already installed is kept.
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "${STOKER_TORCH_SPEC:-torch==2.13.0}"
fi
extra=""
if [ "${1:-}" = "test" ]; then extra="[test]"; fi
"$PY" -m pip install -q -e ".${extra}"
