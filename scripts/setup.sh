#!/usr/bin/env bash
# Installs every build and run dependency of mfsdp:
#   - Debian packages: compiler, CMake, Ninja, JSON, CLI11, SentencePiece, PCRE2, utf8proc, GoogleTest (and on
#     amd64 an aarch64 cross compiler and qemu, for one test);
#   - a project-local Python virtual environment, .venv (ignored by git), holding the exactly
#     pinned wheels of scripts/requirements.txt: torch, whose LibTorch every target is built
#     against (CMakeLists.txt finds it there), and the test/benchmark references;
#   - only where the system has no CUDA toolkit: NVIDIA's nvcc and header wheels, into .venv too.
# Idempotent: when everything is present it prints nothing and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  build-essential cmake ninja-build pkg-config
  nlohmann-json3-dev    # JSON (metadata, metrics)
  libcli11-dev          # command-line parsing of the tools
  libsentencepiece-dev  # SentencePiece tokenizer
  libpcre2-dev          # regexes of Hugging Face tokenizer.json files
  libutf8proc-dev       # Unicode normal forms, case and categories of tokenizer.json normalizers
  libgtest-dev googletest
)
# On amd64: a cross compiler and qemu, to build and run the aarch64 CRC-32C path in a test.
if [ "$(dpkg --print-architecture 2>/dev/null)" = amd64 ]; then
  packages+=(g++-aarch64-linux-gnu qemu-user-static)
fi
sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# The virtual environment needs Python >= 3.10 with venv/ensurepip (Debian: python3-venv).
python=${MFSDP_SETUP_PYTHON:-python3}
if ! "$python" -c 'import sys, ensurepip, venv; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  python=/usr/bin/python3
  dpkg-query -W -f='${Status}' python3-venv 2>/dev/null | grep -q "install ok installed" ||
    missing+=(python3-venv)
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The pinned wheels; a stamp holding the requirements file makes the check instant.
venv=.venv
stamp=$venv/.mfsdp-requirements
if [ ! -f "$stamp" ] || ! cmp -s scripts/requirements.txt "$stamp"; then
  start=$(date +%s)
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
  echo "setup: installing the pinned wheels of scripts/requirements.txt into $venv (first time: a few minutes, ~6 GB)"
  # No wheel cache: torch and its CUDA wheels are ~4 GB more on a disk that may be small (a CI
  # machine ran out of space once), and a fresh environment never reuses them.
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir \
    -r scripts/requirements.txt
  cp scripts/requirements.txt "$stamp"
  echo "setup: Python environment ready in $(( $(date +%s) - start )) s"
fi

# The CUDA configuration of the wheel's LibTorch needs a CUDA toolkit (nvcc, the runtime headers)
# to configure and build. Without one on the system (nvcc on PATH, in $CUDA_HOME or $CUDA_PATH, or
# /usr/local/cuda), install NVIDIA's toolkit wheels into .venv (~110 MB to download, ~290 MB):
# nvcc, nvvm (cicc, libdevice), the crt headers and cuda_profiler_api.h land in
# site-packages/nvidia/cu13, beside the runtime, cuBLAS, NVTX and CCCL that torch's own
# dependencies put there, which makes that folder a whole toolkit; CMakeLists.txt uses it when it
# finds no system toolkit. Pinned to torch's CUDA: torch 2.15.0 requires cuda-toolkit==13.2.2,
# whose extras pin each component (nvidia-cuda-nvcc==13.2.86.*), so that cuda-toolkit version with
# the nvcc and profiler extras is the compiler of the CUDA torch was built with. The stamp holds
# the requirements too: a new torch pin (maybe a new CUDA) reinstalls them.
have_system_cuda() {
  command -v nvcc >/dev/null && return 0
  local d
  for d in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda; do
    [ -n "$d" ] && [ -x "$d/bin/nvcc" ] && return 0
  done
  return 1
}
cuda_stamp=$venv/.mfsdp-cuda-wheels
if ! have_system_cuda && { [ ! -f "$cuda_stamp" ] || ! cmp -s scripts/requirements.txt "$cuda_stamp"; }; then
  read -r cuda_toolkit site < <("$venv/bin/python" -c 'import importlib.metadata as m, sysconfig
try: v = m.version("cuda-toolkit")
except m.PackageNotFoundError: v = "-"
print(v, sysconfig.get_paths()["purelib"])')
  if [ "$cuda_toolkit" = - ]; then
    echo "setup: warning: no CUDA toolkit (nvcc) found and torch in $venv names no cuda-toolkit" \
         "version to match; install the CUDA toolkit or set CUDA_HOME to configure its" \
         "CUDA-enabled LibTorch, or build against a CPU-only LibTorch (docs/building.md)." >&2
  else
    echo "setup: no system CUDA toolkit: installing CUDA $cuda_toolkit's nvcc and headers (NVIDIA's wheels) into $venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir \
      "cuda-toolkit[nvcc,profiler]==$cuda_toolkit"
    # The wheels ship only versioned libraries (libcudart.so.13); a toolkit also has the
    # unversioned names the linker and CMake's FindCUDAToolkit look for (libcudart.so).
    for lib in "$site"/nvidia/cu[0-9]*/lib/lib*.so.[0-9]*; do
      dev=${lib%%.so.*}.so
      if [ -e "$lib" ] && [ ! -e "$dev" ]; then ln -sf "$(basename "$lib")" "$dev"; fi
    done
    cp scripts/requirements.txt "$cuda_stamp"
  fi
fi
