#!/usr/bin/env bash
# The README's test command: installs dependencies, builds, runs every test under ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
# One test per core at a time: a multi-rank test (up to 4 processes, one thread each) spends much
# of its time starting processes and waiting on peers, so two at a time on 2 cores finish the
# suite well before one at a time does (docs/building.md), and every test passes either way.
cd build && ctest --output-on-failure --timeout 900 -j "$(nproc)" "$@"
