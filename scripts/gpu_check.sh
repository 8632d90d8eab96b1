#!/usr/bin/env bash
# One call on a borrowed GPU machine: build mfsdp against that machine's own PyTorch (e.g. 2.11
# with CUDA 13), run the GPU tests and then the whole suite, and leave the logs in $OUT (or
# build-gpu/results when OUT is unset).
#
#   scripts/gpu_check.sh                 # on the GPU machine, from the repository root
#
# The GPU machine has no internet: the Debian packages the build needs and it lacks are carried
# in .device/debs (ignored by git), made here beforehand with `scripts/gpu_check.sh --fetch-debs`.
set -uo pipefail
cd "$(dirname "$0")/.."
debs=(nlohmann-json3-dev libcli11-dev libsentencepiece-dev libsentencepiece0 libprotobuf-lite32
      libgtest-dev googletest ninja-build)
if [[ ${1:-} == --fetch-debs ]]; then
  mkdir -p .device/debs && cd .device/debs && apt-get download "${debs[@]}" && ls -l
  exit
fi
out=$(realpath -m "${OUT:-build-gpu/results}")
mkdir -p "$out"
log() { echo "gpu_check: $*" | tee -a "$out/summary.txt"; }

nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || log "warning: nvidia-smi failed"
python=${PYTHON:-python3}
torch_prefix=$("$python" -c 'import torch, torch.utils; print(torch.utils.cmake_prefix_path)') ||
  { log "no PyTorch for $python"; exit 1; }
log "$("$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())')"
missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  log "installing carried packages for ${missing[*]}"
  dpkg -i .device/debs/*.deb > "$out/dpkg.txt" 2>&1 || { log "dpkg failed (see dpkg.txt)"; exit 1; }
fi

start=$(date +%s)
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$torch_prefix" \
  -DMFSDP_PYTHON="$(command -v "$python")" > "$out/configure.txt" 2>&1 ||
  { log "configure failed (configure.txt)"; tail -20 "$out/configure.txt"; exit 1; }
cmake --build build-gpu -j "$(nproc)" > "$out/build.txt" 2>&1 ||
  { log "build failed (build.txt)"; grep -m20 'error' "$out/build.txt"; exit 1; }
log "configure + build: $(( $(date +%s) - start )) s"

(cd build-gpu && ctest -L gpu --output-on-failure > "$out/ctest_gpu.txt" 2>&1)
log "GPU tests: $(grep -E 'tests passed|tests failed' "$out/ctest_gpu.txt")"
(cd build-gpu && ctest -j 8 --timeout 900 --output-on-failure > "$out/ctest_all.txt" 2>&1)
log "whole suite: $(grep -E 'tests passed|tests failed' "$out/ctest_all.txt")"
grep -A30 'The following tests' "$out/ctest_all.txt" | tee -a "$out/summary.txt"
cat "$out/summary.txt"
