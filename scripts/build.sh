#!/usr/bin/env bash
# Configures and builds mfsdp into build/ (Release, Ninja when present). Extra arguments go to
# `cmake --build` (e.g. --target mfsdp-pretrain to build one tool).
set -euo pipefail
cd "$(dirname "$0")/.."
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [ ! -f build/CMakeCache.txt ]; then
  cmake -S . -B build "${generator[@]}" -DCMAKE_BUILD_TYPE=Release >/dev/null
fi
cmake --build build -j "$(nproc)" "$@"
