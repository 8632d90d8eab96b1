#!/usr/bin/env bash
# Installs every build and run dependency of mfsdp:
#   - Debian packages: compiler, CMake, Ninja, JSON, CLI11, SentencePiece, GoogleTest (and on
#     amd64 an aarch64 cross compiler and qemu, for one test);
#   - a project-local Python virtual environment, .venv (ignored by git), holding the exactly
#     pinned wheels of scripts/requirements.txt: torch, whose LibTorch every target is built
#     against (CMakeLists.txt finds it there), and the test/benchmark references.
# Idempotent: when everything is present it prints nothing and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  build-essential cmake ninja-build pkg-config
  nlohmann-json3-dev    # JSON (metadata, metrics)
  libcli11-dev          # command-line parsing of the tools
  libsentencepiece-dev  # SentencePiece tokenizer
  libpcre2-dev          # regexes of Hugging Face tokenizer.json files
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

# The CUDA configuration of the wheel's LibTorch needs the CUDA toolkit (nvcc and headers) at
# build time only; say so early instead of failing deep inside find_package(Torch).
if ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ] && [ -z "${CUDA_HOME:-}" ]; then
  echo "setup: warning: no CUDA toolkit (nvcc) found; the CUDA-enabled LibTorch in $venv needs one" \
       "to configure. Install it, set CUDA_HOME, or build against a CPU-only LibTorch" \
       "(docs/building.md)." >&2
fi
