#!/usr/bin/env bash
# CPU step time of mfsdp-pretrain side by side with PyTorch FSDP2 and DDP of the project's torch:
# the same Llama, global batch, micro-batches, sequence length and threads per rank, in fp32 and
# in bf16, interleaved round after round, with per-rank peak RSS and model FLOPs utilisation
# against this machine's measured matmul peak.
#
#   bench/cpu_step_time.sh                                          # default model (below)
#   LAYERS=12 HIDDEN=768 FFN=2048 HEADS=12 ITERS=8 WARMUP=2 bench/cpu_step_time.sh   # compute-bound
#   LAYERS=1 HIDDEN=64 FFN=176 HEADS=4 ITERS=6 WARMUP=2 bench/cpu_step_time.sh       # smoke test
#   RUNS="a b c d f g h k x e p q" bench/cpu_step_time.sh                            # every run
#
# Runs (RUNS picks them; NPROC ranks, THREADS threads per rank; defaults 2 and 1):
#   a  mfsdp, 1 rank x THREADS threads, BASELINE_STRATEGY (optim_grads_params): scaling baseline
#   b  mfsdp, ZeRO-3 (optim_grads_params), prefetch on (the default)
#   c  mfsdp, ZeRO-3, --no-fsdp-prefetch --no-fsdp-all-gather-in-start-param-sync (no overlap)
#   d  mfsdp, no_shard (DDP-like)
#   f  mfsdp, ZeRO-3, --fsdp-trace-pool;  g  mfsdp, ZeRO-3, --fsdp-double-buffer
#   h  mfsdp, ZeRO-3 with MFSDP_SHM=0: collectives over loopback TCP instead of shared memory
#   k  mfsdp, ZeRO-3 with MFSDP_KEEP_FREED_MEMORY=0: glibc's default of returning freed blocks
#   x  mfsdp, ZeRO-3 with --optimizer-implementation fused (at::_fused_adamw_)
#   e  PyTorch DDP over gloo (bench/torch_llama.py --impl ddp); bf16: torch.autocast
#   p  PyTorch FSDP2 over gloo (bench/torch_llama.py --impl fsdp2: fully_shard per block and the
#      root, reshard_after_forward=True); bf16: MixedPrecisionPolicy(bf16 params, fp32 reduce)
#   q  as p, with glibc keeping freed memory as mfsdp does (GLIBC_TUNABLES; include/mfsdp/train/cpu_malloc.h)
#   r  Megatron-FSDP itself (bench/torch_llama.py --impl megatron_fsdp, the megatron-fsdp package;
#      DEVICE=cuda only: it cannot run without CUDA; skipped with a note when it is not importable)
#   A, B  as a and b with the binaries of OLD_BUILD (another commit's build folder): is the step
#      slower or faster than that commit's, in the same rounds? (RUNS="a b A B e")
# DEVICE=cuda (bench/gpu_step_time.sh sets it) runs the same on GPUs, one rank per GPU, nccl;
# the peak is then PEAK_TFLOPS (bf16 dense, from the GPU's datasheet) and the memory column is
# the peak allocated by the CUDA caching allocator (mfsdp: rank 0's; PyTorch: every rank's).
# Precisions (PRECISIONS): fp32; bf16 = bf16 parameters and compute with fp32 main weights,
# gradients, reductions and AdamW state on every side (mfsdp --bf16).
# Each run trains ITERS iterations on random tokens; the first WARMUP are left out; all rounds'
# timed iterations are pooled and their median reported (mfsdp: iter_time_s of --metrics-file
# with --log-interval 1). tokens/s = global batch x seq / median iteration time. TFLOP/s per rank
# is Megatron's formula (bench/llama_flops.py, as mfsdp's metrics); MFU divides it by the matmul
# peak measured first (bench/matmul_speed.py --peak: NPROC concurrent processes x THREADS threads,
# torch.matmul in the precision of the run, from the libtorch_cpu.so mfsdp links).
# Peak RSS per rank: mfsdp ranks run under bench/peak_rss.py (getrusage of the rank process);
# torch_llama.py measures its ranks itself. The runtimes' own buffer figures follow the table.
#
# Environment (defaults in brackets):
#   LAYERS [4] HIDDEN [256] FFN [704] HEADS [8] QUERY_GROUPS [HEADS] (--group-query-attention is
#   passed only when QUERY_GROUPS < HEADS; GROUPS is a bash builtin, hence the name)
#   SEQ [128] MBS [4] GBS [16] VOCAB [1024] VOCAB_DIVISIBLE [128] UNTIE [0] ITERS [30]
#   WARMUP [5] LR [1e-4] NPROC [2] THREADS [1] ROUNDS [1] RUNS [a b d e p] PRECISIONS [fp32 bf16]
#   BASELINE_STRATEGY [optim_grads_params] BUILD [<repo>/build] PYTHON [<repo>/.venv/bin/python]
#   OLD_BUILD [unset; runs A and B need it]
#   DEVICE [cpu] PEAK_TFLOPS [DEVICE=cuda: required] PEAK_TFLOPS_FP32 [PEAK_TFLOPS / 2]
#   OUT [a new temporary folder; kept] MFSDP_EXTRA_ARGS [] (appended to every mfsdp-pretrain
#   command line)
# Exit status: 0 when every run that was not skipped succeeded; 1 when one failed (its output
# is shown); 2 on bad settings or missing binaries.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${BUILD:-$ROOT/build}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
LAYERS=${LAYERS:-4}
HIDDEN=${HIDDEN:-256}
FFN=${FFN:-704}
HEADS=${HEADS:-8}
QUERY_GROUPS=${QUERY_GROUPS:-$HEADS}
SEQ=${SEQ:-128}
MBS=${MBS:-4}
GBS=${GBS:-16}
VOCAB=${VOCAB:-1024}
VOCAB_DIVISIBLE=${VOCAB_DIVISIBLE:-128}
UNTIE=${UNTIE:-0}
ITERS=${ITERS:-30}
WARMUP=${WARMUP:-5}
LR=${LR:-1e-4}
NPROC=${NPROC:-2}
THREADS=${THREADS:-1}
ROUNDS=${ROUNDS:-1}
RUNS=${RUNS:-a b d e p}
PRECISIONS=${PRECISIONS:-fp32 bf16}
BASELINE_STRATEGY=${BASELINE_STRATEGY:-optim_grads_params}
MFSDP_EXTRA_ARGS=${MFSDP_EXTRA_ARGS:-}
OUT=${OUT:-}
DEVICE=${DEVICE:-cpu}
# What include/mfsdp/train/cpu_malloc.h sets with mallopt, as glibc tunables for the Python peer (q).
KEEP_FREED_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647

die() { echo "cpu_step_time.sh: $*" >&2; exit 2; }
# shellcheck source=bench/step_time_model.sh
source "$ROOT/bench/step_time_model.sh"
check_step_time_settings
[[ $DEVICE == cpu || $DEVICE == cuda ]] || die "DEVICE=$DEVICE: expected cpu or cuda"
for r in $RUNS; do
  [[ $r =~ ^[abcdfghkxepqrAB]$ ]] || die "RUNS: unknown run '$r' (known: a b c d f g h k x e p q r A B)"
  [[ $r =~ ^[AB]$ && ! -x ${OLD_BUILD:-}/mfsdp-pretrain ]] && die "RUNS: run $r needs OLD_BUILD, a build folder with mfsdp-pretrain"
done
for p in $PRECISIONS; do
  [[ $p == fp32 || $p == bf16 ]] || die "PRECISIONS: unknown precision '$p' (fp32, bf16)"
done
step_time_out_dir cpu_step_time
MFSDP_ARGS=("${MODEL_ARGS[@]}" --mock-data --eval-iters 0 --eval-interval 1000 --log-interval 1)
# shellcheck disable=SC2206  # word splitting of the extra flags is intended
MFSDP_ARGS+=($MFSDP_EXTRA_ARGS)
if [[ $DEVICE == cuda ]]; then
  [[ ${PEAK_TFLOPS:-} =~ ^[0-9.]+$ ]] || die "DEVICE=cuda needs PEAK_TFLOPS (the GPU's dense bf16 peak)"
  MFSDP_ARGS+=(--device cuda)
  TORCH_ARGS+=(--device cuda)
fi
SKIP_R=""
if [[ $DEVICE != cuda ]]; then
  SKIP_R="megatron-fsdp cannot run without CUDA (MegatronFSDP.__init__ calls torch.cuda.current_device())"
elif ! "$PYTHON" -c 'import megatron_fsdp' 2>/dev/null; then
  SKIP_R="$PYTHON cannot import megatron_fsdp (pip install megatron-fsdp; scripts/gpu_check.sh carries it)"
fi
NO_OVERLAP_FLAGS=(--no-fsdp-prefetch --no-fsdp-all-gather-in-start-param-sync)
TORCH_VERSION=$("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null) ||
  die "$PYTHON cannot import torch; run scripts/setup.sh (it installs the pinned torch into .venv)"

fail() {  # label log
  echo "cpu_step_time.sh: run $1 failed; its output ($2):" >&2
  cat "$2" >&2
  exit 1
}

run_mfsdp() {  # label round precision nproc strategy [flags...]
  local label=$1 round=$2 precision=$3 n=$4 strategy=$5
  shift 5
  local base="$OUT/$label.$precision.r$round" flags=()
  [[ $precision == bf16 ]] && flags=(--bf16)
  echo "  [$label] $precision round $round: mfsdp $n rank(s) x $THREADS thread(s), $strategy $*" >&2
  local build=${RUN_BUILD:-$BUILD}
  env ${RUN_ENV:-} OMP_NUM_THREADS="$THREADS" "$build/mfsdp-run" --nproc-per-node "$n" \
    "$PYTHON" "$ROOT/bench/peak_rss.py" "$build/mfsdp-pretrain" \
    "${MFSDP_ARGS[@]}" "${flags[@]}" --data-parallel-sharding-strategy "$strategy" "$@" \
    --metrics-file "$base.jsonl" >"$base.log" 2>&1 || fail "$label" "$base.log"
  [[ -s $base.jsonl ]] || fail "$label (no metrics written)" "$base.log"
}

run_torch() {  # label round precision impl
  local label=$1 round=$2 precision=$3 impl=$4 base="$OUT/$1.$3.r$2" flags=()
  [[ $precision == bf16 ]] && flags=(--bf16)
  echo "  [$label] $precision round $round: PyTorch $impl $NPROC ranks x $THREADS thread(s) ${RUN_ENV:-}" >&2
  env ${RUN_ENV:-} OMP_NUM_THREADS="$THREADS" "$PYTHON" "$ROOT/bench/torch_llama.py" --impl "$impl" \
    "${TORCH_ARGS[@]}" "${flags[@]}" >"$base.json" 2>"$base.log" ||
    { cat "$base.json" >>"$base.log"; fail "$label" "$base.log"; }
  grep -q '"iter_times_s"' "$base.json" || fail "$label (no result line)" "$base.json"
}

run() {  # label round precision
  local label=$1 round=$2 precision=$3 zero3=optim_grads_params
  case $label in
    a) run_mfsdp a "$round" "$precision" 1 "$BASELINE_STRATEGY" ;;
    b) run_mfsdp b "$round" "$precision" "$NPROC" $zero3 ;;
    c) run_mfsdp c "$round" "$precision" "$NPROC" $zero3 "${NO_OVERLAP_FLAGS[@]}" ;;
    d) run_mfsdp d "$round" "$precision" "$NPROC" no_shard ;;
    f) run_mfsdp f "$round" "$precision" "$NPROC" $zero3 --fsdp-trace-pool ;;
    g) run_mfsdp g "$round" "$precision" "$NPROC" $zero3 --fsdp-double-buffer ;;
    h) RUN_ENV=MFSDP_SHM=0 run_mfsdp h "$round" "$precision" "$NPROC" $zero3 ;;
    k) RUN_ENV=MFSDP_KEEP_FREED_MEMORY=0 run_mfsdp k "$round" "$precision" "$NPROC" $zero3 ;;
    x) run_mfsdp x "$round" "$precision" "$NPROC" $zero3 --optimizer-implementation fused ;;
    A) RUN_BUILD=$OLD_BUILD run_mfsdp A "$round" "$precision" 1 "$BASELINE_STRATEGY" ;;
    B) RUN_BUILD=$OLD_BUILD run_mfsdp B "$round" "$precision" "$NPROC" $zero3 ;;
    e) run_torch e "$round" "$precision" ddp ;;
    p) run_torch p "$round" "$precision" fsdp2 ;;
    q) RUN_ENV=GLIBC_TUNABLES=$KEEP_FREED_TUNABLES run_torch q "$round" "$precision" fsdp2 ;;
    r) [[ -z $SKIP_R ]] && run_torch r "$round" "$precision" megatron_fsdp ;;
  esac
}

echo "cpu_step_time.sh: outputs in $OUT" >&2
if [[ $DEVICE == cuda ]]; then
  printf '{"what": "%s", "bf16_gflops": %s, "fp32_gflops": %s}\n' \
    "dense peak per GPU from its datasheet (PEAK_TFLOPS)" "$(awk "BEGIN{print $PEAK_TFLOPS * 1000}")" \
    "$(awk "BEGIN{print ${PEAK_TFLOPS_FP32:-$PEAK_TFLOPS / 2} * 1000}")" >"$OUT/peak.json"
else
  echo "  matmul peak: $NPROC processes x $THREADS thread(s)" >&2
  OMP_NUM_THREADS=$THREADS "$PYTHON" "$ROOT/bench/matmul_speed.py" --peak --nproc "$NPROC" \
    --threads "$THREADS" >"$OUT/peak.json" 2>"$OUT/peak.log" || fail "matmul peak" "$OUT/peak.log"
fi
for ((r = 1; r <= ROUNDS; ++r)); do
  for precision in $PRECISIONS; do
    for label in $RUNS; do run "$label" "$r" "$precision"; done
  done
done

cpu_model=$(grep -m1 '^model name' /proc/cpuinfo 2>/dev/null | sed 's/^[^:]*: *//')
if [[ $DEVICE == cuda ]]; then
  cpu_model="$NPROC x $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1) (host: $cpu_model)"
fi
commit=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
git -C "$ROOT" diff --quiet HEAD 2>/dev/null || commit="$commit (+ uncommitted changes)"
export OUT WARMUP ITERS GBS SEQ NPROC THREADS BASELINE_STRATEGY ROUNDS RUNS PRECISIONS DEVICE SKIP_R
export LAYERS HIDDEN FFN HEADS QUERY_GROUPS VOCAB VOCAB_DIVISIBLE UNTIE OLD_BUILD=${OLD_BUILD:-}
export MACHINE_NPROC=$(nproc) CPU_MODEL=${cpu_model:-unknown} COMMIT=$commit
export DATE=$(date -u '+%Y-%m-%d %H:%M UTC') LOADAVG=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)
export TORCH_VERSION MODEL_DESC="${MODEL_ARGS[*]}"
"$PYTHON" "$ROOT/bench/cpu_step_time_summary.py" || exit 1
