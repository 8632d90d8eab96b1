#!/usr/bin/env bash
# Scale planning for DeepSeek-V3 671B: per-rank memory at 256 ranks with expert parallelism, as
# `mfsdp-pretrain --memory-plan --simulate-world-size N --expert-model-parallel-size EP` plans it
# (the model built with deferred parameters, nothing allocated; the experts of each MoE layer split
# over EP ranks and sharded over the N / EP ranks of their expert-data-parallel group, everything
# else sharded over all N ranks), next to Megatron-LM's theoretical memory formula with MoE, MLA and
# EP (bench/megatron_memory_formula.py: weights and optimizer, and its activation estimate, which
# the plan does not cover). Plan only: seconds.
#
#   bench/scale_plan_deepseek.sh
#
# The model: 61 layers (the first 3 dense), hidden 7168, 128 heads of multi-head latent attention
# (q_lora_rank 1536, kv_lora_rank 512, qk_head_dim 128, qk_pos_emb_head_dim 64, v_head_dim 128),
# dense MLP 18432, 256 routed experts of 2048 (top-8, sigmoid scores with the expert bias, 8 groups,
# top-4 groups, scaling 2.5) and one shared expert of 2048, vocabulary 129280, untied. No MTP layer
# (mfsdp builds none). bf16 with fp32 main weights and grads, AdamW; TP 1 (as first measured, when
# mfsdp still refused TP with MLA).
#
# Environment (defaults in brackets): RANKS [256] EPS [8 32 64] STRATEGIES [optim_grads_params
#   optim_grads optim] SEQ [4096] BUILD [<repo>/build] OUT [a new temporary folder]
#   PYTHON [<repo>/.venv/bin/python, else python3] HBM_GIB [80] (the device memory the projection
#   compares against)
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${BUILD:-$ROOT/build}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
[[ -x $PYTHON ]] || PYTHON=python3
RANKS=${RANKS:-256} EPS=${EPS:-8 32 64} STRATEGIES=${STRATEGIES:-optim_grads_params optim_grads optim}
SEQ=${SEQ:-4096} HBM_GIB=${HBM_GIB:-80}
OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/scale_plan_deepseek.XXXXXX")}
die() { echo "scale_plan_deepseek.sh: $*" >&2; exit 2; }
[[ -x $BUILD/mfsdp-pretrain ]] || die "$BUILD/mfsdp-pretrain not found: build first (scripts/build.sh)"
[[ -x /usr/bin/time ]] || die "/usr/bin/time not found (it measures each plan's peak RSS)"
mkdir -p "$OUT" || die "cannot create OUT=$OUT"

LAYERS=61 DENSE_LAYERS=3 HIDDEN=7168 FFN=18432 HEADS=128 VOCAB=129280 EXPERTS=256 MOE_FFN=2048 SHARED_FFN=2048 TOPK=8
# Megatron writes the layer pattern "([0]*3+[1]*58)"; mfsdp-pretrain takes the list it stands for.
FREQ="[$(for ((i = 0; i < LAYERS; i++)); do ((i)) && printf ,; ((i < DENSE_LAYERS)) && printf 0 || printf 1; done)]"
MEGATRON_FREQ="([0]*$DENSE_LAYERS+[1]*$((LAYERS - DENSE_LAYERS)))"
MODEL=(--vocab-size "$VOCAB" --make-vocab-size-divisible-by 128 --num-layers "$LAYERS" --hidden-size "$HIDDEN"
  --ffn-hidden-size "$FFN" --num-attention-heads "$HEADS" --multi-latent-attention --q-lora-rank 1536
  --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128
  --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0 --swiglu --normalization RMSNorm
  --untie-embeddings-and-output-weights --num-experts "$EXPERTS" --moe-router-topk "$TOPK"
  --moe-ffn-hidden-size "$MOE_FFN" --moe-shared-expert-intermediate-size "$SHARED_FFN" --moe-layer-freq "$FREQ"
  --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-num-groups 8
  --moe-router-group-topk 4 --moe-router-topk-scaling-factor 2.5 --moe-router-load-balancing-type seq_aux_loss
  --moe-aux-loss-coeff 1e-4 --seq-length "$SEQ" --max-position-embeddings "$SEQ" --micro-batch-size 1
  --bf16 --use-distributed-optimizer)
FORMULA=("$ROOT/bench/megatron_memory_formula.py" --layers "$LAYERS" --hidden "$HIDDEN" --ffn "$FFN" --heads "$HEADS"
  --mla --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128
  --num-experts "$EXPERTS" --moe-ffn "$MOE_FFN" --moe-shared-ffn "$SHARED_FFN" --moe-topk "$TOPK"
  --moe-layer-freq "$MEGATRON_FREQ" --vocab "$VOCAB" --divisible-by 128 --tp 1 --seq "$SEQ" --micro-batch 1)

echo "- machine: $(nproc) cores, $(grep -m1 '^model name' /proc/cpuinfo | sed 's/^[^:]*: *//'), $(free -g | awk '/^Mem:/{print $2}') GiB"
echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC'); mfsdp commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null)$(git -C "$ROOT" diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
echo "- command: bench/scale_plan_deepseek.sh (RANKS=\"$RANKS\" EPS=\"$EPS\" SEQ=$SEQ)"
SHOWN=("${MODEL[@]/#"$FREQ"/[0,0,0,1,...,1] (61 entries)}")
echo "- plan: $BUILD/mfsdp-pretrain ${SHOWN[*]} --memory-plan --simulate-world-size N --expert-model-parallel-size EP --data-parallel-sharding-strategy S"
echo "- Megatron: bench/megatron_memory_formula.py ${FORMULA[*]:1} --dp N --ep EP"

mib_fields() {
  sed -nE 's/.*memory per rank \(MiB\): model weights ([^,]+), main weights ([^,]+), main grads ([^,]+), optimizer state ([^,]+), transient peak ([^,]+).*/\1 \2 \3 \4 \5/p' "$1" | head -1
}
field() { "$PYTHON" -c 'import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$1" "$2"; }
# The plan's parameter count: the "elements" of every unit, the expert units' times EP (each lists
# one expert-parallel rank's experts). "elements" counts the gaps fully_shard leaves to start each
# parameter at a whole row (align_rows), so it can exceed the parameters by those gaps.
plan_params() {
  awk -v ep="$2" '$3 ~ /^(bf16|fp32|fp16)$/ && $5 ~ /^[0-9]+$/ {
    if ($1 ~ /\.mlp\.experts$/) e += $5; else d += $5 }
    END { printf "%.0f %.0f %.0f\n", d, e * ep, d + e * ep }' "$1"
}

for n in $RANKS; do
  for ep in $EPS; do
    ((n % ep == 0 && EXPERTS % ep == 0)) || die "EP $ep must divide $n ranks and $EXPERTS experts"
    "$PYTHON" "${FORMULA[@]}" --dp "$n" --ep "$ep" >"$OUT/megatron.$n.$ep.json" || die "bench/megatron_memory_formula.py failed"
    for strategy in $STRATEGIES; do
      log=$OUT/plan.$n.$ep.$strategy.log
      /usr/bin/time -f '%e %M' -o "$log.time" "$BUILD/mfsdp-pretrain" "${MODEL[@]}" --memory-plan \
        --simulate-world-size "$n" --expert-model-parallel-size "$ep" --data-parallel-sharding-strategy "$strategy" \
        >"$log" 2>&1 || { cat "$log" >&2; die "the plan failed ($log)"; }
      [[ -n $(mib_fields "$log") ]] || { cat "$log" >&2; die "no planned memory line in $log"; }
    done
  done
done

first_n=$(set -- $RANKS; echo "$1") first_ep=$(set -- $EPS; echo "$1") first_s=$(set -- $STRATEGIES; echo "$1")
j=$OUT/megatron.$first_n.$first_ep.json
read -r pd pe pt <<<"$(plan_params "$OUT/plan.$first_n.$first_ep.$first_s.log" "$first_ep")"
echo
echo "## Parameters"
echo
awk -v t="$(field "$j" total_params)" -v act="$(field "$j" active_params)" -v pd="$pd" -v pe="$pe" -v pt="$pt" \
  -v dl="$(field "$j" params_dense_layer)" -v ml="$(field "$j" params_moe_layer)" -v at="$(field "$j" params_attention_per_layer)" \
  -v emb="$(field "$j" params_embeddings)" -v ep="$first_ep" 'BEGIN {
  printf "- formula: %.0f parameters (%.3fB; %.3fB active per token): attention (MLA) %.0f per layer, a dense layer %.0f, an MoE layer %.0f, embedding + output layer %.0f\n", t, t / 1e9, act / 1e9, at, dl, ml, emb
  printf "- plan (EP %d): %.0f in the dense units + %.0f in the expert units (one rank'"'"'s x EP) = %.0f; plan - formula = %.0f (fully_shard'"'"'s row-alignment gaps in the MoE layers'"'"' dense units)\n", ep, pd, pe, pt, pt - t }'

echo
echo "## Per-rank memory of DeepSeek-V3 (no MTP) at $RANKS ranks, bf16 + AdamW, GiB per rank"
echo
echo "mfsdp: the plan (persistent: bf16 model weights, fp32 main weights, fp32 main grads, AdamW state;"
echo "transient: the step's peak of gathered weights and unsharded gradients). Bytes/param: the formula's"
echo "parameters per rank (dense / all ranks, experts / EP) x the strategy's bytes (2 + 4 + 4 + 8), the"
echo "sharded terms / DP for the dense parameters and / EDP for the experts. Megatron: its"
echo "compute_weight_and_optimizer_memory with the distributed optimizer, (6 + 12 / DP) per dense"
echo "parameter + (6 + 12 / EDP) per expert parameter; it has no ZeRO-2/3 form. ratio: the plan's"
echo "persistent / Megatron's weights + optimizer."
echo
echo "| ranks | EP x EDP | strategy | model | main | grads | AdamW | persistent | transient | total | peak at | bytes/param | Megatron w+o | ratio | plan s / RSS MiB |"
echo "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"
for n in $RANKS; do
  for ep in $EPS; do
    json=$OUT/megatron.$n.$ep.json
    dense=$(field "$json" megatron_dense_params_per_rank) expert=$(field "$json" megatron_expert_params_per_rank)
    distopt=$(field "$json" megatron_distopt_gib)
    for strategy in $STRATEGIES; do
      log=$OUT/plan.$n.$ep.$strategy.log
      read -r mw main mg opt tr <<<"$(mib_fields "$log")"
      read -r secs rss <<<"$(tail -1 "$log.time")"
      at=$(sed -nE 's/.*MiB, at: (.*)\), total .*/\1/p' "$log" | head -1)
      awk -v n="$n" -v ep="$ep" -v s="$strategy" -v d="$dense" -v e="$expert" -v mw="$mw" -v main="$main" -v mg="$mg" \
        -v opt="$opt" -v tr="$tr" -v at="$at" -v m="$distopt" -v secs="$secs" -v rss="$rss" 'BEGIN {
        dp = n; edp = n / ep
        if (s == "no_shard") { z = 18 * (d + e) }
        else if (s == "optim") { z = 6 * (d + e) + 12 * d / dp + 12 * e / edp }
        else if (s == "optim_grads") { z = 2 * (d + e) + 16 * d / dp + 16 * e / edp }
        else { z = 18 * d / dp + 18 * e / edp }
        g = 1024; persistent = mw + main + mg + opt
        printf "| %d | %d x %d | %s | %.2f | %.2f | %.2f | %.2f | **%.2f** | %.2f | %.2f | %s | %.2f | %.2f | %.3f | %.1f / %.0f |\n",
          n, ep, edp, s, mw / g, main / g, mg / g, opt / g, persistent / g, tr / g, (persistent + tr) / g, at,
          z / (1024 * 1024 * 1024), m, persistent / g / m, secs, rss / 1024 }'
    done
  done
done

echo
echo "## Megatron's formula, term by term (bf16, distributed optimizer, TP 1), GiB per rank"
echo
echo "Parameters per rank: dense (attention, dense MLPs, shared experts, embeddings, norms, routers: all"
echo "of them at TP 1) and experts (E / EP per MoE layer). Activations: Megatron's with sequence"
echo "parallelism and selective recompute (s b h (18 + 4 ffn / h) per layer), and the form it prints at"
echo "TP 1, where it turns sequence parallelism off (s b h 34 per layer, x 1.05); seq $SEQ, micro-batch 1,"
echo "no recompute of whole layers."
echo
echo "| ranks | EP x EDP | dense params | expert params | weights (2 B) | grads (4 B) | main + Adam (12 B / DP, / EDP) | weights + optimizer | activations (SP form) | activations (TP 1 form) | total (w + o + TP 1 form) |"
echo "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
for n in $RANKS; do
  for ep in $EPS; do
    json=$OUT/megatron.$n.$ep.json
    awk -v n="$n" -v ep="$ep" -v edp="$(field "$json" edp)" -v d="$(field "$json" megatron_dense_params_per_rank)" \
      -v e="$(field "$json" megatron_expert_params_per_rank)" -v w="$(field "$json" megatron_weights_gib)" \
      -v g="$(field "$json" megatron_grads_gib)" -v o="$(field "$json" megatron_optimizer_gib)" \
      -v t="$(field "$json" megatron_distopt_gib)" -v a="$(field "$json" megatron_activations_sp_gib)" \
      -v a1="$(field "$json" megatron_activations_nosp_gib)" 'BEGIN {
      printf "| %d | %d x %d | %.3fB | %.3fB | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f |\n",
        n, ep, edp, d / 1e9, e / 1e9, w, g, o, t, a, a1, t + a1 }'
  done
done

echo
echo "## Projection (the plan's persistent + transient, plus Megatron's TP 1 activation estimate, against $HBM_GIB GiB)"
echo
for n in $RANKS; do
  for ep in $EPS; do
    act=$(field "$OUT/megatron.$n.$ep.json" megatron_activations_nosp_gib)
    for strategy in $STRATEGIES; do
      read -r mw main mg opt tr <<<"$(mib_fields "$OUT/plan.$n.$ep.$strategy.log")"
      awk -v n="$n" -v ep="$ep" -v s="$strategy" -v a="$act" -v hbm="$HBM_GIB" -v mw="$mw" -v main="$main" -v mg="$mg" \
        -v opt="$opt" -v tr="$tr" 'BEGIN {
        p = (mw + main + mg + opt) / 1024; t = tr / 1024; sum = p + t + a
        printf "- %d ranks, EP %d x EDP %d, %s: %.2f persistent + %.2f transient + ~%.2f activations = ~%.1f GiB (%s %d GiB)\n",
          n, ep, n / ep, s, p, t, a, sum, (sum <= hbm) ? "fits" : "exceeds", hbm }'
    done
  done
done
echo
echo "(plans and formula outputs: $OUT)"
