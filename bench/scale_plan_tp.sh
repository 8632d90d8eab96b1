#!/usr/bin/env bash
# Scale planning with tensor parallelism: per-rank memory of Llama-3-70B with TP 8 at 64 and 512
# ranks under every sharding strategy, bf16 mixed precision and fp32, as `mfsdp-pretrain
# --memory-plan --simulate-world-size N --tensor-model-parallel-size 8 --sequence-parallel` plans
# it (one TP rank's slices, norms whole, sharded by fully_shard over the N / 8 ranks of its data-
# parallel group; nothing is allocated), next to Megatron-LM's theoretical memory formula
# (bench/megatron_memory_formula.py: weights and optimizer, and its activation estimate, which the
# plan does not cover). Plan only: seconds.
#
#   bench/scale_plan_tp.sh
#
# Environment (defaults in brackets): LAYERS [80] HIDDEN [8192] FFN [28672] HEADS [64] KV_HEADS [8]
#   VOCAB [128256] (untied) TP [8] RANKS [64 512] PRECISIONS [bf16 fp32] SEQ [8192] BUILD [<repo>/build]
#   OUT [a new temporary folder] PYTHON [<repo>/.venv/bin/python, else python3]
#   HBM_GIB [80] (the device memory the projection compares against)
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${BUILD:-$ROOT/build}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
[[ -x $PYTHON ]] || PYTHON=python3
LAYERS=${LAYERS:-80} HIDDEN=${HIDDEN:-8192} FFN=${FFN:-28672} HEADS=${HEADS:-64} KV_HEADS=${KV_HEADS:-8}
VOCAB=${VOCAB:-128256} TP=${TP:-8} RANKS=${RANKS:-64 512} PRECISIONS=${PRECISIONS:-bf16 fp32} SEQ=${SEQ:-8192}
HBM_GIB=${HBM_GIB:-80}
OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/scale_plan_tp.XXXXXX")}
die() { echo "scale_plan_tp.sh: $*" >&2; exit 2; }
[[ -x $BUILD/mfsdp-pretrain ]] || die "$BUILD/mfsdp-pretrain not found: build first (scripts/build.sh)"
mkdir -p "$OUT" || die "cannot create OUT=$OUT"
STRATEGIES="no_shard optim optim_grads optim_grads_params"
MODEL=(--vocab-size "$VOCAB" --make-vocab-size-divisible-by 128 --num-layers "$LAYERS" --hidden-size "$HIDDEN"
  --ffn-hidden-size "$FFN" --num-attention-heads "$HEADS" --group-query-attention --num-query-groups "$KV_HEADS"
  --swiglu --untie-embeddings-and-output-weights --seq-length "$SEQ" --max-position-embeddings "$SEQ"
  --micro-batch-size 1 --tensor-model-parallel-size "$TP" --sequence-parallel)
FORMULA=("$ROOT/bench/megatron_memory_formula.py" --layers "$LAYERS" --hidden "$HIDDEN" --ffn "$FFN" --heads "$HEADS"
  --kv-heads "$KV_HEADS" --vocab "$VOCAB" --divisible-by 128 --tp "$TP" --seq "$SEQ" --micro-batch 1)

echo "- machine: $(nproc) cores, $(grep -m1 '^model name' /proc/cpuinfo | sed 's/^[^:]*: *//'), $(free -g | awk '/^Mem:/{print $2}') GiB"
echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC'); mfsdp commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null)$(git -C "$ROOT" diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
echo "- command: bench/scale_plan_tp.sh (TP=$TP RANKS=\"$RANKS\" PRECISIONS=\"$PRECISIONS\" SEQ=$SEQ)"
echo "- plan: $BUILD/mfsdp-pretrain ${MODEL[*]} --memory-plan --simulate-world-size N --data-parallel-sharding-strategy S [--bf16]"
echo "- Megatron: bench/megatron_memory_formula.py ${FORMULA[*]:1} --dp N/$TP"

# The five numbers of the plan's "memory per rank (MiB): model weights a, main weights b, main
# grads c, optimizer state d, transient peak e" line.
mib_fields() {
  sed -nE 's/.*memory per rank \(MiB\): model weights ([^,]+), main weights ([^,]+), main grads ([^,]+), optimizer state ([^,]+), transient peak ([^,]+).*/\1 \2 \3 \4 \5/p' "$1" | head -1
}
# A field of the formula's JSON.
field() { "$PYTHON" -c 'import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$1" "$2"; }

for n in $RANKS; do
  ((n % TP == 0)) || die "TP $TP does not divide $n ranks"
  "$PYTHON" "${FORMULA[@]}" --dp $((n / TP)) >"$OUT/megatron.$n.json" || die "bench/megatron_memory_formula.py failed"
done
first=$(set -- $RANKS; echo "$1")
total=$(field "$OUT/megatron.$first.json" total_params)
shard=$(field "$OUT/megatron.$first.json" megatron_params_per_shard)
exact=$(field "$OUT/megatron.$first.json" exact_params_per_tp_rank)
echo
echo "## Per-rank memory of Llama-3-70B with TP $TP (untied, AdamW), GiB per rank"
echo
awk -v t="$total" -v s="$shard" -v e="$exact" -v tp="$TP" -v v="$(field "$OUT/megatron.$first.json" padded_vocab)" 'BEGIN {
  printf "%.3fB parameters (vocabulary padded to %d, a multiple of 128 x TP, as Megatron pads it); a TP rank holds\n", t / 1e9, v
  printf "%.4fB of them (matrices / %d, RMSNorm weights whole); Megatron'"'"'s formula counts %.4fB (norms / %d too).\n", e / 1e9, tp, s / 1e9, tp }'
echo
echo "mfsdp: the plan (persistent: model weights, main weights, main grads, AdamW state; transient: the"
echo "step's peak of gathered weights and unsharded gradients, and where it is reached). Bytes/param"
echo "formula: Megatron's parameters per TP rank x the strategy's bytes per parameter (bf16: 2 + 4 + 4 + 8"
echo "with fp32 grads and main weights; fp32: 4 + 4 + 8), the sharded terms / DP. Megatron: its"
echo "compute_weight_and_optimizer_memory, 18 B/param without the distributed optimizer (no_shard) and"
echo "6 + 12 / DP with it (optim); it has no ZeRO-2/3 form and assumes mixed precision."
echo
echo "| ranks | DP x TP | strategy | precision | model | main | grads | AdamW | persistent | transient | total | peak at | bytes/param formula | Megatron formula |"
echo "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"
for n in $RANKS; do
  dp=$((n / TP)) json=$OUT/megatron.$n.json
  ddp=$(field "$json" megatron_ddp_gib) distopt=$(field "$json" megatron_distopt_gib)
  for precision in $PRECISIONS; do
    flags=() && [[ $precision == bf16 ]] && flags=(--bf16)
    for strategy in $STRATEGIES; do
      log=$OUT/plan.$n.$precision.$strategy.log
      "$BUILD/mfsdp-pretrain" "${MODEL[@]}" "${flags[@]}" --memory-plan --simulate-world-size "$n" \
        --data-parallel-sharding-strategy "$strategy" >"$log" 2>&1 || { cat "$log" >&2; die "the plan failed ($log)"; }
      read -r mw main mg opt tr <<<"$(mib_fields "$log")"
      [[ -n $tr ]] || { cat "$log" >&2; die "no planned memory line in $log"; }
      at=$(sed -nE 's/.*MiB, at: (.*)\), total .*/\1/p' "$log" | head -1)
      awk -v n="$n" -v dp="$dp" -v tp="$TP" -v s="$strategy" -v p="$precision" -v psi="$shard" -v mw="$mw" \
        -v main="$main" -v mg="$mg" -v opt="$opt" -v tr="$tr" -v at="$at" -v ddp="$ddp" -v distopt="$distopt" 'BEGIN {
        g = 1024; w = (p == "bf16") ? 2 : 4; gr = 4; k = (p == "bf16") ? 12 : 8
        if (s == "no_shard") z = (w + gr + k) * psi
        else if (s == "optim") z = (w + gr) * psi + k * psi / dp
        else if (s == "optim_grads") z = w * psi + (gr + k) * psi / dp
        else z = (w + gr + k) * psi / dp
        m = "-"
        if (p == "bf16" && s == "no_shard") m = sprintf("%.2f", ddp)
        if (p == "bf16" && s == "optim") m = sprintf("%.2f", distopt)
        persistent = mw + main + mg + opt
        printf "| %d | %d x %d | %s | %s | %.2f | %.2f | %.2f | %.2f | **%.2f** | %.2f | %.2f | %s | %.2f | %s |\n",
          n, dp, tp, s, p, mw / g, main / g, mg / g, opt / g, persistent / g, tr / g, (persistent + tr) / g, at,
          z / (1024 * 1024 * 1024), m }'
    done
  done
done

echo
echo "## Megatron's formula, term by term (bf16, distributed optimizer; activations: --sequence-parallel,"
echo "## selective recompute, seq $SEQ, micro-batch 1), GiB per rank"
echo
echo "| ranks | DP x TP | weights (2 B) | grads (4 B) | main + Adam (12 B / DP) | weights + optimizer | activations | total |"
echo "|---:|---|---:|---:|---:|---:|---:|---:|"
for n in $RANKS; do
  json=$OUT/megatron.$n.json
  awk -v n="$n" -v dp="$((n / TP))" -v tp="$TP" -v w="$(field "$json" megatron_weights_gib)" \
    -v g="$(field "$json" megatron_grads_gib)" -v o="$(field "$json" megatron_optimizer_gib)" \
    -v t="$(field "$json" megatron_distopt_gib)" -v a="$(field "$json" megatron_activations_sp_gib)" 'BEGIN {
    printf "| %d | %d x %d | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f |\n", n, dp, tp, w, g, o, t, a, t + a }'
done

echo
echo "## Projection (bf16; the plan's persistent + transient, plus Megatron's activation estimate, against $HBM_GIB GiB)"
echo
for n in $RANKS; do
  act=$(field "$OUT/megatron.$n.json" megatron_activations_sp_gib)
  for strategy in optim optim_grads_params; do
    log=$OUT/plan.$n.bf16.$strategy.log
    [[ -f $log ]] || continue
    read -r mw main mg opt tr <<<"$(mib_fields "$log")"
    awk -v n="$n" -v tp="$TP" -v s="$strategy" -v a="$act" -v hbm="$HBM_GIB" -v mw="$mw" -v main="$main" -v mg="$mg" \
      -v opt="$opt" -v tr="$tr" 'BEGIN {
      p = (mw + main + mg + opt) / 1024; t = tr / 1024; sum = p + t + a
      printf "- %d ranks (DP %d x TP %d), %s: %.2f persistent + %.2f transient + ~%.2f activations = ~%.1f GiB (%s %d GiB)\n",
        n, n / tp, tp, s, p, t, a, sum, (sum <= hbm) ? "fits" : "exceeds", hbm }'
  done
done
