#!/usr/bin/env bash
# Scale planning with pipeline parallelism: per-rank memory of Llama-3.1-405B at 512 ranks with
# TP 8 x PP 8 x DP 8 under every sharding strategy, bf16 mixed precision and fp32, as `mfsdp-pretrain
# --memory-plan --simulate-world-size N --tensor-model-parallel-size 8 --sequence-parallel
# --pipeline-model-parallel-size 8 --account-for-embedding-in-pipeline-split
# --account-for-loss-in-pipeline-split` plans it (each stage's own units, one TP rank's slices,
# sharded by fully_shard over the stage's N / (TP x PP) data-parallel ranks; nothing is allocated),
# next to Megatron-LM's theoretical memory formula for the most loaded pipeline stage
# (bench/megatron_memory_formula.py --pp: weights and optimizer, and its activation estimate, which
# the plan does not cover). One plan prints every stage; the tables show the first stage, a middle
# one and the last. Plan only: about a second per plan, 9 plans.
#
#   bench/scale_plan_pp.sh
#
# The split: 126 layers + the embedding + the loss counted as one layer each = 128 = 8 x 16, so the
# first and last stages build 15 decoder layers and the six middle ones 16 (Megatron's and
# TorchTitan's Llama-3.1-405B recipe).
#
# Environment (defaults in brackets): LAYERS [126] HIDDEN [16384] FFN [53248] HEADS [128]
#   KV_HEADS [8] VOCAB [128256] (untied) TP [8] PP [8] RANKS [512] PRECISIONS [bf16 fp32]
#   STRATEGIES [no_shard optim optim_grads optim_grads_params] SEQ [8192]
#   SPLIT [--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split] (the
#   layer-split flags, given to mfsdp-pretrain and the formula alike) MIDDLE [1] (the middle stage
#   shown; stages 1 to PP - 2 hold the same bytes, which the script checks, and stage 1 has the most
#   micro-batches in flight of them) BUILD [<repo>/build] OUT [a new temporary folder]
#   PYTHON [<repo>/.venv/bin/python, else python3] HBM_GIB [80 141] (the device sizes the
#   projection compares against)
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${BUILD:-$ROOT/build}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
[[ -x $PYTHON ]] || PYTHON=python3
LAYERS=${LAYERS:-126} HIDDEN=${HIDDEN:-16384} FFN=${FFN:-53248} HEADS=${HEADS:-128} KV_HEADS=${KV_HEADS:-8}
VOCAB=${VOCAB:-128256} TP=${TP:-8} PP=${PP:-8} RANKS=${RANKS:-512} PRECISIONS=${PRECISIONS:-bf16 fp32} SEQ=${SEQ:-8192}
STRATEGIES=${STRATEGIES:-no_shard optim optim_grads optim_grads_params}
SPLIT=${SPLIT:---account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split}
MIDDLE=${MIDDLE:-1} HBM_GIB=${HBM_GIB:-80 141}
OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/scale_plan_pp.XXXXXX")}
die() { echo "scale_plan_pp.sh: $*" >&2; exit 2; }
[[ -x $BUILD/mfsdp-pretrain ]] || die "$BUILD/mfsdp-pretrain not found: build first (scripts/build.sh)"
mkdir -p "$OUT" || die "cannot create OUT=$OUT"
((PP >= 3)) || die "PP must be >= 3 (the tables show a first, a middle and a last stage)"
((RANKS % (TP * PP) == 0)) || die "TP $TP x PP $PP does not divide $RANKS ranks"
((MIDDLE >= 1 && MIDDLE <= PP - 2)) || die "MIDDLE must be a middle stage, 1 to $((PP - 2))"
DP=$((RANKS / (TP * PP)))
read -r -a SPLIT_FLAGS <<<"$SPLIT"
MODEL=(--vocab-size "$VOCAB" --make-vocab-size-divisible-by 128 --num-layers "$LAYERS" --hidden-size "$HIDDEN"
  --ffn-hidden-size "$FFN" --num-attention-heads "$HEADS" --group-query-attention --num-query-groups "$KV_HEADS"
  --swiglu --untie-embeddings-and-output-weights --seq-length "$SEQ" --max-position-embeddings "$SEQ"
  --micro-batch-size 1 --tensor-model-parallel-size "$TP" --sequence-parallel
  --pipeline-model-parallel-size "$PP" "${SPLIT_FLAGS[@]}")
FORMULA=("$ROOT/bench/megatron_memory_formula.py" --layers "$LAYERS" --hidden "$HIDDEN" --ffn "$FFN" --heads "$HEADS"
  --kv-heads "$KV_HEADS" --vocab "$VOCAB" --divisible-by 128 --tp "$TP" --pp "$PP" --dp "$DP" --seq "$SEQ"
  --micro-batch 1 "${SPLIT_FLAGS[@]}")

echo "- machine: $(nproc) cores, $(grep -m1 '^model name' /proc/cpuinfo | sed 's/^[^:]*: *//'), $(free -g | awk '/^Mem:/{print $2}') GiB"
echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC'); mfsdp commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null)$(git -C "$ROOT" diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
echo "- command: bench/scale_plan_pp.sh (TP=$TP PP=$PP RANKS=$RANKS PRECISIONS=\"$PRECISIONS\" SEQ=$SEQ MIDDLE=$MIDDLE)"
echo "- plan: $BUILD/mfsdp-pretrain ${MODEL[*]} --memory-plan --simulate-world-size $RANKS --data-parallel-sharding-strategy S [--bf16]"
echo "- Megatron: bench/megatron_memory_formula.py ${FORMULA[*]:1}"

json=$OUT/megatron.json
"$PYTHON" "${FORMULA[@]}" >"$json" || die "bench/megatron_memory_formula.py failed"
# A field of the formula's JSON; a list's entry with an index.
field() { "$PYTHON" -c 'import json,sys; v=json.load(open(sys.argv[1]))[sys.argv[2]]; print(v[int(sys.argv[3])] if len(sys.argv) > 3 else v)' "$json" "$@"; }

# One plan's stages as tab-separated rows: stage, its decoder layers as ranges ("0-14"; one per
# virtual chunk, ";"-separated, "-" when none) and their count, the stage's extra units, the units' elements and padded elements P, then the bytes per rank of
# model weights, main weights, main grads, optimizer state, persistent, transient peak, total,
# and where the peak is reached; a last row "final" with the closing "planned memory per rank
# (MiB)" line's five numbers (the simulated rank's stage).
parse_plan() {
  "$PYTHON" - "$1" <<'EOF'
import re, sys
stages, cur, final = [], None, None
for line in open(sys.argv[1]):
    m = re.match(r"\s*pipeline stage (\d+) of \d+: (.*)", line)
    if m:
        chunks = [(int(a), int(b)) for a, b in re.findall(r"decoder layers (\d+) to (\d+)", m.group(2))]
        extra = "+".join(w for w, key in (("embedding", "the embedding"), ("output layer", "the output layer"))
                         if key in m.group(2)) or "-"
        cur = {"stage": int(m.group(1)), "ranges": ";".join(f"{a}-{b}" for a, b in chunks if b >= a) or "-",
               "count": sum(b - a + 1 for a, b in chunks), "extra": extra, "elements": 0, "padded": 0}
        stages.append(cur)
        continue
    fields = line.split()
    if cur is not None and len(fields) > 8 and fields[7] == "|" and fields[3].isdigit() and fields[2] in ("bf16", "fp32"):
        cur["elements"] += int(fields[4])
        cur["padded"] += int(fields[5])
        continue
    m = re.search(r"per rank: model weights (\d+) B .*main weights (\d+) B .*main grads (\d+) B .*optimizer state (\d+) B", line)
    if m and cur is not None:
        cur["bytes"] = [int(x) for x in m.groups()]
        continue
    m = re.search(r"per rank: persistent (\d+) B .*transient peak (\d+) B \([^,]*, at: (.*)\), total (\d+) B", line)
    if m and cur is not None:
        cur["persistent"], cur["transient"], cur["at"], cur["total"] = int(m.group(1)), int(m.group(2)), m.group(3), int(m.group(4))
        continue
    m = re.search(r"planned memory per rank \(MiB\): model weights ([^,]+), main weights ([^,]+), main grads ([^,]+), "
                  r"optimizer state ([^,]+), transient peak ([^,\s]+)", line)
    if m:
        final = m.groups()
for s in stages:
    if "bytes" not in s or "total" not in s:
        sys.exit(f"stage {s['stage']}: no per-rank lines")
    print("\t".join(str(x) for x in [s["stage"], s["ranges"], s["count"], s["extra"], s["elements"], s["padded"], *s["bytes"],
                                     s["persistent"], s["transient"], s["total"], s["at"]]))
if final is None:
    sys.exit("no planned memory line")
print("\t".join(["final", *final]))
EOF
}
# Row of stage $2 in the parsed plan $1 (tab-separated fields).
stage_row() { awk -F'\t' -v s="$2" '$1 == s' "$1"; }
# Does the closing line match stage $2's bytes? It prints MiB to 2 decimals or 6 significant digits.
final_matches() {
  awk -F'\t' -v s="$2" 'function off(x, y) { d = x - y; if (d < 0) d = -d; return d > 0.011 && d > 1e-5 * y }
    $1 == s { for (i = 0; i < 4; i++) b[i] = $(7 + i); b[4] = $12 }
    $1 == "final" { for (i = 0; i < 5; i++) f[i] = $(2 + i) }
    END { ok = 1; for (i = 0; i < 5; i++) if (off(f[i], b[i] / 1048576)) ok = 0; exit !ok }' "$1"
}

start=$(date +%s.%N)
for precision in $PRECISIONS; do
  flags=() && [[ $precision == bf16 ]] && flags=(--bf16)
  for strategy in $STRATEGIES; do
    log=$OUT/plan.$precision.$strategy.log
    t0=$(date +%s.%N)
    "$BUILD/mfsdp-pretrain" "${MODEL[@]}" "${flags[@]}" --memory-plan --simulate-world-size "$RANKS" \
      --data-parallel-sharding-strategy "$strategy" >"$log" 2>&1 || { cat "$log" >&2; die "the plan failed ($log)"; }
    t1=$(date +%s.%N)
    parse_plan "$log" >"$OUT/stages.$precision.$strategy.tsv" || die "cannot read the plan's stages ($log)"
    awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f\n", b - a }' >"$OUT/seconds.$precision.$strategy"
  done
done
# The closing line is the simulated rank's stage: rank r is on stage r / (N / PP). Rank 0 above;
# the last rank once more here.
first_precision=$(set -- $PRECISIONS; echo "$1") first_strategy=$(set -- $STRATEGIES; echo "$1")
last_strategy=$(set -- $STRATEGIES; eval echo "\${$#}")
flags=() && [[ $first_precision == bf16 ]] && flags=(--bf16)
log=$OUT/plan.$first_precision.$last_strategy.rank$((RANKS - 1)).log
"$BUILD/mfsdp-pretrain" "${MODEL[@]}" "${flags[@]}" --memory-plan --simulate-world-size "$RANKS" \
  --simulate-rank $((RANKS - 1)) --data-parallel-sharding-strategy "$last_strategy" >"$log" 2>&1 ||
  { cat "$log" >&2; die "the plan failed ($log)"; }
parse_plan "$log" >"$OUT/stages.last_rank.tsv" || die "cannot read the plan's stages ($log)"
elapsed=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')

# Checks: the plan's split is Megatron's, the middle stages hold the same bytes, the closing line
# is the simulated rank's stage.
notes=()
ref=$OUT/stages.$first_precision.$first_strategy.tsv
for ((s = 0; s < PP; s++)); do
  IFS=$'\t' read -r _ _ n _ <<<"$(stage_row "$ref" "$s")"
  want=$(field pp_stage_layers "$s")
  ((n == want)) || die "stage $s: the plan builds $n decoder layers, Megatron's split $want"
done
for f in "$OUT"/stages.*.*.tsv; do
  [[ $f == *last_rank* ]] && continue
  mid=$(awk -F'\t' -v p="$PP" '$1 != "final" && $1 >= 1 && $1 <= p - 2 { k = $5 FS $6; for (i = 7; i <= 13; i++) k = k FS $i; print k }' "$f" | sort -u | wc -l)
  ((mid == 1)) || notes+=("$(basename "$f"): the middle stages do not all hold the same bytes")
  final_matches "$f" 0 || notes+=("$(basename "$f"): the closing line is not stage 0's (rank 0)")
done
final_matches "$OUT/stages.last_rank.tsv" $((PP - 1)) ||
  notes+=("rank $((RANKS - 1)): the closing line is not stage $((PP - 1))'s")
cmp -s <(grep -v '^final' "$OUT/stages.last_rank.tsv") <(grep -v '^final' "$OUT/stages.$first_precision.$last_strategy.tsv") ||
  notes+=("rank $((RANKS - 1)): the stage tables differ from rank 0's")

total=$(field total_params) most=$(field megatron_params_most_loaded_shard) other=$(field megatron_params_other_shards)
echo
echo "## Llama-3.1-405B with TP $TP x PP $PP x DP $DP ($RANKS ranks, untied, AdamW): the layer split and parameters per TP rank"
echo
awk -v t="$total" -v v="$(field padded_vocab)" -v m="$most" -v o="$other" -v tp="$TP" -v pp="$PP" -v l="$LAYERS" 'BEGIN {
  printf "%.3fB parameters (vocabulary padded to %d, a multiple of 128 x TP). Megatron'"'"'s formula counts %.4fB on the\n", t / 1e9, v, m / 1e9
  printf "most loaded shard (%d / %d = %.2f layers + the embedding, / %d; norms / %d too) and %.4fB on the others.\n", l, pp, l / pp, tp, tp, o / 1e9 }'
echo "The plan's elements are its units' \`elements\` column (parameters and row-alignment gaps), P their"
echo "padded flat size for $DP shards (from the $first_precision $first_strategy plan); exact: the stage's layers (matrices / $TP,"
echo "norms whole), the embedding / $TP on the first stage, the final norm and the output layer / $TP on the last."
echo
echo "| stage | decoder layers | layers | also | plan elements | plan P | exact (formula) | P - exact | P / Megatron's most loaded |"
echo "|---:|---|---:|---|---:|---:|---:|---:|---:|"
for ((s = 0; s < PP; s++)); do
  IFS=$'\t' read -r _ ranges n extra el pad _ <<<"$(stage_row "$ref" "$s")"
  awk -v s="$s" -v r="$ranges" -v n="$n" -v x="$extra" -v el="$el" -v pad="$pad" -v e="$(field stage_params_exact "$s")" -v m="$most" 'BEGIN {
    printf "| %d | %s | %d | %s | %.0f | %.0f | %.0f | %+.0f (%.3f %%) | %.4f |\n", s, r, n, x, el, pad, e, pad - e,
      100 * (pad - e) / e, pad / m }'
done

ddp=$(field megatron_ddp_gib) distopt=$(field megatron_distopt_gib)
for s in 0 "$MIDDLE" $((PP - 1)); do
  case $s in 0) name=first ;; $((PP - 1))) name=last ;; *) name=middle ;; esac
  IFS=$'\t' read -r _ ranges n extra _ <<<"$(stage_row "$ref" "$s")"
  echo
  echo "## Stage $s of $PP ($name): decoder layers $ranges ($n)$([[ $extra != - ]] && echo ", the $extra"), GiB per rank"
  echo
  echo "| strategy | precision | model | main | grads | AdamW | persistent | transient | total | peak at | bytes/param formula | Megatron (most loaded) | plan s |"
  echo "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"
  exact=$(field stage_params_exact "$s")
  for precision in $PRECISIONS; do
    for strategy in $STRATEGIES; do
      IFS=$'\t' read -r _ _ _ _ _ _ mw main mg opt pers tr tot at <<<"$(stage_row "$OUT/stages.$precision.$strategy.tsv" "$s")"
      awk -v s="$strategy" -v p="$precision" -v dp="$DP" -v psi="$exact" -v mw="$mw" -v main="$main" -v mg="$mg" -v opt="$opt" \
        -v pers="$pers" -v tr="$tr" -v tot="$tot" -v at="$at" -v ddp="$ddp" -v distopt="$distopt" \
        -v secs="$(cat "$OUT/seconds.$precision.$strategy")" 'BEGIN {
        g = 1024 * 1024 * 1024; w = (p == "bf16") ? 2 : 4; gr = 4; k = (p == "bf16") ? 12 : 8
        if (s == "no_shard") z = (w + gr + k) * psi
        else if (s == "optim") z = (w + gr) * psi + k * psi / dp
        else if (s == "optim_grads") z = w * psi + (gr + k) * psi / dp
        else z = (w + gr + k) * psi / dp
        m = "-"
        if (p == "bf16" && s == "no_shard") m = sprintf("%.2f", ddp)
        if (p == "bf16" && s == "optim") m = sprintf("%.2f", distopt)
        printf "| %s | %s | %.2f | %.2f | %.2f | %.2f | **%.2f** | %.2f | %.2f | %s | %.2f | %s | %s |\n", s, p, mw / g, main / g,
          mg / g, opt / g, pers / g, tr / g, tot / g, at, z / g, m, secs }'
    done
  done
done

echo
echo "## Megatron's formula, term by term (bf16, distributed optimizer, DP $DP; activations: --sequence-parallel,"
echo "## selective recompute, seq $SEQ, micro-batch 1, $PP micro-batches in flight on the first stage), GiB per rank"
echo
echo "| shard | parameters | weights (2 B) | grads (4 B) | main + Adam (12 B / DP) | weights + optimizer | activations | total |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|"
awk -v m="$most" -v o="$other" -v dp="$DP" -v a="$(field megatron_activations_sp_gib)" 'BEGIN {
  g = 1024 * 1024 * 1024
  printf "| most loaded (the first stage) | %.4fB | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f |\n", m / 1e9, 2 * m / g, 4 * m / g,
    12 * m / dp / g, (6 + 12 / dp) * m / g, a, (6 + 12 / dp) * m / g + a
  printf "| the others (block / PP; Megatron prints the count only) | %.4fB | %.2f | %.2f | %.2f | %.2f | - | - |\n", o / 1e9,
    2 * o / g, 4 * o / g, 12 * o / dp / g, (6 + 12 / dp) * o / g }'
echo
echo "Megatron's activation estimate without sequence parallelism (the form it prints otherwise): $(awk -v x="$(field megatron_activations_nosp_gib)" 'BEGIN { printf "%.2f", x }') GiB."

echo
echo "## Activations per stage (not Megatron's formula: its per-layer and embedding terms on each stage's"
echo "## own layers, with 1F1B's PP - s micro-batches in flight on stage s; the output layer's input and"
echo "## cross-entropy once on the last stage), GiB per rank"
echo
echo "| stage | layers | in flight | activations |"
echo "|---:|---:|---:|---:|"
for ((s = 0; s < PP; s++)); do
  awk -v s="$s" -v l="$(field pp_stage_layers "$s")" -v f=$((PP - s)) -v a="$(field stage_activations_sp_gib "$s")" 'BEGIN {
    printf "| %d | %d | %d | %.2f |\n", s, l, f, a }'
done

echo
echo "## Projection (bf16; the plan's persistent + transient, plus the stage's activation estimate above)"
echo
hdr="| stage | strategy | persistent | transient | activations | total |" sep="|---:|---|---:|---:|---:|---:|"
for h in $HBM_GIB; do hdr+=" $h GiB |" sep+="---|"; done
echo "$hdr"
echo "$sep"
if [[ " $PRECISIONS " == *" bf16 "* ]]; then
  for s in 0 "$MIDDLE" $((PP - 1)); do
    act=$(field stage_activations_sp_gib "$s")
    for strategy in $STRATEGIES; do
      IFS=$'\t' read -r _ _ _ _ _ _ _ _ _ _ pers tr _ <<<"$(stage_row "$OUT/stages.bf16.$strategy.tsv" "$s")"
      awk -v s="$s" -v st="$strategy" -v a="$act" -v pers="$pers" -v tr="$tr" -v hbm="$HBM_GIB" 'BEGIN {
        g = 1024 * 1024 * 1024; sum = pers / g + tr / g + a
        printf "| %d | %s | %.2f | %.2f | ~%.2f | ~%.1f |", s, st, pers / g, tr / g, a, sum
        n = split(hbm, hs, " "); for (i = 1; i <= n; i++) printf " %s |", (sum <= hs[i]) ? "fits" : "exceeds"
        printf "\n" }'
    done
  done
  awk -v d="$distopt" -v a="$(field megatron_activations_sp_gib)" -v hbm="$HBM_GIB" 'BEGIN {
    sum = d + a; printf "\nMegatron'"'"'s own total for its most loaded shard (distributed optimizer): %.2f + %.2f = %.1f GiB (", d, a, sum
    n = split(hbm, hs, " "); for (i = 1; i <= n; i++) printf "%s%s %s GiB", (i > 1) ? ", " : "", (sum <= hs[i]) ? "fits" : "exceeds", hs[i]
    printf ").\n" }'
fi

echo
echo "Checks: the plan builds Megatron's split (${LAYERS} layers as $(field pp_stage_layers | tr -d ' ')); the closing"
echo "\"planned memory per rank\" line is stage 0's for rank 0 and stage $((PP - 1))'s for rank $((RANKS - 1)) (--simulate-rank);"
echo "stages 1 to $((PP - 2)) hold the same bytes. $(( $(set -- $PRECISIONS; echo $#) * $(set -- $STRATEGIES; echo $#) + 1 )) plans in $elapsed s."
if ((${#notes[@]})); then
  echo
  echo "**Discrepancies:**"
  for n in "${notes[@]}"; do echo "- $n"; done
else
  echo "All checks passed."
fi
echo
echo "(plans and formula output: $OUT)"
