#!/usr/bin/env bash
# Installs every build and run dependency of mfsdp from Debian packages.
# Idempotent: when everything is present it prints nothing and exits 0.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config
  libtorch-dev          # LibTorch 1.13 (CPU): tensors, autograd, c10d TCPStore
  libgloo-dev           # Gloo collectives for the CPU communicator
  libopenblas0-pthread  # fp32 BLAS that LibTorch really uses (replaces reference libblas.so.3)
  nlohmann-json3-dev    # JSON (metadata, metrics)
  libcli11-dev          # command-line parsing of the tools
  libsentencepiece-dev  # SentencePiece tokenizer
  libgtest-dev googletest
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
# Make sure the fp32 BLAS LibTorch loads is OpenBLAS, not the reference implementation (~60x slower).
blas_alt=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
if [ -e "$blas_alt" ]; then
  $sudo update-alternatives --set libblas.so.3-x86_64-linux-gnu "$blas_alt" >/dev/null
fi
echo "setup: done"
