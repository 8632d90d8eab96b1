#!/usr/bin/env bash
# The aarch64 CRC-32C path (ARMv8 crc32c instructions, src/base/crc32c.cpp) cannot run on the
# x86 machines CI uses: build it with the cross compiler and run it under qemu's user-mode
# emulation, which reports the CRC32 feature, so the hardware path is the one taken (checked:
# the binary must contain crc32cx). Registered by tests/CMakeLists.txt only where both tools
# exist (scripts/setup.sh installs them on amd64).
#   tests/unit/crc32c_aarch64_test.sh SOURCE_DIR BUILD_DIR CXX QEMU
set -euo pipefail
src=$1 out=$2 cxx=$3 qemu=$4
mkdir -p "$out"
"$cxx" -std=c++17 -O2 -Wall -Wextra -Werror -static -I "$src/include" "$src/src/base/crc32c.cpp" \
  "$src/tests/unit/crc32c_aarch64_check.cpp" -o "$out/crc32c_aarch64_check"
objdump=${cxx%g++}objdump
if command -v "$objdump" >/dev/null && ! "$objdump" -d "$out/crc32c_aarch64_check" | grep crc32cx >/dev/null; then
  echo "crc32c_aarch64_test: the aarch64 build has no crc32cx instruction (the hardware path was not compiled)" >&2
  exit 1
fi
"$qemu" "$out/crc32c_aarch64_check"
