#!/usr/bin/env bash
# Per-rank peak RSS of a 1-iteration mfsdp-sft on NPROC CPU ranks, started four ways from the same
# ~106M-parameter Llama (issue 29, item 1; docs/PERFORMANCE.md "Streaming Hugging Face loads"):
#
#   hf-load      --hf-load HF            (a random LlamaForCausalLM transformers saved, fp32)
#   ckpt-load    --load CKPT --finetune  (the same weights as an mfsdp checkpoint: mfsdp-ckpt import-hf)
#   meta         the same model from flags with --init-model-with-meta-device (the target's base)
#   eager        the same model from flags with --no-init-model-with-meta-device (every rank builds
#                the whole model first; deferred init is the default)
#
# The four run in interleaved rounds (ROUNDS, default 2), so drift of the machine hits all alike;
# each rank's peak comes from bench/peak_rss.py (getrusage of the rank). Prints, per way, the
# median over rounds of the largest and of the mean per-rank peak, and the ratio to meta.
#
#   bench/hf_load_memory.sh                 # NPROC=8 ROUNDS=2 BUILD=build WORK=$(mktemp -d)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD:-$ROOT/build}
PY=${MFSDP_PYTHON:-$ROOT/.venv/bin/python}
NPROC=${NPROC:-8}
ROUNDS=${ROUNDS:-2}
WORK=${WORK:-$(mktemp -d)}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1

LAYERS=8 HIDDEN=768 FFN=2048 HEADS=12 VOCAB=32000
if [ ! -f "$WORK/hf/config.json" ]; then
  "$PY" "$ROOT/tests/reference/make_hf_llama.py" "$WORK/hf" --layers $LAYERS --hidden $HIDDEN --ffn $FFN \
    --heads $HEADS --kv-heads $HEADS --vocab $VOCAB --dtype fp32 >&2
fi
[ -d "$WORK/ckpt" ] || "$BUILD/mfsdp-ckpt" import-hf "$WORK/hf" "$WORK/ckpt" >&2

SFT=("$BUILD/mfsdp-sft" --device cpu --tokenizer-type ByteLevelTokenizer --gen-task arith --gen-train-size 64
     --gen-seed 3 --max-length 64 --micro-batch-size 1 --global-batch-size "$NPROC" --train-iters 1 --lr 1e-5
     --log-interval 1 --seed 5)
FLAGS=(--num-layers $LAYERS --hidden-size $HIDDEN --num-attention-heads $HEADS --ffn-hidden-size $FFN --swiglu
       --untie-embeddings-and-output-weights --make-vocab-size-divisible-by $VOCAB --max-position-embeddings 512)

run_way() {  # way -> "max mean" of the per-rank peaks (MiB)
  local extra=()
  case "$1" in
    hf-load) extra=(--hf-load "$WORK/hf") ;;
    ckpt-load) extra=(--load "$WORK/ckpt" --finetune "${FLAGS[@]}") ;;
    meta) extra=("${FLAGS[@]}" --init-model-with-meta-device) ;;
    eager) extra=("${FLAGS[@]}" --no-init-model-with-meta-device) ;;
  esac
  local log="$WORK/$1.log"
  "$BUILD/mfsdp-run" --nproc-per-node "$NPROC" "$PY" "$ROOT/bench/peak_rss.py" "${SFT[@]}" "${extra[@]}" >"$log" 2>&1 ||
    { echo "$1 failed:" >&2; tail -20 "$log" >&2; exit 1; }
  grep -o 'peak_rss_mib [0-9.]*' "$log" | awk '{ s += $2; if ($2 > m) m = $2; n++ } END { printf "%.0f %.0f\n", m, s / n }'
}

WAYS=(hf-load ckpt-load meta eager)
declare -A MAX MEAN
for round in $(seq 1 "$ROUNDS"); do
  for way in "${WAYS[@]}"; do
    read -r mx mn < <(run_way "$way")
    MAX[$way]+="$mx " MEAN[$way]+="$mn "
    echo "round $round $way: max $mx MiB, mean $mn MiB per rank" >&2
  done
done
median() { tr ' ' '\n' | grep . | sort -n | awk '{ a[NR] = $1 } END { print (NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2) }'; }
base=$(echo "${MAX[meta]}" | median)
printf '%-10s %14s %15s %14s\n' way "max rank MiB" "mean rank MiB" "max / meta"
for way in "${WAYS[@]}"; do
  mx=$(echo "${MAX[$way]}" | median) mn=$(echo "${MEAN[$way]}" | median)
  printf '%-10s %14.0f %15.0f %13.2fx\n' "$way" "$mx" "$mn" "$(echo "$mx / $base" | bc -l)"
done
echo "($NPROC ranks, $ROUNDS rounds, median per way; $(lscpu | grep 'Model name' | sed 's/  */ /g'); $(date -u +%F))"
