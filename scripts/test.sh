#!/usr/bin/env bash
# The README's test command: installs dependencies, builds, runs every test under ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
# Each phase's time on one line at the end (docs/building.md, "Where the CI time goes").
times=()
phase() {  # name command...
  local start=$SECONDS rc=0
  "${@:2}" || rc=$?
  times+=("$1 $((SECONDS - start)) s")
  echo "scripts/test.sh: ${times[*]}"
  return "$rc"
}
phase setup scripts/setup.sh
phase build scripts/build.sh
# One test per core at a time: a multi-rank test (up to 4 processes, one thread each) spends much
# of its time starting processes and waiting on peers, so two at a time on 2 cores finish the
# suite well before one at a time does (docs/building.md), and every test passes either way.
cd build
phase ctest ctest --output-on-failure --timeout 900 -j "$(nproc)" "$@"
