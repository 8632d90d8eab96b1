#!/usr/bin/env bash
# Tensor and context parallelism against data parallelism on this machine's 2 ranks (one core
# each): build/bench/parallel_llama in each mode, the modes alternating, ROUNDS rounds, and per
# mode the median over the rounds of the step time, the job's tokens/s (ratio to dp: > 1 faster),
# rank 0's persistent bytes and peak RSS (ratio to dp: < 1 leaner).
#
#   bench/parallel_llama.sh tp   # dp (ZeRO-3) vs tp vs tp_sp, compute-bound: seq 256, hidden 512
#   bench/parallel_llama.sh cp   # dp vs cp_allgather vs cp_ring, attention-bound: seq 4096
#
# Environment: ROUNDS [3] BUILD [<repo>/build]; extra flags after the set go to every run.
# Exit status: 0 on success, 1 when a run failed (its output is shown), 2 on bad settings.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${BUILD:-$ROOT/build}
ROUNDS=${ROUNDS:-3}
die() { echo "parallel_llama.sh: $*" >&2; exit 2; }
(($# >= 1)) || die "usage: bench/parallel_llama.sh tp|cp [flags]"
set_name=$1
shift
case $set_name in
  tp) modes=(dp tp tp_sp); shape=(--seq 256 --hidden 512 --ffn 2048 --heads 8 --layers 2 --vocab 8192 --batch 2) ;;
  cp) modes=(dp cp_allgather cp_ring); shape=(--seq 4096 --hidden 128 --ffn 256 --heads 4 --layers 2 --vocab 1024 --batch 1) ;;
  *) die "unknown set '$set_name' (tp or cp)" ;;
esac
[[ -x $BUILD/bench/parallel_llama && -x $BUILD/mfsdp-run ]] || die "build first (scripts/build.sh)"
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || die "ROUNDS=$ROUNDS: expected a positive integer"
results=$(mktemp)
trap 'rm -f "$results"' EXIT
for ((r = 1; r <= ROUNDS; r++)); do
  for mode in "${modes[@]}"; do
    if ! out=$(OMP_NUM_THREADS=1 "$BUILD/mfsdp-run" --nproc-per-node 2 --no-tag "$BUILD/bench/parallel_llama" \
                 --mode "$mode" "${shape[@]}" "$@" 2>&1); then
      echo "$out" >&2
      echo "parallel_llama.sh: mode $mode failed (round $r)" >&2
      exit 1
    fi
    grep '^mode ' <<<"$out" >>"$results"
  done
done
echo "shape: ${shape[*]} $*  (2 ranks, 1 thread each, $ROUNDS rounds, medians)"
python3 - "$results" "${modes[@]}" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    f = line.split()
    kv = dict(zip(f[0::2], f[1::2]))
    rows.setdefault(kv["mode"], []).append(kv)
def med(mode, key):
    return statistics.median(float(r[key]) for r in rows[mode])
base = sys.argv[2]
print(f"{'mode':<13} {'step s':>8} {'tokens/s':>10} {'vs dp':>6} {'persist MiB':>12} {'vs dp':>6} {'peak RSS MiB':>13} {'vs dp':>6} {'loss':>7}")
for mode in sys.argv[2:]:
    print(f"{mode:<13} {med(mode,'step_s'):8.3f} {med(mode,'tokens_per_s'):10.1f} "
          f"{med(mode,'tokens_per_s')/med(base,'tokens_per_s'):6.2f} {med(mode,'persistent_mib'):12.2f} "
          f"{med(mode,'persistent_mib')/med(base,'persistent_mib'):6.2f} {med(mode,'peak_rss_mib'):13.1f} "
          f"{med(mode,'peak_rss_mib')/med(base,'peak_rss_mib'):6.2f} {med(mode,'loss'):7.4f}")
PY
