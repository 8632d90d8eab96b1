#!/usr/bin/env bash
# GPU step time of mfsdp-pretrain against PyTorch DDP, same model, global batch and sequence
# length, one rank per GPU, on this machine.
#
#   bench/gpu_step_time.sh                                  # default model (below), bf16
#   BF16=0 bench/gpu_step_time.sh                           # fp32 compute on both sides
#   LAYERS=2 HIDDEN=256 FFN=704 HEADS=8 SEQ=256 VOCAB=1024 ITERS=6 WARMUP=2 bench/gpu_step_time.sh
#
# Runs (NPROC ranks, one per GPU, THREADS CPU threads per rank):
#   m  mfsdp-pretrain --device cuda under mfsdp-run, --data-parallel-sharding-strategy STRATEGY
#      (optim_grads_params: ZeRO-3), --bf16 when BF16=1 (bf16 compute, fp32 main weights/grads)
#   t  PyTorch DDP over nccl (bench/torch_llama.py --device cuda), same model and batch
#      layout; --bf16 there is torch.autocast(bfloat16) with fp32 parameters
# Each run trains ITERS iterations on random tokens; the first WARMUP are left out and the
# median iteration time of the rest is reported (mfsdp: iter_time_s of --metrics-file with
# --log-interval 1). With ROUNDS > 1 the two runs alternate round after round and the timed
# iterations of all rounds are pooled. tokens/s = global batch x seq / median iteration time.
# On one GPU both are a world of 1 rank: this then compares the per-GPU compute paths (and
# mfsdp's sharding bookkeeping), not communication.
#
# Environment (defaults in brackets):
#   LAYERS [8] HIDDEN [1024] FFN [2816] HEADS [16] QUERY_GROUPS [HEADS] SEQ [1024] MBS [4]
#   GBS [MBS x NPROC] VOCAB [32000] VOCAB_DIVISIBLE [128] UNTIE [0] ITERS [20] WARMUP [5]
#   LR [1e-4] BF16 [1] NPROC [the number of GPUs, nvidia-smi -L] THREADS [4] ROUNDS [1]
#   STRATEGY [optim_grads_params] BUILD [<repo>/build]
#   PYTHON [<repo>/.venv/bin/python if present, else python3] OUT [a new temporary folder; kept]
#   MFSDP_EXTRA_ARGS [] (appended to the mfsdp-pretrain command line)
# Exit status: 0 when every run that was not skipped succeeded (mfsdp is skipped, with a note,
# when its mfsdp-pretrain has no --device flag; PyTorch when PYTHON cannot import torch with
# CUDA); 1 when one failed (its output is shown); 2 on bad settings, no GPU or missing binaries.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${BUILD:-$ROOT/build}
if [[ -z ${PYTHON:-} ]]; then
  PYTHON=$ROOT/.venv/bin/python
  [[ -x $PYTHON ]] || PYTHON=python3
fi
die() { echo "gpu_step_time.sh: $*" >&2; exit 2; }
if [[ -z ${NPROC:-} ]]; then
  NPROC=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  ((NPROC > 0)) || die "nvidia-smi -L lists no GPU (set NPROC to override)"
fi
LAYERS=${LAYERS:-8}
HIDDEN=${HIDDEN:-1024}
FFN=${FFN:-2816}
HEADS=${HEADS:-16}
QUERY_GROUPS=${QUERY_GROUPS:-$HEADS}
SEQ=${SEQ:-1024}
MBS=${MBS:-4}
GBS=${GBS:-$((MBS * NPROC))}
VOCAB=${VOCAB:-32000}
VOCAB_DIVISIBLE=${VOCAB_DIVISIBLE:-128}
UNTIE=${UNTIE:-0}
ITERS=${ITERS:-20}
WARMUP=${WARMUP:-5}
LR=${LR:-1e-4}
BF16=${BF16:-1}
THREADS=${THREADS:-4}
ROUNDS=${ROUNDS:-1}
STRATEGY=${STRATEGY:-optim_grads_params}
MFSDP_EXTRA_ARGS=${MFSDP_EXTRA_ARGS:-}
OUT=${OUT:-}

[[ $BF16 == 0 || $BF16 == 1 ]] || die "BF16=$BF16: expected 0 or 1"
# shellcheck source=bench/step_time_model.sh
source "$ROOT/bench/step_time_model.sh"
check_step_time_settings
step_time_out_dir gpu_step_time
TORCH_ARGS+=(--device cuda)

MFSDP_ARGS=("${MODEL_ARGS[@]}" --mock-data --eval-iters 0 --eval-interval 1000 --log-interval 1
            --device cuda --data-parallel-sharding-strategy "$STRATEGY")
((BF16)) && MFSDP_ARGS+=(--bf16)
# shellcheck disable=SC2206  # word splitting of the extra flags is intended
MFSDP_ARGS+=($MFSDP_EXTRA_ARGS)
((BF16)) && TORCH_ARGS+=(--bf16)

# Which runs can happen.
SKIP_M="" missing=""
help_text=$("$BUILD/mfsdp-pretrain" --help 2>&1)
for f in --device --bf16; do
  grep -q -- "$f" <<<"$help_text" || missing+=" $f"
done
[[ -n $missing ]] &&
  SKIP_M="skipped: $BUILD/mfsdp-pretrain does not know$missing yet (rebuild, then rerun)"
SKIP_T=""
TORCH_VERSION=$("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null) ||
  SKIP_T="skipped: $PYTHON cannot import torch"
[[ -z $SKIP_T ]] && ! "$PYTHON" -c 'import sys, torch; sys.exit(torch.cuda.device_count() < 1)' 2>/dev/null &&
  SKIP_T="skipped: torch $TORCH_VERSION of $PYTHON sees no GPU"

fail() {  # label log
  echo "gpu_step_time.sh: run $1 failed; its output ($2):" >&2
  cat "$2" >&2
  exit 1
}

run_mfsdp() {  # round
  local base="$OUT/m.r$1"
  echo "  [m] round $1: mfsdp $NPROC rank(s), one GPU each, $STRATEGY, bf16 $BF16" >&2
  OMP_NUM_THREADS=$THREADS "$BUILD/mfsdp-run" --nproc-per-node "$NPROC" "$BUILD/mfsdp-pretrain" \
    "${MFSDP_ARGS[@]}" --metrics-file "$base.jsonl" >"$base.log" 2>&1 || fail m "$base.log"
  [[ -s $base.jsonl ]] || fail "m (no metrics written)" "$base.log"
}

run_torch() {  # round
  local base="$OUT/t.r$1"
  echo "  [t] round $1: PyTorch DDP $NPROC rank(s), one GPU each, nccl, bf16 $BF16" >&2
  OMP_NUM_THREADS=$THREADS "$PYTHON" "$ROOT/bench/torch_llama.py" "${TORCH_ARGS[@]}" \
    >"$base.json" 2>"$base.log" || { cat "$base.json" >>"$base.log"; fail t "$base.log"; }
  grep -q '"impl": "torch_ddp"' "$base.json" || fail "t (no result line)" "$base.json"
}

echo "gpu_step_time.sh: outputs in $OUT" >&2
for ((r = 1; r <= ROUNDS; ++r)); do
  [[ -z $SKIP_M ]] && run_mfsdp "$r"
  [[ -z $SKIP_T ]] && run_torch "$r"
done

# Summary: pooled timed iterations per run -> table and ratio.
GPU_MODEL=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null |
            head -1)
commit=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
git -C "$ROOT" diff --quiet HEAD 2>/dev/null || commit="$commit (+ uncommitted changes)"
DATE=$(date -u '+%Y-%m-%d %H:%M UTC')
export OUT WARMUP ITERS GBS SEQ NPROC BF16 STRATEGY SKIP_M SKIP_T ROUNDS DATE
export GPU_MODEL="${GPU_MODEL:-unknown}" COMMIT="$commit" TORCH_VERSION="${TORCH_VERSION:-none}"
export MODEL_DESC="${MODEL_ARGS[*]}"
"$PYTHON" - <<'EOF' || exit 1
import glob, json, os, re, statistics

env = os.environ
out, warmup = env["OUT"], int(env["WARMUP"])
tokens = int(env["GBS"]) * int(env["SEQ"])
n = int(env["NPROC"])

# Each returns (timed iterations of all rounds, final loss, median of each round, peak MiB).
def mfsdp_times(label):
    times, last, rounds, peak = [], None, [], None
    for path in sorted(glob.glob(os.path.join(out, label + ".r*.jsonl"))):
        recs = [json.loads(l) for l in open(path) if l.strip()]
        train = [r for r in recs if not r.get("eval")]
        timed = [r["iter_time_s"] for r in train if r["iteration"] > warmup]
        times += timed
        rounds += [statistics.median(timed)] if timed else []
        last = train[-1]["lm_loss"] if train else last
    logs = sorted(glob.glob(os.path.join(out, label + ".r*.log")))
    m = re.search(r"memory per rank \(MiB\):.*", open(logs[-1]).read()) if logs else None
    return times, last, rounds, (m.group(0) if m else None)

def torch_times(label):
    times, last, rounds, peak = [], None, [], None
    for path in sorted(glob.glob(os.path.join(out, label + ".r*.json"))):
        line = [l for l in open(path) if l.startswith("{")][-1]
        res = json.loads(line)
        times += res["iter_times_s"]
        rounds += [statistics.median(res["iter_times_s"])] if res["iter_times_s"] else []
        last = res["final_loss"]
        if res.get("peak_gpu_mib") is not None:
            peak = "peak GPU memory allocated (MiB) %.0f" % res["peak_gpu_mib"]
    return times, last, rounds, peak

bf16 = env["BF16"] == "1"
runs = [
    ("m", "mfsdp, %s%s" % (env["STRATEGY"], ", --bf16" if bf16 else ", fp32"), env["SKIP_M"], mfsdp_times),
    ("t", "PyTorch DDP, nccl%s%s" % (", autocast bf16" if bf16 else ", fp32",
                                     " (torch %s)" % env["TORCH_VERSION"] if env["TORCH_VERSION"] != "none" else ""),
     env["SKIP_T"], torch_times),
]

print("# GPU step time: mfsdp vs PyTorch DDP")
print()
print("- GPU: %d rank(s), one GPU each: %s" % (n, env["GPU_MODEL"]))
print("- date: %s; mfsdp commit %s" % (env["DATE"], env["COMMIT"]))
print("- model: %s, %s" % ("bf16 compute" if bf16 else "fp32", env["MODEL_DESC"]))
print("- timing: median iteration time over iterations %d..%s of %s round(s) (first %d are warm-up); "
      "tokens/s = %d tokens per global batch / median" % (warmup + 1, env["ITERS"], env["ROUNDS"], warmup, tokens))
print()
print("| run | impl | median ms | min ms | max ms | round medians ms | tokens/s | final loss |")
print("|---|---|---:|---:|---:|---:|---:|---:|")
res, notes = {}, []
for label, what, skip, get in runs:
    if skip:
        print("| %s | %s | - | - | - | - | - | %s |" % (label, what, skip))
        continue
    times, last, rounds, mem = get(label)
    if not times:
        raise SystemExit("gpu_step_time.sh: run %s has no timed iterations in %s" % (label, out))
    med = statistics.median(times)
    res[label] = med
    print("| %s | %s | %.1f | %.1f | %.1f | %s | %.0f | %.4f |"
          % (label, what, med * 1e3, min(times) * 1e3, max(times) * 1e3,
             " / ".join("%.1f" % (m * 1e3) for m in rounds), tokens / med, last))
    if mem:
        notes.append("%s: %s" % (label, mem))
print()
if "m" in res and "t" in res:
    print("Ratio torch/mfsdp: %.3f  (iter_time(t) / iter_time(m); > 1: mfsdp faster)" % (res["t"] / res["m"]))
else:
    print("Ratio torch/mfsdp: n/a (a run was skipped)")
for note in notes:
    print("Memory, rank 0, " + note)
EOF
