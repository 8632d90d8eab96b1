#!/usr/bin/env bash
# Scale planning: per-rank memory of Llama-3-8B at 8, 64 and 512 ranks under every sharding
# strategy, fp32 and bf16 mixed precision, as `mfsdp-pretrain --memory-plan` plans it (fully_shard's
# own layout and schedule on the model built with deferred parameters: nothing is allocated), next
# to the ZeRO paper's formula and PyTorch FSDP2 (bench/fsdp2_plan.py: FSDP2's own sharding on a fake
# process group, its documented schedule for the transient part). Then, as a check at scale, real
# simulated ZeRO-3 steps (--simulate-world-size: one process holding exactly one rank's buffers)
# measured against the plan, where they fit this machine's memory.
#
#   bench/scale_plan.sh                          # the plan, then the check at 64 and 512 ranks
#   CHECK_RANKS="" bench/scale_plan.sh           # the plan only (seconds)
#
# Environment (defaults in brackets): LAYERS [32] HIDDEN [4096] FFN [14336] HEADS [32]
#   KV_HEADS [8] VOCAB [128256] (untied) RANKS [8 64 512] CHECK_RANKS [64 512]
#   CHECK_PRECISIONS [fp32 bf16] CHECK_ITERS [2] BUILD [<repo>/build] OUT [a new temporary folder]
#   HYBRID [64:8 512:8] (ranks:ranks per instance for the hybrid-sharding table)
#   PYTHON [<repo>/.venv/bin/python]
# A check runs ZeRO-3 (optim_grads_params), --init-model-with-meta-device, one sequence of 128
# tokens per rank, CHECK_ITERS iterations (the plan is of a step from the second on), 2 threads;
# at 64 ranks in fp32 it needs ~8 GB of RAM and a few minutes on 2 cores. A check is skipped,
# saying so, when the plan's total plus 6 GiB exceeds the available memory.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${BUILD:-$ROOT/build}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
LAYERS=${LAYERS:-32} HIDDEN=${HIDDEN:-4096} FFN=${FFN:-14336} HEADS=${HEADS:-32}
KV_HEADS=${KV_HEADS:-8} VOCAB=${VOCAB:-128256} RANKS=${RANKS:-8 64 512}
CHECK_RANKS=${CHECK_RANKS-64 512} CHECK_PRECISIONS=${CHECK_PRECISIONS:-fp32 bf16} CHECK_ITERS=${CHECK_ITERS:-2}
OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/scale_plan.XXXXXX")}
die() { echo "scale_plan.sh: $*" >&2; exit 2; }
[[ -x $BUILD/mfsdp-pretrain ]] || die "$BUILD/mfsdp-pretrain not found: build first (scripts/build.sh)"
[[ -x $PYTHON ]] || die "no Python at $PYTHON (scripts/setup.sh makes .venv)"
mkdir -p "$OUT" || die "cannot create OUT=$OUT"
STRATEGIES="no_shard optim optim_grads optim_grads_params"
MODEL=(--vocab-size "$VOCAB" --make-vocab-size-divisible-by 128 --num-layers "$LAYERS" --hidden-size "$HIDDEN"
  --ffn-hidden-size "$FFN" --num-attention-heads "$HEADS" --group-query-attention --num-query-groups "$KV_HEADS"
  --swiglu --untie-embeddings-and-output-weights --seq-length 128 --max-position-embeddings 128
  --micro-batch-size 1)

echo "- machine: $(nproc) cores, $(grep -m1 '^model name' /proc/cpuinfo | sed 's/^[^:]*: *//'), $(free -g | awk '/^Mem:/{print $2}') GiB"
echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC'); mfsdp commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null)$(git -C "$ROOT" diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
echo "- command: bench/scale_plan.sh (RANKS=\"$RANKS\" CHECK_RANKS=\"$CHECK_RANKS\" CHECK_PRECISIONS=\"$CHECK_PRECISIONS\" CHECK_ITERS=$CHECK_ITERS)"
echo "- plan: $BUILD/mfsdp-pretrain ${MODEL[*]} --memory-plan --simulate-world-size N --data-parallel-sharding-strategy S [--bf16]"
echo "- FSDP2: bench/fsdp2_plan.py --layers $LAYERS --hidden $HIDDEN --ffn $FFN --heads $HEADS --kv-heads $KV_HEADS --vocab $VOCAB --ranks ${RANKS// /,}"

# The five numbers of a "memory per rank (MiB): model weights a, main weights b, main grads c,
# optimizer state d, transient peak e" line (the plan's, or the end-of-run report's).
mib_fields() {
  sed -nE 's/.*memory per rank \(MiB\): model weights ([^,]+), main weights ([^,]+), main grads ([^,]+), optimizer state ([^,]+), transient peak ([^,]+).*/\1 \2 \3 \4 \5/p' "$1" | head -1
}

"$PYTHON" "$ROOT/bench/fsdp2_plan.py" --layers "$LAYERS" --hidden "$HIDDEN" --ffn "$FFN" --heads "$HEADS" \
  --kv-heads "$KV_HEADS" --vocab "$VOCAB" --ranks "${RANKS// /,}" >"$OUT/fsdp2.txt" 2>"$OUT/fsdp2.err" ||
  { cat "$OUT/fsdp2.err" >&2; die "bench/fsdp2_plan.py failed"; }
psi=$(awk 'NR==1{print $3}' "$OUT/fsdp2.txt")
echo
echo "## Per-rank memory of Llama-3-8B ($(awk -v p="$psi" 'BEGIN{printf "%.3fB parameters", p/1e9}'), untied, AdamW), GiB per rank"
echo
echo "mfsdp: the plan (persistent: model weights, main weights, main grads, AdamW state; transient: the"
echo "step's peak of gathered weights and unsharded gradients, and where it is reached). ZeRO: the paper's"
echo "persistent bytes (mixed precision: 2+2+12 bytes per parameter; fp32: 4+4+8). FSDP2 (ZeRO-3 rows):"
echo "fp32 sharded parameters, gradients and AdamW state with its own dim-0 padding, and the transient"
echo "of its documented schedule (bench/fsdp2_plan.py)."
echo
echo "| ranks | strategy | precision | model | main | grads | AdamW | persistent | transient | total | peak at | ZeRO formula | FSDP2 persistent | FSDP2 transient | FSDP2 total |"
echo "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"
for n in $RANKS; do
  for precision in fp32 bf16; do
    flags=() && [[ $precision == bf16 ]] && flags=(--bf16)
    for strategy in $STRATEGIES; do
      log=$OUT/plan.$n.$precision.$strategy.log
      "$BUILD/mfsdp-pretrain" "${MODEL[@]}" "${flags[@]}" --memory-plan --simulate-world-size "$n" \
        --data-parallel-sharding-strategy "$strategy" >"$log" 2>&1 || { cat "$log" >&2; die "the plan failed ($log)"; }
      read -r mw main mg opt tr <<<"$(mib_fields "$log")"
      at=$(sed -nE 's/.*MiB, at: (.*)\), total .*/\1/p' "$log" | head -1)
      fsdp2=$(awk -v n="$n" -v p="$precision" '$1==n && $2==p {print $4, $5, $6, $7}' "$OUT/fsdp2.txt")
      awk -v n="$n" -v s="$strategy" -v p="$precision" -v psi="$psi" -v mw="$mw" -v main="$main" -v mg="$mg" \
        -v opt="$opt" -v tr="$tr" -v at="$at" -v fsdp2="$fsdp2" 'BEGIN {
        g = 1024; w = (p == "bf16") ? 2 : 4; gr = w; k = (p == "bf16") ? 12 : 8
        if (s == "no_shard") z = (w + gr + k) * psi
        else if (s == "optim") z = (w + gr) * psi + k * psi / n
        else if (s == "optim_grads") z = w * psi + (gr + k) * psi / n
        else z = (w + gr + k) * psi / n
        persistent = mw + main + mg + opt
        f = "-"; ft = "-"; fa = "-"
        if (s == "optim_grads_params") {
          split(fsdp2, b, " "); gib = 1024 * 1024 * 1024
          f = sprintf("%.2f", (b[1] + b[2] + b[3]) / gib); ft = sprintf("%.2f", b[4] / gib)
          fa = sprintf("%.2f", (b[1] + b[2] + b[3] + b[4]) / gib)
        }
        printf "| %d | %s | %s | %.2f | %.2f | %.2f | %.2f | **%.2f** | %.2f | %.2f | %s | %.2f | %s | %s | %s |\n",
          n, s, p, mw / g, main / g, mg / g, opt / g, persistent / g, tr / g, (persistent + tr) / g, at,
          z / (1024 * 1024 * 1024), f, ft, fa }'
    done
  done
done

# Hybrid sharding: instances of a node's ranks (shard inside, replicate or split across), beside
# ZeRO-3 over the instance and over every rank.
echo
echo "## Hybrid sharding of Llama-3-8B (bf16 mixed precision, AdamW), GiB per rank"
echo
echo "HSDP: --num-distributed-optimizer-instances N/I --outer-dp-sharding-strategy no_shard; HFSDP: the same"
echo "with optim. ZeRO-3 over I ranks is what an HSDP rank holds; HFSDP keeps its model weights and"
echo "splits main weights, gradients and AdamW state over all N ranks."
echo
echo "| ranks | instance | layout | model | main | grads | AdamW | persistent | transient | total |"
echo "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"
for pair in ${HYBRID:-64:8 512:8}; do
  n=${pair%%:*} inst=${pair##*:}
  for layout in "ZeRO-3 over $inst" "HSDP" "HFSDP" "ZeRO-3 over $n"; do
    case $layout in
      HSDP) world=$n extra=(--num-distributed-optimizer-instances $((n / inst))) ;;
      HFSDP) world=$n extra=(--num-distributed-optimizer-instances $((n / inst)) --outer-dp-sharding-strategy optim) ;;
      "ZeRO-3 over $inst") world=$inst extra=() ;;
      *) world=$n extra=() ;;
    esac
    log=$OUT/hybrid.$n.$inst.${layout// /_}.log
    "$BUILD/mfsdp-pretrain" "${MODEL[@]}" --bf16 --memory-plan --simulate-world-size "$world" "${extra[@]}" \
      >"$log" 2>&1 || { cat "$log" >&2; die "the plan failed ($log)"; }
    read -r mw main mg opt tr <<<"$(mib_fields "$log")"
    awk -v n="$n" -v i="$inst" -v l="$layout" -v mw="$mw" -v main="$main" -v mg="$mg" -v opt="$opt" -v tr="$tr" 'BEGIN {
      g = 1024; p = mw + main + mg + opt
      printf "| %d | %d | %s | %.2f | %.2f | %.2f | %.2f | **%.2f** | %.2f | %.2f |\n", n, i, l, mw / g, main / g, mg / g,
        opt / g, p / g, tr / g, (p + tr) / g }'
  done
done
[[ -z $CHECK_RANKS ]] && exit 0

echo
echo "## The plan against real simulated steps (ZeRO-3, MiB per rank)"
echo
echo "Each check: $BUILD/mfsdp-pretrain ${MODEL[*]} --mock-data --train-iters $CHECK_ITERS --global-batch-size N"
echo "  --eval-iters 0 --lr 1e-4 --init-model-with-meta-device --data-parallel-sharding-strategy optim_grads_params"
echo "  --simulate-world-size N --simulate-rank 0 [--bf16]  (OMP_NUM_THREADS=2)"
echo
echo "| ranks | precision | | model weights | main weights | main grads | AdamW | transient peak | process peak RSS | s/iteration |"
echo "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"
for n in $CHECK_RANKS; do
  for precision in $CHECK_PRECISIONS; do
    flags=() && [[ $precision == bf16 ]] && flags=(--bf16)
    plan_log=$OUT/check_plan.$n.$precision.log
    "$BUILD/mfsdp-pretrain" "${MODEL[@]}" "${flags[@]}" --memory-plan --simulate-world-size "$n" \
      --data-parallel-sharding-strategy optim_grads_params >"$plan_log" 2>&1 || die "the plan failed ($plan_log)"
    read -r pm pmain pg popt ptr <<<"$(mib_fields "$plan_log")"
    need=$(awk -v a="$pm" -v b="$pmain" -v c="$pg" -v d="$popt" -v e="$ptr" 'BEGIN{printf "%d", (a+b+c+d+e)/1024 + 6.5}')
    avail=$(free -g | awk '/^Mem:/{print $7}')
    if ((avail < need)); then
      echo "| $n | $precision | skipped: needs ~$need GiB, $avail GiB available | | | | | | | |"
      continue
    fi
    log=$OUT/check.$n.$precision.log
    OMP_NUM_THREADS=2 "$BUILD/mfsdp-pretrain" "${MODEL[@]}" "${flags[@]}" --mock-data --train-iters "$CHECK_ITERS" \
      --global-batch-size "$n" --log-interval 1 --eval-iters 0 --lr 1e-4 --init-model-with-meta-device \
      --data-parallel-sharding-strategy optim_grads_params --simulate-world-size "$n" --simulate-rank 0 \
      >"$log" 2>&1 || { tail -20 "$log" >&2; die "the simulated run at $n ranks failed ($log)"; }
    read -r mw main mg opt tr <<<"$(mib_fields "$log")"
    rss=$(sed -nE 's/.*process peak RSS ([0-9.e+]+).*/\1/p' "$log" | head -1)
    secs=$(sed -nE "s/.*iteration +$CHECK_ITERS\/ *$CHECK_ITERS .*elapsed time per iteration \(ms\): ([0-9.]+).*/\1/p" "$log" | head -1)
    printf '| %s | %s | plan | %s | %s | %s | %s | %s | | |\n' "$n" "$precision" "$pm" "$pmain" "$pg" "$popt" "$ptr"
    printf '| %s | %s | simulated step | %s | %s | %s | %s | %s | %s | %s |\n' "$n" "$precision" "$mw" "$main" "$mg" \
      "$opt" "$tr" "$rss" "$(awk -v ms="${secs:-0}" 'BEGIN{printf "%.1f", ms/1000}')"
    [[ "$pm $pmain $pg $popt $ptr" == "$mw $main $mg $opt $tr" ]] && verdict="equal" || verdict="DIFFERENT"
    echo "| $n | $precision | plan vs measured: $verdict | | | | | | | |"
  done
done
