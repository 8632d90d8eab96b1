#!/usr/bin/env bash
# Recovery time of a training job whose rank dies (docs/launcher.md, "Restarts"): mfsdp-pretrain
# under mfsdp-run --max-restarts 1 on NPROCS CPU ranks (one thread each), rank 0 SIGKILLed as soon
# as the checkpoint of iteration SAVE_AT exists. Recovery = from the kill to the first iteration
# the restarted start completes (its record in --metrics-file: rank 0 writes it, and the dead
# rank 0 writes nothing more, so every record after the kill is the new start's). Beside it, in
# the same round, the baseline: a cold start of the same job from the same checkpoint (a fresh
# mfsdp-run with --load --ckpt-step SAVE_AT) to its first completed iteration, and the step time.
# recovery - cold start is what a failure costs beyond starting again: noticing the dead rank,
# mfsdp-run's 3 s for the survivors to exit with their own error lines, and stopping them.
#
#   bench/recovery_time.sh                        # tiny and compute-bound models, 2 and 4 ranks, 3 rounds
#   ROUNDS=1 MODELS=tiny NPROCS=2 bench/recovery_time.sh   # smoke test (under a minute)
#
# Models: tiny (2 layers x hidden 64, sequence 64, micro-batch 2: start-up dominates) and
# compute (4 layers x hidden 512, FFN 1536, sequence 128, global batch 8, micro-batch 1: about
# 1 s a step on 2 ranks). Every run: fp32, AdamW, ZeRO-3, random tokens (--mock-data).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
ROUNDS=${ROUNDS:-3}
MODELS=${MODELS:-"tiny compute"}
NPROCS=${NPROCS:-"2 4"}
SAVE_AT=${SAVE_AT:-3}
ITERS=$((SAVE_AT + 3))
OUT=$(mktemp -d /tmp/mfsdp-recovery.XXXXXX)
trap 'rm -rf "$OUT"' EXIT

model_flags() {
  local common="--device cpu --tokenizer-type NullTokenizer --vocab-size 1024 --mock-data --log-interval 1 --eval-interval 100000 --seed 1"
  case $1 in
    tiny) echo "$common --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 2 --global-batch-size 8" ;;
    compute) echo "$common --num-layers 4 --hidden-size 512 --ffn-hidden-size 1536 --swiglu --num-attention-heads 8 --seq-length 128 --micro-batch-size 1 --global-batch-size 8" ;;
    *) echo "unknown model $1" >&2; exit 2 ;;
  esac
}

now() { date +%s.%N; }
lines() { [ -f "$1" ] && wc -l < "$1" || echo 0; }

# Waits (at most 10 minutes) until file $1 has more than $2 lines.
wait_lines() {
  for _ in $(seq 1 30000); do
    [ "$(lines "$1")" -gt "$2" ] && return 0
    sleep 0.02
  done
  echo "timed out waiting for $1" >&2
  exit 1
}

# The mfsdp-pretrain process with RANK=0 among the descendants of pid $1.
rank0_of() {
  local frontier=$1 p
  while [ -n "$frontier" ]; do
    frontier=$(for p in $frontier; do pgrep -P "$p" || true; done)
    for p in $frontier; do
      if [ "$(cat /proc/"$p"/comm 2>/dev/null)" = mfsdp-pretrain ] &&
         tr '\0' '\n' < /proc/"$p"/environ 2>/dev/null | grep -qx RANK=0; then
        echo "$p"
        return
      fi
    done
  done
}

# One measurement: prints "step_s cold_s recovery_s".
measure() {  # model nproc dir
  local flags dir=$3 launcher victim killed before first t0
  flags=$(model_flags "$1")
  mkdir -p "$dir"
  # shellcheck disable=SC2086
  env OMP_NUM_THREADS=1 "$BUILD"/mfsdp-run --nproc-per-node "$2" --max-restarts 1 "$BUILD"/mfsdp-pretrain $flags \
    --train-iters "$ITERS" --save-interval "$SAVE_AT" --save "$dir/ckpt" --load "$dir/ckpt" \
    --metrics-file "$dir/restart.jsonl" > "$dir/restart.log" 2>&1 &
  launcher=$!
  for _ in $(seq 1 30000); do
    [ -f "$dir/ckpt/latest_checkpointed_iteration.txt" ] && break
    sleep 0.02
  done
  victim=$(rank0_of "$launcher")
  kill -KILL "$victim"
  killed=$(now)
  before=$(lines "$dir/restart.jsonl")
  wait_lines "$dir/restart.jsonl" "$before"
  first=$(now)
  wait "$launcher"
  grep -q "restart 1 of at most 1" "$dir/restart.log" || { echo "no restart in $dir/restart.log" >&2; exit 1; }
  t0=$(now)
  # shellcheck disable=SC2086
  env OMP_NUM_THREADS=1 "$BUILD"/mfsdp-run --nproc-per-node "$2" "$BUILD"/mfsdp-pretrain $flags \
    --train-iters "$ITERS" --load "$dir/ckpt" --ckpt-step "$SAVE_AT" --metrics-file "$dir/cold.jsonl" \
    > "$dir/cold.log" 2>&1 &
  launcher=$!
  wait_lines "$dir/cold.jsonl" 0
  local cold_first
  cold_first=$(now)
  wait "$launcher"
  python3 - "$dir/cold.jsonl" "$t0" "$cold_first" "$killed" "$first" <<'EOF'
import json, statistics, sys
steps = [json.loads(l)["iter_time_s"] for l in open(sys.argv[1])][1:]  # the first includes warm-up
t0, cold_first, killed, first = map(float, sys.argv[2:])
print(f"{statistics.median(steps):.3f} {cold_first - t0:.2f} {first - killed:.2f}")
EOF
}

echo "recovery_time: $(nproc) CPUs ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)), rounds $ROUNDS, checkpoint at iteration $SAVE_AT"
results=$OUT/results
: > "$results"
for round in $(seq 1 "$ROUNDS"); do
  for model in $MODELS; do
    for n in $NPROCS; do
      echo "$model $n $(measure "$model" "$n" "$OUT/$round-$model-$n")" >> "$results"
    done
  done
done
python3 - "$results" <<'EOF'
import collections, statistics, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    model, n, step, cold, recovery = line.split()
    runs[(model, int(n))].append((float(step), float(cold), float(recovery)))
print(f"{'model':8} {'ranks':>5} {'step (s)':>9} {'cold start (s)':>15} {'recovery (s)':>13} {'recovery / cold':>16}")
for (model, n), rows in runs.items():
    step, cold, rec = (statistics.median(r[i] for r in rows) for i in range(3))
    print(f"{model:8} {n:5d} {step:9.3f} {cold:15.2f} {rec:13.2f} {rec / cold:15.2f}x")
print("medians over the rounds; cold start = a fresh launch from the same checkpoint to its first iteration;")
print("recovery = SIGKILL of rank 0 to the restarted start's first iteration (mfsdp-run --max-restarts 1)")
EOF
