#!/usr/bin/env bash
# Scale planning: per-rank memory of Llama-3-8B at 8, 64 and 512 ranks under every sharding
# strategy, fp32 and bf16, from fully_shard's own layout arithmetic (build/bench/scale_plan),
# next to the ZeRO formula and PyTorch FSDP2's layout; then the plan checked against the
# simulated-rank mode of mfsdp-pretrain (one process holding exactly one rank's buffers,
# --simulate-world-size N) wherever such a run fits this machine's memory.
#
#   bench/scale_plan.sh                                # plan + check at 64 and 512 ranks
#   CHECK_RANKS="" bench/scale_plan.sh                 # the plan only (instant)
#
# Environment (defaults in brackets): LAYERS [32] HIDDEN [4096] FFN [14336] HEADS [32]
#   KV_HEADS [8] VOCAB [128256] (untied) RANKS [8,64,512] CHECK_RANKS [64 512]
#   CHECK_PRECISIONS [fp32] BUILD [<repo>/build] OUT [a new temporary folder]
# A check runs ZeRO-3 (optim_grads_params), --init-model-with-meta-device, one sequence of 128
# tokens, 1 iteration; at 64 ranks it needs ~12 GB of RAM and ~2 minutes on 2 cores.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${BUILD:-$ROOT/build}
LAYERS=${LAYERS:-32} HIDDEN=${HIDDEN:-4096} FFN=${FFN:-14336} HEADS=${HEADS:-32}
KV_HEADS=${KV_HEADS:-8} VOCAB=${VOCAB:-128256} RANKS=${RANKS:-8,64,512}
CHECK_RANKS=${CHECK_RANKS-64 512} CHECK_PRECISIONS=${CHECK_PRECISIONS:-fp32}
OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/scale_plan.XXXXXX")}
die() { echo "scale_plan.sh: $*" >&2; exit 2; }
for exe in bench/scale_plan mfsdp-pretrain; do
  [[ -x $BUILD/$exe ]] || die "$BUILD/$exe not found: build first (scripts/build.sh)"
done
mkdir -p "$OUT" || die "cannot create OUT=$OUT"
shape=(--layers "$LAYERS" --hidden "$HIDDEN" --ffn "$FFN" --heads "$HEADS" --kv-heads "$KV_HEADS" --vocab "$VOCAB")

echo "- machine: $(nproc) cores, $(grep -m1 '^model name' /proc/cpuinfo | sed 's/^[^:]*: *//'), $(free -g | awk '/^Mem:/{print $2}') GiB"
echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC'); mfsdp commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null)"
echo "- command: bench/scale_plan.sh (build/bench/scale_plan ${shape[*]} --ranks $RANKS)"
echo
"$BUILD/bench/scale_plan" "${shape[@]}" --ranks "$RANKS" || exit 1
[[ -z $CHECK_RANKS ]] && exit 0

echo
echo "## The plan against the simulated-rank mode (ZeRO-3, MiB per rank)"
echo
echo "| ranks | precision | | model weights | main weights | main grads | AdamW | transient peak | process peak RSS |"
echo "|---:|---|---|---:|---:|---:|---:|---:|---:|"
for n in $CHECK_RANKS; do
  for precision in $CHECK_PRECISIONS; do
    flags=() && [[ $precision == bf16 ]] && flags=(--bf16)
    log=$OUT/sim.$n.$precision.log
    OMP_NUM_THREADS=2 "$BUILD/mfsdp-pretrain" --mock-data --vocab-size "$VOCAB" --num-layers "$LAYERS" \
      --hidden-size "$HIDDEN" --ffn-hidden-size "$FFN" --num-attention-heads "$HEADS" --group-query-attention \
      --num-query-groups "$KV_HEADS" --swiglu --untie-embeddings-and-output-weights --seq-length 128 \
      --max-position-embeddings 128 --micro-batch-size 1 --global-batch-size "$n" --train-iters 1 \
      --log-interval 1 --eval-iters 0 --lr 1e-4 --init-model-with-meta-device "${flags[@]}" \
      --data-parallel-sharding-strategy optim_grads_params --simulate-world-size "$n" --simulate-rank 0 \
      >"$log" 2>&1 || { tail -20 "$log" >&2; die "the simulated run at $n ranks failed ($log)"; }
    measured=$(grep -o 'memory per rank (MiB): .*' "$log" | sed -E 's/[a-z A-Z()]+ ([0-9.e+-]+)/\1 /g; s/^[^0-9]*//')
    read -r mw mainw mg opt tr _pool rss <<<"$(echo "$measured" | tr -s ', ' ' ')"
    plan=$("$BUILD/bench/scale_plan" "${shape[@]}" --ranks "$n" --unit MiB | grep "| $n | $precision | optim_grads_params |")
    IFS="|" read -r _ _ _ _ pm pmain pg popt _ _ ptr _ <<<"$plan"
    printf '| %s | %s | plan | %s | %s | %s | %s | %s (bound) | |\n' "$n" "$precision" $pm $pmain $pg $popt $ptr
    printf '| %s | %s | simulated | %.2f | %.2f | %.2f | %.2f | %.2f | %.0f |\n' "$n" "$precision" \
      "$mw" "$mainw" "$mg" "$opt" "$tr" "$rss"
  done
done
