#!/usr/bin/env bash
# The loss without full logits (--cross-entropy-loss-fusion, the default) against the loss from
# the full logits (--no-cross-entropy-loss-fusion): peak RSS and step time of mfsdp-pretrain on a
# small Llama with a real-size vocabulary, where the logits dominate memory.
#
#   bench/fused_loss_memory.sh [ROUNDS]      (default 3; BUILD=build, TOKENS=seq x micro-batch)
#
# Model: Llama 4 x d256 (GQA 8/4 heads, SwiGLU FFN 704), vocabulary 128256 (Llama 3's), untied,
# sequence 512, micro-batch 4 (2048 tokens a micro-batch: 2048 x 128256 fp32 logits are 1 GiB a
# copy), 1 rank, fp32, mock data, 6 iterations. Rounds alternate the two runs (this VM is
# noisy). Peak RSS: bench/peak_rss.py around the rank (getrusage of the rank process); step time:
# the median iter_time_s of iterations 2.. from --metrics-file. Prints a table and the ratios.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BUILD="${BUILD:-$ROOT/build}"
ROUNDS="${1:-3}"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
for tool in mfsdp-run mfsdp-pretrain; do
  [ -x "$BUILD/$tool" ] || { echo "fused_loss_memory.sh: $BUILD/$tool is not built" >&2; exit 1; }
done
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
MODEL=" --device cpu --mock-data --vocab-size 128256 --make-vocab-size-divisible-by 128 --num-layers 4
 --hidden-size 256 --num-attention-heads 8 --group-query-attention --num-query-groups 4 --swiglu
 --ffn-hidden-size 704 --untie-embeddings-and-output-weights --seq-length 512 --micro-batch-size 4
 --global-batch-size 4 --train-iters 6 --lr 1e-4 --log-interval 1 --eval-interval 1000 --eval-iters 1 --seed 1"

run_one() {  # $1 label, $2 flags; appends "label peak_mib median_s" to $work/results
  local label="$1" flags="$2" log="$work/$1.log" metrics="$work/$1.jsonl"
  rm -f "$metrics"
  OMP_NUM_THREADS=2 "$BUILD/mfsdp-run" --nproc-per-node 1 "$PYTHON" "$ROOT/bench/peak_rss.py" \
    "$BUILD/mfsdp-pretrain" $MODEL $flags --metrics-file "$metrics" >"$log" 2>&1 ||
    { echo "fused_loss_memory.sh: $label failed:" >&2; tail -20 "$log" >&2; exit 1; }
  local peak
  peak=$(grep -o 'peak_rss_mib [0-9.]*' "$log" | tail -1 | cut -d' ' -f2)
  local median
  median=$("$PYTHON" - "$metrics" <<'EOF'
import json, statistics, sys
times = [json.loads(l)["iter_time_s"] for l in open(sys.argv[1]) if '"eval"' not in l]
print("%.3f" % statistics.median(times[1:]))
EOF
)
  echo "$label $peak $median" >>"$work/results"
}

for r in $(seq 1 "$ROUNDS"); do
  run_one "fused_r$r" ""
  run_one "plain_r$r" "--no-cross-entropy-loss-fusion"
done

"$PYTHON" - "$work/results" "$ROUNDS" <<'EOF'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
def pick(kind, col):
    return [float(r[col]) for r in rows if r[0].startswith(kind)]
print("fused loss vs full logits: Llama 4 x d256, vocabulary 128256, 2048 tokens a micro-batch, 1 rank, fp32,"
      " %s rounds" % sys.argv[2])
print("| loss | peak RSS MiB (median) | step s (median) |")
print("|---|---:|---:|")
f_mem, p_mem = statistics.median(pick("fused", 1)), statistics.median(pick("plain", 1))
f_s, p_s = statistics.median(pick("fused", 2)), statistics.median(pick("plain", 2))
print("| fused (--cross-entropy-loss-fusion) | %.0f | %.3f |" % (f_mem, f_s))
print("| full logits (--no-cross-entropy-loss-fusion) | %.0f | %.3f |" % (p_mem, p_s))
print("fused / full logits: peak RSS %.2fx (%.0f MiB less), step time %.2fx" % (f_mem / p_mem, p_mem - f_mem, f_s / p_s))
EOF
