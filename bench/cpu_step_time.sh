#!/usr/bin/env bash
# CPU step time of mfsdp-pretrain against itself on 1 rank and against PyTorch DDP, same model,
# global batch, sequence length and threads per rank, on this machine.
#
#   bench/cpu_step_time.sh                                  # default model (below)
#   LAYERS=1 HIDDEN=64 FFN=176 HEADS=4 ITERS=6 WARMUP=2 bench/cpu_step_time.sh   # smoke test
#
# Runs (NPROC ranks, THREADS threads per rank; defaults 2 and 1):
#   a  mfsdp, 1 rank x THREADS threads, BASELINE_STRATEGY (optim_grads_params): scaling baseline
#   b  mfsdp, ZeRO-3 (optim_grads_params), prefetch on (the default)
#   c  mfsdp, ZeRO-3, --no-fsdp-prefetch --no-fsdp-all-gather-in-start-param-sync (no overlap)
#   d  mfsdp, no_shard (DDP-like), for reference
#   e  PyTorch DDP over gloo (bench/torch_ddp_llama.py), same model and batch layout
#   f  mfsdp, ZeRO-3, --fsdp-trace-pool;  g  mfsdp, ZeRO-3, --fsdp-double-buffer
#   h  mfsdp, ZeRO-3 with MFSDP_SHM=0: collectives over loopback TCP instead of shared memory
# Each run trains ITERS iterations on mock data; the first WARMUP are left out and the median
# iter_time_s of the rest is reported (mfsdp: --metrics-file with --log-interval 1). With
# ROUNDS > 1 the five runs are repeated round after round (interleaved) and the timed
# iterations of all rounds are pooled. tokens/s = global batch x seq / median iteration time.
#
# Environment (defaults in brackets):
#   LAYERS [4] HIDDEN [256] FFN [704] HEADS [8] QUERY_GROUPS [HEADS] (--group-query-attention is
#   passed only when QUERY_GROUPS < HEADS; GROUPS is a bash builtin, hence the name)
#   SEQ [128] MBS [4] GBS [16] VOCAB [1024] VOCAB_DIVISIBLE [128] UNTIE [0] ITERS [30]
#   WARMUP [5] LR [1e-4] NPROC [2] THREADS [1] ROUNDS [1] BASELINE_STRATEGY [optim_grads_params]
#   BUILD [<repo>/build] PYTHON [<repo>/.venv/bin/python] OUT [a new temporary folder; kept]
#   MFSDP_EXTRA_ARGS [] (appended to every mfsdp-pretrain command line)
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
BASELINE_STRATEGY=${BASELINE_STRATEGY:-optim_grads_params}
MFSDP_EXTRA_ARGS=${MFSDP_EXTRA_ARGS:-}
OUT=${OUT:-}

die() { echo "cpu_step_time.sh: $*" >&2; exit 2; }
# shellcheck source=bench/step_time_model.sh
source "$ROOT/bench/step_time_model.sh"
check_step_time_settings
((NPROC >= 2)) || die "NPROC=$NPROC: the comparison needs at least 2 ranks"
step_time_out_dir cpu_step_time
MFSDP_ARGS=("${MODEL_ARGS[@]}" --mock-data --eval-iters 0 --eval-interval 1000 --log-interval 1)
# shellcheck disable=SC2206  # word splitting of the extra flags is intended
MFSDP_ARGS+=($MFSDP_EXTRA_ARGS)

# Which runs can happen.
NO_OVERLAP_FLAGS=(--no-fsdp-prefetch --no-fsdp-all-gather-in-start-param-sync)
SKIP_C="" missing=""
help_text=$("$BUILD/mfsdp-pretrain" --help 2>&1)
for f in "${NO_OVERLAP_FLAGS[@]}"; do
  grep -q -- "$f" <<<"$help_text" || missing+=" $f"
done
[[ -n $missing ]] &&
  SKIP_C="skipped: $BUILD/mfsdp-pretrain does not know$missing yet (rebuild, then rerun)"
SKIP_E=""
TORCH_VERSION=$("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null) ||
  SKIP_E="skipped: $PYTHON cannot import torch; run scripts/setup.sh (it installs the pinned torch into .venv)"

fail() {  # label log
  echo "cpu_step_time.sh: run $1 failed; its output ($2):" >&2
  cat "$2" >&2
  exit 1
}

run_mfsdp() {  # label round nproc strategy [flags...]
  local label=$1 round=$2 n=$3 strategy=$4
  shift 4
  local base="$OUT/$label.r$round"
  echo "  [$label] round $round: mfsdp $n rank(s) x $THREADS thread(s), $strategy $*" >&2
  env ${RUN_ENV:-} OMP_NUM_THREADS="$THREADS" "$BUILD/mfsdp-run" --nproc-per-node "$n" "$BUILD/mfsdp-pretrain" \
    "${MFSDP_ARGS[@]}" --data-parallel-sharding-strategy "$strategy" "$@" \
    --metrics-file "$base.jsonl" >"$base.log" 2>&1 || fail "$label" "$base.log"
  [[ -s $base.jsonl ]] || fail "$label (no metrics written)" "$base.log"
}

run_torch() {  # label round
  local label=$1 round=$2 base="$OUT/$1.r$2"
  echo "  [$label] round $round: PyTorch DDP $NPROC ranks x $THREADS thread(s)" >&2
  OMP_NUM_THREADS=$THREADS "$PYTHON" "$ROOT/bench/torch_ddp_llama.py" "${TORCH_ARGS[@]}" \
    >"$base.json" 2>"$base.log" || { cat "$base.json" >>"$base.log"; fail "$label" "$base.log"; }
  grep -q '"impl": "torch_ddp"' "$base.json" || fail "$label (no result line)" "$base.json"
}

echo "cpu_step_time.sh: outputs in $OUT" >&2
for ((r = 1; r <= ROUNDS; ++r)); do
  run_mfsdp a "$r" 1 "$BASELINE_STRATEGY"
  run_mfsdp b "$r" "$NPROC" optim_grads_params
  [[ -z $SKIP_C ]] && run_mfsdp c "$r" "$NPROC" optim_grads_params "${NO_OVERLAP_FLAGS[@]}"
  run_mfsdp d "$r" "$NPROC" no_shard
  run_mfsdp f "$r" "$NPROC" optim_grads_params --fsdp-trace-pool
  run_mfsdp g "$r" "$NPROC" optim_grads_params --fsdp-double-buffer
  RUN_ENV=MFSDP_SHM=0 run_mfsdp h "$r" "$NPROC" optim_grads_params
  [[ -z $SKIP_E ]] && run_torch e "$r"
done

# Summary: pooled timed iterations per run -> table and ratios.
cpu_model=$(grep -m1 '^model name' /proc/cpuinfo 2>/dev/null | sed 's/^[^:]*: *//')
commit=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
git -C "$ROOT" diff --quiet HEAD 2>/dev/null || commit="$commit (+ uncommitted changes)"
export OUT WARMUP ITERS GBS SEQ NPROC THREADS BASELINE_STRATEGY SKIP_C SKIP_E ROUNDS
MACHINE_NPROC=$(nproc)
DATE=$(date -u '+%Y-%m-%d %H:%M UTC')
LOADAVG=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)
CPU_MODEL=${cpu_model:-unknown}
COMMIT=$commit
export MACHINE_NPROC CPU_MODEL DATE LOADAVG COMMIT
export TORCH_VERSION="${TORCH_VERSION:-none}" MODEL_DESC="${MODEL_ARGS[*]}"
"$PYTHON" - <<'EOF' || exit 1
import glob, json, os, statistics

env = os.environ
out, warmup = env["OUT"], int(env["WARMUP"])
tokens = int(env["GBS"]) * int(env["SEQ"])
n, t = int(env["NPROC"]), int(env["THREADS"])

# Each returns (timed iterations of all rounds, final loss, median of each round).
def mfsdp_times(label):
    times, last, rounds = [], None, []
    for path in sorted(glob.glob(os.path.join(out, label + ".r*.jsonl"))):
        recs = [json.loads(l) for l in open(path) if l.strip()]
        train = [r for r in recs if not r.get("eval")]
        timed = [r["iter_time_s"] for r in train if r["iteration"] > warmup]
        times += timed
        rounds += [statistics.median(timed)] if timed else []
        last = train[-1]["lm_loss"] if train else last
    return times, last, rounds

def torch_times(label):
    times, last, rounds = [], None, []
    for path in sorted(glob.glob(os.path.join(out, label + ".r*.json"))):
        line = [l for l in open(path) if l.startswith("{")][-1]
        res = json.loads(line)
        times += res["iter_times_s"]
        rounds += [statistics.median(res["iter_times_s"])] if res["iter_times_s"] else []
        last = res["final_loss"]
    return times, last, rounds

runs = [
    ("a", "mfsdp 1 rank (%s), scaling baseline" % env["BASELINE_STRATEGY"], "1 x %d" % t, None, mfsdp_times),
    ("b", "mfsdp ZeRO-3 (optim_grads_params), prefetch on", "%d x %d" % (n, t), None, mfsdp_times),
    ("c", "mfsdp ZeRO-3, --no-fsdp-prefetch --no-fsdp-all-gather-in-start-param-sync",
     "%d x %d" % (n, t), env["SKIP_C"], mfsdp_times),
    ("d", "mfsdp no_shard (DDP-like)", "%d x %d" % (n, t), None, mfsdp_times),
    ("f", "mfsdp ZeRO-3, prefetch, --fsdp-trace-pool", "%d x %d" % (n, t), None, mfsdp_times),
    ("g", "mfsdp ZeRO-3, prefetch, --fsdp-double-buffer", "%d x %d" % (n, t), None, mfsdp_times),
    ("h", "mfsdp ZeRO-3, prefetch, MFSDP_SHM=0 (loopback TCP)", "%d x %d" % (n, t), None, mfsdp_times),
    ("e", "PyTorch DDP, gloo" + (" (torch %s)" % env["TORCH_VERSION"] if env["TORCH_VERSION"] != "none" else ""), "%d x %d" % (n, t), env["SKIP_E"], torch_times),
]

print("# CPU step time: mfsdp vs 1 rank and vs PyTorch DDP")
print()
print("- machine: %s cores, %s, load average before summary %s" % (env["MACHINE_NPROC"], env["CPU_MODEL"], env["LOADAVG"]))
print("- date: %s; mfsdp commit %s" % (env["DATE"], env["COMMIT"]))
print("- model: fp32, %s" % env["MODEL_DESC"])
print("- timing: median iter_time_s over iterations %d..%s of %s round(s) (first %d are warm-up); "
      "tokens/s = %d tokens per global batch / median" % (warmup + 1, env["ITERS"], env["ROUNDS"], warmup, tokens))
print()
# Round medians show the machine's drift between rounds (compare runs within one round first).
print("| run | what | ranks x threads | median ms | min ms | max ms | round medians ms | tokens/s | final loss |")
print("|---|---|---|---:|---:|---:|---:|---:|---:|")
res = {}
for label, what, shape, skip, get in runs:
    if skip:
        print("| %s | %s | %s | - | - | - | - | - | %s |" % (label, what, shape, skip))
        continue
    times, last, rounds = get(label)
    if not times:
        raise SystemExit("cpu_step_time.sh: run %s has no timed iterations in %s" % (label, out))
    med = statistics.median(times)
    res[label] = med
    print("| %s | %s | %s | %.1f | %.1f | %.1f | %s | %.0f | %.4f |"
          % (label, what, shape, med * 1e3, min(times) * 1e3, max(times) * 1e3,
             " / ".join("%.0f" % (m * 1e3) for m in rounds), tokens / med, last))

def ratio(name, num, den, text):
    if num in res and den in res:
        print("- %s: %.3f  (%s)" % (name, res[den] / res[num] if text.startswith("tokens") else res[num] / res[den], text))
    else:
        print("- %s: n/a (run %s skipped)" % (name, num if num not in res else den))

print()
print("Ratios:")
ratio("scaling b/a", "b", "a", "tokens/s(b) / tokens/s(a); ideal %.1f" % n)
ratio("overlap gain c/b", "c", "b", "iter_time(c) / iter_time(b); > 1: prefetch and early all-gather help")
ratio("ZeRO-3 vs PyTorch DDP b/e", "b", "e", "tokens/s(b) / tokens/s(e); > 1: mfsdp faster")
ratio("no_shard vs PyTorch DDP d/e", "d", "e", "tokens/s(d) / tokens/s(e); > 1: mfsdp faster")
ratio("shared memory vs TCP h/b", "h", "b", "iter_time(h) / iter_time(b); > 1: the shared-memory path helps")
ratio("trace pool gain b/f", "b", "f", "iter_time(b) / iter_time(f); > 1: the pool helps")
ratio("double buffer gain b/g", "b", "g", "iter_time(b) / iter_time(g); > 1: double buffers help")
ratio("ZeRO-3 + trace pool vs PyTorch DDP f/e", "f", "e", "tokens/s(f) / tokens/s(e); > 1: mfsdp faster")

# Per-rank buffer memory of the ZeRO-3 runs, from rank 0's end-of-run report.
print()
print("Memory per rank (rank 0, MiB; mfsdp-pretrain's end-of-run report):")
print()
print("| run | model weights | main grads | optimizer state | transient peak | buffer pool | process peak RSS |")
print("|---|---:|---:|---:|---:|---:|---:|")
import re
for label in ("b", "f", "g", "d"):
    logs = sorted(glob.glob(os.path.join(out, label + ".r*.log")))
    text = open(logs[-1]).read() if logs else ""
    m = re.search(r"memory per rank \(MiB\): model weights ([0-9.e+-]+), main weights [0-9.e+-]+, main grads ([0-9.e+-]+), "
                  r"optimizer state ([0-9.e+-]+), transient peak ([0-9.e+-]+), buffer pool ([0-9.e+-]+), process peak RSS ([0-9.e+-]+)", text)
    if m:
        print("| %s | %s |" % (label, " | ".join("%.2f" % float(v) for v in m.groups())))
for label, _, _, skip, _ in runs:
    if skip:
        print()
        print("Note: run %s %s" % (label, skip))
EOF
