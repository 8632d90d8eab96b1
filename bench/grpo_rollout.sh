#!/usr/bin/env bash
# GRPO step time by phase, the two rollout modes of mfsdp-grpo against each other on the same
# model, prompts and seeds (docs/grpo.md):
#   full     every rank gathers the whole policy (full_state_dict), generates locally, frees it
#   sharded  generation through the shards, every forward all-gathering, ranks in lock-step
# Both sample the same responses (per-row seeds), so the phases do the same work. Prints the
# median of each timing_s/* metric over the steps after WARMUP, the weight sync's share of the
# step, and sharded / full.
#
#   bench/grpo_rollout.sh                          # default model (below)
#   LAYERS=2 HIDDEN=64 STEPS=4 bench/grpo_rollout.sh   # smoke test
#
# Environment (defaults in brackets): LAYERS [4] HIDDEN [128] FFN [352] HEADS [4] PROMPTS [32]
# N [16] RESPONSE [6] STEPS [20] WARMUP [3] NPROC [2] DEVICE [cpu] BUILD [<repo>/build]
# PYTHON [<repo>/.venv/bin/python] OUT [a new temporary folder; kept].
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${BUILD:-$ROOT/build}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
LAYERS=${LAYERS:-4} HIDDEN=${HIDDEN:-128} FFN=${FFN:-352} HEADS=${HEADS:-4}
PROMPTS=${PROMPTS:-32} N=${N:-16} RESPONSE=${RESPONSE:-6} STEPS=${STEPS:-20} WARMUP=${WARMUP:-3}
NPROC=${NPROC:-2} DEVICE=${DEVICE:-cpu}
OUT=${OUT:-$(mktemp -d /tmp/mfsdp-grpo-bench-XXXXXX)}
for tool in mfsdp-run mfsdp-grpo; do
  [ -x "$BUILD/$tool" ] || { echo "grpo_rollout: $BUILD/$tool is missing (scripts/build.sh)" >&2; exit 2; }
done

for mode in full sharded; do
  "$BUILD/mfsdp-run" --nproc-per-node "$NPROC" "$BUILD/mfsdp-grpo" --device "$DEVICE" \
    --tokenizer-type ByteLevelTokenizer --num-layers "$LAYERS" --hidden-size "$HIDDEN" \
    --ffn-hidden-size "$FFN" --num-attention-heads "$HEADS" --swiglu --seed 1 \
    --gen-task arith --gen-train-size 2000 --gen-val-size 0 --max-prompt-length 32 \
    --max-response-length "$RESPONSE" --train-batch-size "$PROMPTS" --rollout-n "$N" \
    --micro-batch-size $((PROMPTS * N / NPROC)) --train-iters "$STEPS" --lr 1e-4 --entropy-coeff 0.01 \
    --log-interval 1000 --rollout-mode "$mode" --metrics-file "$OUT/$mode.jsonl" > "$OUT/$mode.log" 2>&1 \
    || { echo "grpo_rollout: the $mode run failed:" >&2; cat "$OUT/$mode.log" >&2; exit 1; }
done

"$PYTHON" - "$OUT" "$WARMUP" <<'EOF'
import json, statistics, sys
out, warmup = sys.argv[1], int(sys.argv[2])
keys = ["timing_s/update_weights", "timing_s/gen", "timing_s/old_log_prob", "timing_s/update_actor", "timing_s/step"]
med = {}
for mode in ("full", "sharded"):
    steps = [json.loads(l) for l in open(f"{out}/{mode}.jsonl")]
    steps = [s for s in steps if not s.get("eval")][warmup:]
    med[mode] = {k: statistics.median(s[k] for s in steps) for k in keys}
    med[mode]["length"] = statistics.mean(s["response_length/mean"] for s in steps)
print(f"{'median seconds':<24}{'full':>10}{'sharded':>10}{'sharded/full':>14}")
for k in keys:
    f, s = med["full"][k], med["sharded"][k]
    print(f"{k:<24}{f:>10.4f}{s:>10.4f}{(s / f if f > 0 else float('nan')):>14.2f}")
print(f"{'weight sync / step':<24}{med['full']['timing_s/update_weights'] / med['full']['timing_s/step']:>10.4f}")
# The same sampled responses in both modes (per-row seeds): their mean length agrees.
print(f"{'mean response length':<24}{med['full']['length']:>10.4f}{med['sharded']['length']:>10.4f}")
print(f"raw metrics: {out}")
EOF
