#!/usr/bin/env bash
# Tensor and context parallelism against data parallelism on this machine's 2 ranks (one core
# each): build/bench/parallel_llama in each mode, the modes alternating, ROUNDS rounds, and per
# mode the median over the rounds of the step time, the job's tokens/s (ratio to dp: > 1 faster),
# rank 0's persistent bytes and peak RSS (ratio to dp: < 1 leaner), and rank 0's CPU seconds per
# step (all its threads; less sensitive than the step time to other programs on the cores).
#
#   bench/parallel_llama.sh tp   # dp (ZeRO-3) vs tp vs tp_sp, compute-bound: seq 256, hidden 512
#   bench/parallel_llama.sh cp   # dp vs cp_allgather vs cp_ring, attention-bound: seq 4096
#   bench/parallel_llama.sh torch  # mfsdp's tp vs PyTorch's own TP + FSDP2 (DTensor
#                                  # parallelize_module over gloo, bench/parallel_llama_torch.py) on
#                                  # the tp shape: torch_tp with loss_parallel (vocabulary-parallel
#                                  # cross entropy), torch_tp_replicated the full logits on every rank;
#                                  # then mfsdp tp / torch for tokens/s (target >= 1.2) and peak RSS
#                                  # (target <= 0.9)
#
# Environment: ROUNDS [3] BUILD [<repo>/build] PYTHON [<repo>/.venv/bin/python, torch for the
# torch modes] RESULTS [unset: a file that also gets every run's result line]; extra flags after
# the set go to every run (shape flags both programs take).
# Exit status: 0 on success, 1 when a run failed (its output is shown), 2 on bad settings.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${BUILD:-$ROOT/build}
ROUNDS=${ROUNDS:-3}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
die() { echo "parallel_llama.sh: $*" >&2; exit 2; }
(($# >= 1)) || die "usage: bench/parallel_llama.sh tp|cp|torch [flags]"
set_name=$1
shift
case $set_name in
  tp) modes=(dp tp tp_sp); shape=(--seq 256 --hidden 512 --ffn 2048 --heads 8 --layers 2 --vocab 8192 --batch 2) ;;
  cp) modes=(dp cp_allgather cp_ring); shape=(--seq 4096 --hidden 128 --ffn 256 --heads 4 --layers 2 --vocab 1024 --batch 1) ;;
  torch) modes=(tp torch_tp torch_tp_replicated); shape=(--seq 256 --hidden 512 --ffn 2048 --heads 8 --layers 2 --vocab 8192 --batch 2) ;;
  *) die "unknown set '$set_name' (tp, cp or torch)" ;;
esac
if [[ $set_name == torch ]]; then
  "$PYTHON" -c 'import torch.distributed.tensor.parallel' 2>/dev/null ||
    die "$PYTHON cannot import torch.distributed.tensor.parallel (set PYTHON)"
fi
[[ -x $BUILD/bench/parallel_llama && -x $BUILD/mfsdp-run ]] || die "build first (scripts/build.sh)"
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || die "ROUNDS=$ROUNDS: expected a positive integer"
results=$(mktemp)
trap 'rm -f "$results"' EXIT
for ((r = 1; r <= ROUNDS; r++)); do
  for mode in "${modes[@]}"; do
    case $mode in
      torch_tp) run=("$PYTHON" "$ROOT/bench/parallel_llama_torch.py" --nproc 2 --mode-name "$mode") ;;
      torch_tp_replicated) run=("$PYTHON" "$ROOT/bench/parallel_llama_torch.py" --nproc 2 --mode-name "$mode" --no-loss-parallel) ;;
      *) run=("$BUILD/mfsdp-run" --nproc-per-node 2 --no-tag "$BUILD/bench/parallel_llama" --mode "$mode") ;;
    esac
    if ! out=$(OMP_NUM_THREADS=1 "${run[@]}" "${shape[@]}" "$@" 2>&1); then
      echo "$out" >&2
      echo "parallel_llama.sh: mode $mode failed (round $r)" >&2
      exit 1
    fi
    grep '^mode ' <<<"$out" >>"$results"
    if [[ -n ${RESULTS:-} ]]; then grep '^mode ' <<<"$out" >>"$RESULTS"; fi
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
vs = f"vs {base}"
print(f"{'mode':<19} {'step s':>8} {'tokens/s':>10} {vs:>6} {'persist MiB':>12} {vs:>6} {'peak RSS MiB':>13} {vs:>6} {'loss':>7} {'cpu s':>7}")
for mode in sys.argv[2:]:
    print(f"{mode:<19} {med(mode,'step_s'):8.3f} {med(mode,'tokens_per_s'):10.1f} "
          f"{med(mode,'tokens_per_s')/med(base,'tokens_per_s'):6.2f} {med(mode,'persistent_mib'):12.2f} "
          f"{med(mode,'persistent_mib')/med(base,'persistent_mib'):6.2f} {med(mode,'peak_rss_mib'):13.1f} "
          f"{med(mode,'peak_rss_mib')/med(base,'peak_rss_mib'):6.2f} {med(mode,'loss'):7.4f} {med(mode,'cpu_s'):7.3f}")
for mode in sys.argv[3:]:
    if mode.startswith("torch_"):
        speed = med(base, 'tokens_per_s') / med(mode, 'tokens_per_s')
        rss = med(base, 'peak_rss_mib') / med(mode, 'peak_rss_mib')
        print(f"mfsdp {base} / {mode}: tokens/s {speed:.2f}x (target >= 1.2: {'met' if speed >= 1.2 else 'missed'}), "
              f"peak RSS {rss:.2f}x (target <= 0.9: {'met' if rss <= 0.9 else 'missed'}); "
              f"CPU s per step {med(mode, 'cpu_s') / med(base, 'cpu_s'):.2f}x less")
PY
