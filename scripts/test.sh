#!/usr/bin/env bash
# The README's test command: installs dependencies, builds, runs every test under ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
# Multi-rank tests start up to 4 processes each; run tests one at a time on small machines.
cd build && ctest --output-on-failure --timeout 900 "$@"
