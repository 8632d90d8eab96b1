#!/usr/bin/env bash
# Configures and builds mfsdp into build/ (Release, Ninja when present). Extra arguments go to
# `cmake --build` (e.g. --target mfsdp-pretrain to build one tool).
set -euo pipefail
cd "$(dirname "$0")/.."
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [ ! -f build/CMakeCache.txt ]; then
  # Quiet, but for the line naming the CUDA toolkit LibTorch is configured with: the system's, or
  # without one the NVIDIA wheels scripts/setup.sh put into .venv (CMakeLists.txt).
  cmake -S . -B build "${generator[@]}" -DCMAKE_BUILD_TYPE=Release |
    sed -n 's/^-- \(mfsdp: CUDA toolkit .*\)/\1/p'
fi
cmake --build build -j "$(nproc)" "$@"
