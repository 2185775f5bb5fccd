#!/usr/bin/env bash
# The suite's stability check: `bash .ci/run` in a clean clone of HEAD, N times in a row (3 by
# default), each beside a CPU hog (one busy loop per core, at nice 0). Stops at the first
# failing run. Logs: $OUT/run-<i>.log (default OUT: /tmp/stoker-under-load); one summary line
# per run in $OUT/summary.
#   bash scripts/test_under_load.sh [N]
set -uo pipefail
n=${1:-3}
repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
commit=$(git -C "$repo" rev-parse HEAD)
out=${OUT:-/tmp/stoker-under-load}
mkdir -p "$out"
for i in $(seq 1 "$n"); do
  clone=$(mktemp -d /tmp/stoker-under-load-clone.XXXXXX)
  git clone -q "$repo" "$clone" && git -C "$clone" checkout -q "$commit"
  hogs=()
  for _ in $(seq 1 "$(nproc)"); do
    sh -c 'while :; do :; done' &
    hogs+=($!)
  done
  start=$(date +%s)
  (cd "$clone" && PYTEST_ARGS="${PYTEST_ARGS:---durations=60}" bash .ci/run) > "$out/run-$i.log" 2>&1
  rc=$?
  kill "${hogs[@]}"
  line=$(grep -E '^=+ .*(passed|failed)' "$out/run-$i.log" | tail -1)
  echo "$commit run $i of $n: exit $rc, $(( $(date +%s) - start )) s, $line" | tee -a "$out/summary"
  rm -rf "$clone"
  [ "$rc" -eq 0 ] || exit "$rc"
done
