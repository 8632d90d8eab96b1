#!/usr/bin/env bash
# One call on a borrowed GPU machine, inside its 10 minutes: build mfsdp against that machine's
# own PyTorch (e.g. 2.11 with CUDA 13), run the GPU tests (ctest -L gpu), the GPU benchmarks
# (bench/collective_bandwidth.sh with BACKEND=nccl, bench/gpu_step_time.sh on 1 GPU and on all:
# mfsdp vs PyTorch DDP, FSDP2 and Megatron-FSDP; bench/moe_step_time.sh; a profile of mfsdp's
# step), then the rest of
# the suite while time remains, and leave a summary and the logs in $OUT (build-gpu/results
# when OUT is unset).
#
#   scripts/gpu_check.sh --fetch-debs        # here, with internet and apt: the packages below
#   scripts/gpu_check.sh                     # there, as root, from the repository root
#   scripts/gpu_check.sh --configure-only    # unpack + configure only (a check of the recipe)
#   scripts/gpu_check.sh --correctness       # build, the GPU tier, the stream-order and memcheck
#                                            # runs; no benchmarks, no rest of the suite; budget
#                                            # 330 s, so that a second call fits the 15 minutes
#
# Beside the GPU tier (ctest -L gpu) it runs the FSDP stream-order tests again under
# MFSDP_DEBUG_STREAM_SLEEP (a GPU sleep before every collective on the communication stream,
# then on the compute stream: a missing dependency becomes wrong bits, docs/comm.md), and the
# NCCL tests under compute-sanitizer's memcheck where the machine allows it. One GPU cannot run
# NCCL between ranks ("duplicate GPU"): the summary then says multi-rank NCCL was not tested.
#
# The GPU machine has no internet and none of the Debian packages the build needs beside
# LibTorch: --fetch-debs downloads them (apt-get download, no dependencies resolved), and the
# wheels of Megatron-FSDP for the side-by-side benchmark (.device/debs/wheels), into
# .device/debs (ignored by git; hand it to the machine, e.g. the device tool's carry). There a
# wheel is installed only when its module is not importable already (pip install --no-deps
# --no-index --target, onto PYTHONPATH for the benchmark alone), and the .debs are not
# installed: each .deb is unpacked (dpkg -x, i.e. dpkg-deb -x; ar + tar without dpkg)
# into DEB_PREFIX and CMake is pointed at it (CMAKE_PREFIX_PATH, CMAKE_LIBRARY_PATH, GTest_DIR,
# -isystem for the header-only JSON and the SentencePiece headers); LD_LIBRARY_PATH gets its
# library folder (libsentencepiece.so.0; the build's RPATH names it too).
# Debian 12's libsentencepiece0 bundles its protobuf-lite (it depends on libc and libstdc++
# only), so no libprotobuf package is carried.
#
# Time: everything must end inside the machine's 10-minute command limit, so the script works
# to a budget (GPU_CHECK_BUDGET seconds from its start, default 570). Every phase runs under
# `timeout` sized to what is left, the benchmarks run only with enough time left, the whole suite
# gets the rest (ctest --stop-time), and the summary is always written.
#
# Files in $OUT (8 at most, each cut to its last 15 MiB): summary.txt, system.txt (GPU, tool and
# library versions), build.txt (unpack + configure + build), ctest_gpu.txt, checks.txt (the
# stream-order runs and memcheck), bench_step_time.txt, ctest_all.txt, bench_raw.tar.gz (raw
# benchmark outputs and metrics; the collective, MoE and TP logs, whose tables are in the summary).
#
# Environment: PYTHON [python3: the PyTorch to build against; also MFSDP_PYTHON of the tests]
#   BUILD_DIR [build-gpu] DEB_PREFIX [.device/root] GPU_CHECK_BUDGET [570] CTEST_JOBS [4]
#   GPU_TESTS [all; a ctest -R regular expression: the GPU tier is only those GPU tests]
#   REST_TESTS [all; a ctest -R regular expression: the rest of the suite is only those tests]
#   GPU_BENCH [1; 0 skips the benchmarks] CB_ROUNDS [3] CB_MAX_BYTES [256M] (collectives)
#   GPU_PROFILE [1; 0 skips the profiled run b: --profile --use-pytorch-profiler, summed by
#   bench/trace_summary.py]
#   and gpu_step_time.sh's (LAYERS, HIDDEN, PRECISIONS, ITERS, ...), which pass through.
# Exit status: 0 when the build, the GPU tier and the stream-order runs passed (and memcheck found
# no error); 1 otherwise; 2 on bad usage.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD

debs=(nlohmann-json3-dev libcli11-dev libsentencepiece-dev libsentencepiece0 libgtest-dev googletest
  libpcre2-dev libpcre2-8-0 libutf8proc-dev libutf8proc2)
# Megatron-FSDP itself for the side-by-side benchmark, and what it imports beside torch
# (Requires-Dist: torch, einops, packaging): packaging, in case that environment lacks it; not
# einops, which it imports only for hybrid sharding (HSDP), unused here. Pure Python, 0.2 MiB.
wheels=(megatron-fsdp==0.6.1 packaging==26.3)
DEB_DIR=$ROOT/.device/debs
MAX_DEB_BYTES=$((60 << 20))

mode=check
case ${1:-} in
  --fetch-debs) mode=fetch ;;
  --configure-only) mode=configure ;;
  --correctness) mode=correctness ;;
  "") ;;
  *) echo "usage: scripts/gpu_check.sh [--fetch-debs | --configure-only | --correctness]" >&2; exit 2 ;;
esac

# ---- here: download the packages ---------------------------------------------------------------
if [[ $mode == fetch ]]; then
  rm -rf "$DEB_DIR" && mkdir -p "$DEB_DIR" || exit 1
  (cd "$DEB_DIR" && apt-get download "${debs[@]}") || { echo "gpu_check: apt-get download failed" >&2; exit 1; }
  pip_python=${PYTHON:-$ROOT/.venv/bin/python}
  "$pip_python" -m pip download -q --no-deps -d "$DEB_DIR/wheels" "${wheels[@]}" ||
    { echo "gpu_check: pip download ${wheels[*]} failed" >&2; exit 1; }
  ls -l "$DEB_DIR"
  total=$(du -cb "$DEB_DIR"/*.deb "$DEB_DIR"/wheels/*.whl | tail -1 | cut -f1)
  echo "gpu_check: ${#debs[@]} packages and ${#wheels[@]} wheels in .device/debs: $total bytes ($(((total + 1048575) >> 20)) MiB)"
  ((total < MAX_DEB_BYTES)) || { echo "gpu_check: over $((MAX_DEB_BYTES >> 20)) MiB" >&2; exit 1; }
  exit 0
fi

# ---- there: budget, output files ---------------------------------------------------------------
BUDGET=${GPU_CHECK_BUDGET:-570}
[[ $mode == correctness ]] && BUDGET=${GPU_CHECK_BUDGET:-330}
BUILD_DIR=$(realpath -m "${BUILD_DIR:-build-gpu}")
DEB_PREFIX=$(realpath -m "${DEB_PREFIX:-.device/root}")
CTEST_JOBS=${CTEST_JOBS:-4}
GPU_BENCH=${GPU_BENCH:-1}
[[ $mode == correctness ]] && GPU_BENCH=0
GPU_PROFILE=${GPU_PROFILE:-1}
python=${PYTHON:-python3}
python=$(command -v "$python") || { echo "gpu_check: PYTHON=${PYTHON:-python3} not found" >&2; exit 2; }
[[ $python == /* ]] || python=$ROOT/$python  # absolute (tests run elsewhere); a venv's link kept
for v in BUDGET CTEST_JOBS; do
  [[ ${!v} =~ ^[1-9][0-9]*$ ]] || { echo "gpu_check: $v=${!v}: expected a positive integer" >&2; exit 2; }
done
# A 16-core build takes ~130 s and the GPU tier ~45 s; under 240 s nothing after them would run.
((BUDGET >= 240)) || { echo "gpu_check: GPU_CHECK_BUDGET=$BUDGET: at least 240 s (a 16-core build takes ~130 s)" >&2; exit 2; }

out=$(realpath -m "${OUT:-$BUILD_DIR/results}")
mkdir -p "$out" || exit 1
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") || exit 1
summary=$out/summary.txt
: >"$summary"
log() { echo "gpu_check [$(printf '%3d' "$SECONDS") s]: $*" | tee -a "$summary"; }
# Seconds a phase may take: at most $1, leaving $2 for what must follow; at least 1 (timeout 0
# would mean no limit at all).
allow() {
  local l=$((BUDGET - SECONDS - $2))
  ((l > $1)) && l=$1
  ((l < 1)) && l=1
  echo "$l"
}
# ctest's summary line, or a count of the result lines when ctest was stopped before it.
ctest_result() {  # log
  local line
  line=$(grep -E 'tests passed|tests failed' "$1" | tail -1)
  [[ -n $line ]] && { echo "$line"; return; }
  echo "$(grep -cE ' Passed +[0-9.]+ sec' "$1") passed, $(grep -cE '\*\*\*(Failed|Timeout|Exception)' "$1")" \
       "failed, no ctest summary (stopped)"
}
status=1
finish() {
  trap - EXIT
  log "total $SECONDS s; exit status $status"
  if [[ -d $work/raw ]]; then
    tar -czf "$out/bench_raw.tar.gz" -C "$work" raw 2>/dev/null || rm -f "$out/bench_raw.tar.gz"
  fi
  local f tmp
  for f in "$out"/*; do  # the machine returns files of up to 16 MiB
    [[ -f $f ]] || continue
    if (($(stat -c %s "$f") > (15 << 20))); then
      tmp=$f.tail
      { echo "[... cut to the last 15 MiB ...]"; tail -c 15M "$f"; } >"$tmp" && mv "$tmp" "$f"
    fi
  done
  rm -rf "$work"
  echo "----- summary.txt -----"
  cat "$summary"
  exit "$status"
}
trap finish EXIT

# ---- tools and versions --------------------------------------------------------------------------
# The PyTorch venv's bin holds cmake, ctest and ninja (pip packages); nvcc may not be on PATH.
pybin=$("$python" -c 'import os, sys; print(os.path.dirname(sys.executable))' 2>/dev/null)
[[ -n $pybin ]] && PATH=$pybin:$PATH
if ! command -v nvcc >/dev/null; then
  for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do
    [[ -x $d/nvcc ]] && { PATH=$PATH:$d; break; }
  done
fi
export PATH
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}  # H100/H200; spares the GPU probe
{
  echo "== date, host"; date -u; uname -a; grep PRETTY_NAME /etc/os-release
  echo "== nproc $(nproc)"; free -g; df -h "$ROOT" | tail -1
  echo "== nvidia-smi"; nvidia-smi 2>&1; nvidia-smi -L 2>&1
  echo "== python $python"; "$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(), "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None)' 2>&1
  echo "== tools"
  for t in cmake ctest ninja nvcc c++ g++ dpkg-deb; do printf '%-9s %s\n' "$t" "$(command -v $t || echo MISSING)"; done
  cmake --version | head -1; ninja --version; c++ --version | head -1; nvcc --version 2>&1 | tail -2
  ldd --version | head -1
} >"$out/system.txt" 2>&1
torch_prefix=$("$python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)' 2>>"$out/system.txt") ||
  { log "no PyTorch importable by $python (system.txt)"; exit 1; }
log "$("$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())' 2>&1 | tail -1)"
gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)
log "GPU: ${gpu:-none (nvidia-smi failed or is missing)}"
log "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (+ uncommitted changes)')"
for t in cmake ctest ninja c++; do
  command -v "$t" >/dev/null || { log "$t not found (system.txt)"; exit 1; }
done

# ---- the Debian packages: unpacked, not installed --------------------------------------------------
build_log=$out/build.txt
unpack() {  # deb prefix
  if command -v dpkg-deb >/dev/null; then dpkg-deb -x "$1" "$2"; return; fi
  # No dpkg: a .deb is an ar archive whose data.tar.* holds the files.
  local member
  member=$(ar t "$1" | grep -m1 '^data\.tar') && (cd "$work" && ar x "$1" "$member") &&
    tar -xf "$work/$member" -C "$2" && rm -f "$work/$member"
}
shopt -s nullglob
deb_files=("$DEB_DIR"/*.deb)
shopt -u nullglob
((${#deb_files[@]})) || { log "no .deb in $DEB_DIR: run scripts/gpu_check.sh --fetch-debs first and carry .device/debs"; exit 1; }
rm -rf "$DEB_PREFIX" && mkdir -p "$DEB_PREFIX" || exit 1
(
  echo "== unpacking into $DEB_PREFIX"
  for f in "${deb_files[@]}"; do echo "${f##*/}"; unpack "$f" "$DEB_PREFIX" || exit 1; done
) >"$build_log" 2>&1 || { log "unpacking the .debs failed (build.txt)"; exit 1; }
libdir=$DEB_PREFIX/usr/lib/x86_64-linux-gnu
incdir=$DEB_PREFIX/usr/include
for f in "$libdir/libsentencepiece.so" "$libdir/libsentencepiece_train.so" "$libdir/libgtest.a" \
         "$libdir/cmake/GTest/GTestConfig.cmake" "$incdir/nlohmann/json.hpp" "$incdir/sentencepiece_processor.h" \
         "$libdir/libpcre2-8.so" "$incdir/pcre2.h" "$libdir/libutf8proc.so" "$incdir/utf8proc.h"; do
  [[ -e $f ]] || { log "missing after unpacking: $f (are all of ${debs[*]} in $DEB_DIR?)"; exit 1; }
done
export LD_LIBRARY_PATH=$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
log "unpacked ${#deb_files[@]} .debs into $DEB_PREFIX"

# ---- configure, build ----------------------------------------------------------------------------
t=$(allow 180 200)  # configure takes seconds; an unfinished one means something is wrong
start=$SECONDS
echo "== configure (limit $t s)" >>"$build_log"
timeout -k 10 "$t" cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMFSDP_CUDA=ON \
  "-DCMAKE_PREFIX_PATH=$torch_prefix;$DEB_PREFIX/usr" \
  "-DCMAKE_LIBRARY_PATH=$libdir" "-DCMAKE_INCLUDE_PATH=$incdir" \
  "-DGTest_DIR=$libdir/cmake/GTest" "-DCMAKE_CXX_FLAGS=-isystem $incdir" \
  "-DMFSDP_PYTHON=$python" >>"$build_log" 2>&1
rc=$?
log "configure: $((SECONDS - start)) s, exit $rc"
if ((rc)); then
  log "configure failed (build.txt):"
  grep -B2 -A8 -m3 'CMake Error' "$build_log" | head -40 | tee -a "$summary"
  exit 1
fi
grep -E '^(SENTENCEPIECE_LIBRARY|SENTENCEPIECE_TRAIN_LIBRARY|GTest_DIR|NCCL_LIBRARY|Torch_DIR):' \
  "$BUILD_DIR/CMakeCache.txt" | tee -a "$summary"
if [[ $mode == configure ]]; then
  status=0
  exit 0
fi

t=$(allow "$BUDGET" 60)
start=$SECONDS
echo "== build, -j $(nproc) (limit $t s)" >>"$build_log"
timeout -k 10 "$t" cmake --build "$BUILD_DIR" -j "$(nproc)" >>"$build_log" 2>&1
rc=$?
log "build: $((SECONDS - start)) s, exit $rc$( ((rc == 124)) && echo ' (out of time)')"
if ((rc)); then
  log "build failed (build.txt); first errors:"
  grep -E -m20 'error|FAILED|undefined reference' "$build_log" | cut -c1-400 | tee -a "$summary"
  exit 1
fi

# ---- the GPU tier ----------------------------------------------------------------------------------
t=$(allow 150 10)
start=$SECONDS
gpu_only=()
[[ -n ${GPU_TESTS:-} ]] && gpu_only=(-R "$GPU_TESTS")
(cd "$BUILD_DIR" && timeout -k 5 "$t" ctest -L gpu "${gpu_only[@]}" --no-tests=error -V --timeout "$t") \
  >"$out/ctest_gpu.txt" 2>&1
rc=$?
log "GPU tests (ctest -L gpu): $(ctest_result "$out/ctest_gpu.txt"); $((SECONDS - start)) s, exit $rc"
grep -E '^ *[0-9]+/[0-9]+ Test' "$out/ctest_gpu.txt" | tee -a "$summary"
# On a GPU machine a skipped GPU test did not test anything: all skipped fails the tier.
ran=$(grep -cE '^ *[0-9]+/[0-9]+ Test.* Passed ' "$out/ctest_gpu.txt")
skipped=$(grep -cE '^ *[0-9]+/[0-9]+ Test.*Skipped' "$out/ctest_gpu.txt")
if ((rc == 0 && ran > 0)); then
  status=0
  ((skipped)) && log "warning: $skipped GPU test(s) skipped on this GPU machine (ctest_gpu.txt)"
elif ((rc == 0)); then
  log "GPU tier: no GPU test ran ($skipped skipped): the tier fails on a GPU machine"
  grep -m3 -E 'SKIPPED|needs a CUDA GPU' "$out/ctest_gpu.txt" | tee -a "$summary"
fi

gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if ((gpus < 2)); then
  log "multi-rank NCCL: NOT TESTED ($gpus GPU): NCCL cannot put two ranks on one GPU, so every collective ran at world size 1 (a local copy); see docs/building.md's support matrix"
fi

# ---- stream order under injected GPU sleeps ---------------------------------------------------------
# The FSDP tests that compare bits with a reference, again with every collective delayed on the
# communication stream, then with the compute stream delayed before each collective is ordered
# after it (MFSDP_DEBUG_STREAM_SLEEP, src/comm/nccl_communicator.cpp): a missing event wait then
# gives wrong bits deterministically, not once in a thousand runs.
sleep_tests='FsdpGpu[.](PrefetchOnCommStreamsGivesTheSameWeights|EveryStrategyMatchesSingleProcess)'
for where in comm compute; do
  t=$(allow 60 40)
  start=$SECONDS
  (cd "$BUILD_DIR" && MFSDP_DEBUG_STREAM_SLEEP=$where:${GPU_SLEEP_CYCLES:-20000000} \
     timeout -k 5 "$t" ctest -L gpu -R "$sleep_tests" --no-tests=error --output-on-failure --timeout "$t") \
    >"$work/sleep_$where.txt" 2>&1
  rc=$?
  { echo "== stream order, MFSDP_DEBUG_STREAM_SLEEP=$where"; cat "$work/sleep_$where.txt"; } >>"$out/checks.txt"
  log "stream order with a GPU sleep on the $where stream ($sleep_tests): $(ctest_result "$work/sleep_$where.txt"); $((SECONDS - start)) s, exit $rc (checks.txt)"
  ((rc)) && status=1
done

# ---- compute-sanitizer memcheck --------------------------------------------------------------------
# Memory freed while a stream still uses it, out-of-bounds kernels: the NCCL communicator's tests
# with the caching allocator off (PYTORCH_NO_CUDA_MEMORY_CACHING=1, so that every free is real).
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
t=$(allow 90 30)
if [[ -z $sanitizer ]]; then
  log "memcheck: not run, compute-sanitizer not found"
elif ((t < 30)); then
  log "memcheck: skipped, $t s left for it"
else
  start=$SECONDS
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout -k 5 "$t" "$sanitizer" --tool memcheck --error-exitcode 3 \
    "$BUILD_DIR/tests/gpu_tests" \
    --gtest_filter='NcclCommunicator.CollectivesOnCudaTensors:NcclCommunicator.PrescaleAndBothLowPrecisionSums:NcclCommunicator.SplitGroupsWorkAndTheirMemoryIsRecorded' \
    >"$work/memcheck.txt" 2>&1
  rc=$?
  { echo "== memcheck"; cat "$work/memcheck.txt"; } >>"$out/checks.txt"
  case $rc in
    0) log "memcheck (compute-sanitizer, NCCL communicator tests): no errors; $((SECONDS - start)) s" ;;
    3) log "memcheck: ERRORS found (checks.txt)"; grep -m10 -E '=========' "$work/memcheck.txt" | tee -a "$summary"; status=1 ;;
    *) log "memcheck: did not complete, exit $rc (refused by this machine or out of time; checks.txt):"
       tail -5 "$work/memcheck.txt" | cut -c1-300 | tee -a "$summary" ;;
  esac
fi

# The carried wheels whose module this Python cannot import yet, into $1 (for PYTHONPATH).
install_wheels() {  # dir
  local whl module
  for whl in "$DEB_DIR"/wheels/*.whl; do
    [[ -e $whl ]] || continue
    module=${whl##*/} && module=${module%%-*}  # the distribution name, '-' as '_': the module here
    if "$python" -c "import $module" 2>/dev/null; then
      log "wheel ${whl##*/}: not installed, $python imports $module already"
    elif "$python" -m pip install -q --no-deps --no-index --target "$1" "$whl" >>"$out/system.txt" 2>&1 ||
         "$python" -m zipfile -e "$whl" "$1"; then  # no pip: a pure-Python wheel is its files
      log "wheel ${whl##*/}: installed into $1"
    else
      log "wheel ${whl##*/}: could not be installed (system.txt)"
    fi
  done
}

# ---- GPU benchmarks ----------------------------------------------------------------------------------
mkdir -p "$work/raw"
if ((GPU_BENCH)); then
  t=$(allow 100 100)
  if ((t >= 40)); then
    start=$SECONDS
    mkdir -p "$work/raw/collectives"
    BUILD=$BUILD_DIR PYTHON=$python BACKEND=nccl ROUNDS=${CB_ROUNDS:-3} TMPDIR=$work/raw/collectives \
      timeout -k 5 "$t" bench/collective_bandwidth.sh --max-bytes "${CB_MAX_BYTES:-256M}" \
      >"$work/raw/bench_collectives.txt" 2>&1
    rc=$?
    log "collective bandwidth, NCCL, ours vs c10d nccl: exit $rc, $((SECONDS - start)) s (bench_raw.tar.gz raw/bench_collectives.txt)"
    sed -n '/^# median over/,$p' "$work/raw/bench_collectives.txt" | grep -v '^# raw outputs' | tee -a "$summary"
  else
    log "collective bandwidth: skipped, $t s left for it"
  fi
  site=$work/site
  install_wheels "$site"
  # One GPU, then all: gpu_step_time.sh once per value, each under what the budget leaves.
  nprocs=(1)
  ((gpus > 1)) && nprocs+=("$gpus")
  for n in "${nprocs[@]}"; do
    t=$(allow 240 10)
    if ((t >= 60)); then
      start=$SECONDS
      # The tables to bench_step_time.txt, the progress and any failure's output to the raw files.
      NPROC=$n BUILD=$BUILD_DIR PYTHON=$python OUT=$work/raw/step_time PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} \
        timeout -k 5 "$t" bench/gpu_step_time.sh >>"$out/bench_step_time.txt" 2>"$work/raw/step_time_$n.log"
      rc=$?
      log "step time on $n GPU(s), mfsdp vs DDP, FSDP2, Megatron-FSDP: exit $rc, $((SECONDS - start)) s (bench_step_time.txt; progress: bench_raw.tar.gz raw/step_time_$n.log)"
      ((rc)) && tail -15 "$work/raw/step_time_$n.log" | cut -c1-400 | tee -a "$summary"
    else
      log "step time on $n GPU(s): skipped, $t s left for it"
    fi
  done
  # The MoE block on the GPU: one GEMM per expert against the grouped GEMM (at::_grouped_mm, bf16)
  # and a dense model of equal active parameters (bench/moe_step_time.sh), one rank per GPU.
  t=$(allow 90 10)
  if ((t >= 40)); then
    start=$SECONDS
    DEVICE=cuda NPROC=$(( gpus > 1 ? 2 : 1 )) RUNS="ep1 $( ((gpus > 1)) && echo ep2) grouped dense" EXTRA=--bf16 \
      ROUNDS=2 BUILD=$BUILD_DIR PYTHON=$python OUT=$work/raw/moe \
      timeout -k 5 "$t" bench/moe_step_time.sh >"$work/raw/bench_moe.txt" 2>"$work/raw/moe.log"
    rc=$?
    log "MoE step time on the GPU, per-expert vs grouped GEMM vs dense: exit $rc, $((SECONDS - start)) s (bench_raw.tar.gz raw/bench_moe.txt)"
    tee -a "$summary" <"$work/raw/bench_moe.txt"
    ((rc)) && tail -15 "$work/raw/moe.log" | cut -c1-400 | tee -a "$summary"
  else
    log "MoE step time: skipped, $t s left for it"
  fi
  # Tensor and pipeline parallelism on GPUs: 20-iteration smoke runs of TP 2 with sequence
  # parallelism, and of PP 2 (Megatron's 1F1B, NCCL send/recv between the stages, tied embeddings
  # kept in sync over the first and last stage), each x DP 2 where there are 4 GPUs, bf16. Both
  # need one GPU per rank: on one GPU they are recorded as not run, never run on the CPU instead.
  # smoke NAME WHAT GLOBAL_BATCH FLAGS...
  smoke() {
    local name=$1 what=$2 gbs=$3; shift 3
    t=$(allow 60 10)
    if ((gpus < 2)); then
      log "$name smoke: not run, it needs 2 GPUs and this machine has $gpus"
    elif ((t >= 30)); then
      local start=$SECONDS ranks=$(( gpus >= 4 ? 4 : 2 )) file=$work/raw/${name,,}_smoke.txt
      timeout -k 5 "$t" "$BUILD_DIR/mfsdp-run" --nproc-per-node "$ranks" "$BUILD_DIR/mfsdp-pretrain" --device cuda --bf16 \
        --mock-data --vocab-size 32000 --num-layers 4 --hidden-size 1024 --ffn-hidden-size 4096 \
        --num-attention-heads 16 --group-query-attention --num-query-groups 8 --swiglu --seq-length 1024 \
        --max-position-embeddings 1024 --micro-batch-size 2 --global-batch-size $((ranks * gbs)) --train-iters 20 \
        --lr 3e-4 --log-interval 5 "$@" >"$file" 2>&1
      local rc=$?
      log "$name smoke on $ranks GPUs ($what, bf16): exit $rc, $((SECONDS - start)) s (bench_raw.tar.gz raw/${name,,}_smoke.txt)"
      grep -E 'parallelism:|iteration +(5|20)/' "$file" | cut -c1-300 | tee -a "$summary"
    else
      log "$name smoke: skipped, $t s left for it"
    fi
  }
  smoke TP "TP 2, sequence parallel" 1 --tensor-model-parallel-size 2 --sequence-parallel
  smoke PP "PP 2, 1F1B" 4 --pipeline-model-parallel-size 2
  # Where run b's step goes: iterations 5..6 of it under --profile --use-pytorch-profiler, the
  # trace summed by bench/trace_summary.py (into bench_step_time.txt; the trace itself, gzipped,
  # into bench_raw.tar.gz when under 8 MiB).
  t=$(allow 120 10)
  if ((GPU_PROFILE && t >= 40)); then
    start=$SECONDS
    trace_dir=$work/raw/profile/trace
    NPROC=1 RUNS=b ROUNDS=1 ITERS=6 WARMUP=2 BUILD=$BUILD_DIR PYTHON=$python OUT=$work/raw/profile \
      MFSDP_EXTRA_ARGS="--profile --use-pytorch-profiler --profile-step-start 4 --profile-step-end 6 --tensorboard-dir $trace_dir" \
      timeout -k 5 "$t" bench/gpu_step_time.sh >/dev/null 2>"$work/raw/profile.log"
    rc=$?
    trace=$(ls "$trace_dir"/*.pt.trace.json 2>/dev/null | head -1)
    if [[ -n $trace ]]; then
      { echo; echo "== profile of run b, iterations 5..6 (bench/trace_summary.py)"
        "$python" bench/trace_summary.py "$trace" --top 30; } >>"$out/bench_step_time.txt" 2>&1
      gzip -f "$trace" && (($(stat -c %s "$trace.gz") < (8 << 20))) || rm -f "$trace.gz"
    fi
    log "profile of run b: exit $rc, $((SECONDS - start)) s, trace ${trace:+written}${trace:-missing} (bench_step_time.txt)"
    ((rc)) && tail -15 "$work/raw/profile.log" | cut -c1-400 | tee -a "$summary"
  else
    log "profile of run b: skipped (GPU_PROFILE=$GPU_PROFILE, $t s left)"
  fi
  cat "$out/bench_step_time.txt" >>"$summary"
else
  log "benchmarks: skipped (GPU_BENCH=0)"
fi

# ---- the rest of the suite, while time remains ---------------------------------------------------
t=$(allow 100000 10)
if [[ $mode == correctness ]]; then
  log "rest of the suite: not run (--correctness)"
elif ((t >= 60)); then
  start=$SECONDS
  # Not the README-command tests nor the no-CUDA-toolkit install test: they run scripts/setup.sh,
  # which installs Debian packages and wheels, and the GPU machine has no network.
  only=(-E '^ReadmeCommands[.]|^Install[.]NoCudaToolkit$')
  [[ -n ${REST_TESTS:-} ]] && only+=(-R "$REST_TESTS")
  total=$(cd "$BUILD_DIR" && ctest -N -LE gpu "${only[@]}" | sed -n 's/^Total Tests: //p')
  stop=$(date -d "@$(($(date +%s) + t - 5))" +%H:%M:%S)
  (cd "$BUILD_DIR" && timeout -k 5 "$t" ctest -LE gpu "${only[@]}" -j "$CTEST_JOBS" --timeout 300 --stop-time "$stop" \
     --output-on-failure) >"$out/ctest_all.txt" 2>&1
  rc=$?
  log "rest of the suite (ctest -LE gpu -j $CTEST_JOBS, $total tests, $t s allowed): $(ctest_result "$out/ctest_all.txt"); $((SECONDS - start)) s, exit $rc"
  grep -A40 'The following tests' "$out/ctest_all.txt" | head -40 | tee -a "$summary"
else
  log "rest of the suite: skipped, $t s left"
fi
