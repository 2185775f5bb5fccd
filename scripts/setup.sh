#!/usr/bin/env bash
# Install stoker into the current Python environment (activate a venv first if you want one).
#   scripts/setup.sh          the pipeline's dependencies
#   scripts/setup.sh test     plus the test dependencies (pytest, moto[server], playwright;
#                             Debian's chromium from apt when root and missing)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Installed already for this pyproject.toml, this extra and this Python: nothing to do (make run
# would otherwise spend ~7 s in pip on every call). Any change to pyproject.toml reinstalls.
stamp=".setup-stamp${1:+-$1}"
want="$("$PY" -c 'import sys; print(sys.executable)') $(sha256sum pyproject.toml | cut -c1-16)"
# (and the editable install is of this checkout, not of another clone sharing the Python)
installed_here() {
  "$PY" -I - "$PWD" <<'PYEOF' 2>/dev/null  # -I: not the egg-info in this folder
import json, sys, importlib.metadata as m
url = json.loads(m.distribution("stoker").read_text("direct_url.json") or "{}").get("url", "")
sys.exit(0 if url.rstrip("/") == "file://" + sys.argv[1].rstrip("/") else 1)
PYEOF
}
# Bytecode for stoker's own modules (and the tests' helpers that processes import), as a
# regular install writes it: an editable install leaves none, and where PYTHONDONTWRITEBYTECODE
# is set (these machines set it) every process compiled them again. That is little (compiling
# all of stoker takes ~0.1 CPU-s; benchmarks/bench_startup.py measures what a rank saves), and
# quick when up to date: only changed files are compiled.
compile_bytecode() {
  "$PY" -m compileall -q -j 0 stoker $([ "${1:-}" = "test" ] && echo tests) >/dev/null
}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && installed_here; then
  compile_bytecode "${1:-}"
  exit 0
fi
# torch first, pinned: an unpinned torch pulls several GB of CUDA packages. Any torch>=2.4
# already installed is kept.
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "${STOKER_TORCH_SPEC:-torch==2.13.0}"
fi
extra=""
if [ "${1:-}" = "test" ]; then
  extra="[test]"
  # The UI test (in tests/flows/test_deployments.py) drives Debian's Chromium with Python
  # playwright (the [test] extra). Installed from apt when missing and we are root; never a
  # browser download (`playwright install`). Without it that one test is skipped.
  if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } \
      || echo "setup: apt-get install chromium failed; the browser test will be skipped" >&2
  fi
fi
"$PY" -m pip install -q -e ".${extra}"
compile_bytecode "${1:-}"
echo "$want" > "$stamp"
