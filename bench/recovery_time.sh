#!/usr/bin/env bash
# Recovery time of a training job whose rank dies (docs/launcher.md, "Restarts"): mfsdp-pretrain
# under mfsdp-run --max-restarts 1 on NPROCS CPU ranks (one thread each), rank 0 SIGKILLed as soon
# as the checkpoint of iteration SAVE_AT exists. Recovery = from the kill to the first iteration
# the restarted start completes (its record in --metrics-file: rank 0 writes it, and the dead
# rank 0 writes nothing more, so every record after the kill is the new start's). Beside it, in
# the same round, the baseline: a cold start of the same job from the same checkpoint (a fresh
# mfsdp-run with --load --ckpt-step SAVE_AT) to its first completed iteration, and the step time.
# recovery - cold start is what a failure costs beyond starting again: noticing the dead rank,
# the survivors' exit with their own error lines (mfsdp-run waits at most 3 s), and stopping them.
#
# Each restarted job also reports mfsdp-run's goodput line (docs/launcher.md, "Goodput"): the
# job's wall time (first start to exit), productive (time in kept iterations), lost (iterations
# redone), restarting (failure to the next start's loop) and goodput = productive / wall.
#
# VARIANTS (default "persistent local") says which checkpoint the restart resumes from:
#   persistent: --save-interval SAVE_AT; the kill waits for latest_checkpointed_iteration.txt
#     (written once every rank's files are committed).
#   local: --save-interval 1000000 --non-persistent-save-interval SAVE_AT
#     --non-persistent-ckpt-type local, into a folder under /dev/shm that this script makes and
#     removes; the kill waits for every rank's manifest <dir>/mfsdp_job_*/iter_<SAVE_AT, 7
#     digits>/rank_NNNNN.json, and the restart must log that it loaded that local checkpoint.
# Both are compared with the same cold start (from the persistent checkpoint).
#
#   bench/recovery_time.sh                        # tiny and compute-bound models, 2 and 4 ranks, 3 rounds
#   ROUNDS=1 MODELS=tiny NPROCS=2 bench/recovery_time.sh   # smoke test (under a minute)
#   VARIANTS=persistent bench/recovery_time.sh    # without the local-checkpoint variant
#
# Models: tiny (2 layers x hidden 64, sequence 64, micro-batch 2: start-up dominates) and
# compute (4 layers x hidden 512, FFN 1536, sequence 128, global batch 8, micro-batch 1: about
# 1 s a step on 2 ranks). Every run: fp32, AdamW, ZeRO-3, random tokens (--mock-data), no validation
# (--eval-iters 0: the default 100 batches at the end would dominate the goodput line's wall time).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
ROUNDS=${ROUNDS:-3}
MODELS=${MODELS:-"tiny compute"}
NPROCS=${NPROCS:-"2 4"}
VARIANTS=${VARIANTS:-"persistent local"}
SAVE_AT=${SAVE_AT:-3}
ITERS=$((SAVE_AT + 3))
OUT=$(mktemp -d /tmp/mfsdp-recovery.XXXXXX)      # persistent checkpoints: the disk
SHM=$(mktemp -d /dev/shm/mfsdp-recovery.XXXXXX)  # local non-persistent checkpoints
trap 'rm -rf "$OUT" "$SHM"' EXIT

model_flags() {
  local common="--device cpu --tokenizer-type NullTokenizer --vocab-size 1024 --mock-data --log-interval 1 --eval-interval 100000 --eval-iters 0 --seed 1"
  case $1 in
    tiny) echo "$common --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 2 --global-batch-size 8" ;;
    compute) echo "$common --num-layers 4 --hidden-size 512 --ffn-hidden-size 1536 --swiglu --num-attention-heads 8 --seq-length 128 --micro-batch-size 1 --global-batch-size 8" ;;
    *) echo "unknown model $1" >&2; exit 2 ;;
  esac
}

now() { date +%s.%N; }
lines() { [ -f "$1" ] && wc -l < "$1" || echo 0; }

# Waits (at most 10 minutes) until file $1 has more than $2 lines; with $3 (a launcher's pid and
# its log), fails as soon as that process has ended without them, showing the end of its log.
wait_lines() {
  for _ in $(seq 1 30000); do
    [ "$(lines "$1")" -gt "$2" ] && return 0
    if [ -n "${3:-}" ] && ! kill -0 "$3" 2>/dev/null; then
      [ "$(lines "$1")" -gt "$2" ] && return 0
      echo "the job ended without another record in $1; the end of its log $4:" >&2
      tail -n 40 "$4" | cut -c1-400 >&2
      exit 1
    fi
    sleep 0.02
  done
  echo "timed out waiting for $1" >&2
  exit 1
}

# Waits (at most 10 minutes) until each of the glob patterns $2... matches a file under folder $1.
wait_files() {
  local dir=$1 f all
  shift
  for _ in $(seq 1 30000); do
    all=1
    for f in "$@"; do
      compgen -G "$dir/$f" > /dev/null || { all=0; break; }
    done
    [ "$all" = 1 ] && return 0
    sleep 0.02
  done
  echo "timed out waiting for $* under $dir" >&2
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

# The killed and restarted job, resuming from a persistent or a local checkpoint. Prints
# "recovery_s wall_s productive_s lost_s restarting_s goodput_pct" (all but the first from
# mfsdp-run's goodput line).
restart_run() {  # model nproc dir persistent|local
  local flags dir=$3 kind=$4 ckpt_flags watch launcher victim killed before first r
  local patterns=()
  flags=$(model_flags "$1")
  mkdir -p "$dir"
  if [ "$kind" = local ]; then
    watch=$SHM/$(basename "$dir")
    ckpt_flags="--save-interval 1000000 --non-persistent-save-interval $SAVE_AT --non-persistent-ckpt-type local --non-persistent-local-ckpt-dir $watch"
    for r in $(seq 0 $(($2 - 1))); do
      patterns+=("mfsdp_job_*/iter_$(printf %07d "$SAVE_AT")/rank_$(printf %05d "$r").json")
    done
  else
    watch=$dir/ckpt
    ckpt_flags="--save-interval $SAVE_AT"
    patterns=(latest_checkpointed_iteration.txt)
  fi
  # shellcheck disable=SC2086
  env OMP_NUM_THREADS=1 "$BUILD"/mfsdp-run --nproc-per-node "$2" --max-restarts 1 "$BUILD"/mfsdp-pretrain $flags \
    --train-iters "$ITERS" $ckpt_flags --save "$dir/ckpt" --load "$dir/ckpt" \
    --metrics-file "$dir/restart.jsonl" > "$dir/restart.log" 2>&1 &
  launcher=$!
  wait_files "$watch" "${patterns[@]}"
  victim=$(rank0_of "$launcher")
  kill -KILL "$victim"
  killed=$(now)
  before=$(lines "$dir/restart.jsonl")
  wait_lines "$dir/restart.jsonl" "$before" "$launcher" "$dir/restart.log"
  first=$(now)
  wait "$launcher"
  grep -q "restart 1 of at most 1" "$dir/restart.log" || { echo "no restart in $dir/restart.log" >&2; exit 1; }
  if [ "$kind" = local ]; then
    grep -q "loaded the non-persistent local checkpoint of iteration $SAVE_AT " "$dir/restart.log" ||
      { echo "the restart in $dir/restart.log did not resume from the local checkpoint" >&2; exit 1; }
    rm -rf "$watch"
  fi
  python3 - "$dir/restart.log" "$killed" "$first" <<'EOF'
import re, sys
text = open(sys.argv[1]).read()
m = re.search(r"mfsdp-run: goodput: wall ([0-9.]+) s,.* productive ([0-9.]+) s .* lost ([0-9.]+) s, "
              r"restarting ([0-9.]+) s .* goodput ([0-9.]+)%", text)
if not m:
    sys.exit(f"no goodput line in {sys.argv[1]}")
killed, first = map(float, sys.argv[2:])
print(f"{first - killed:.2f} " + " ".join(m.groups()))
EOF
}

# The baseline: a fresh launch from the persistent checkpoint of SAVE_AT that restart_run left in
# $3/ckpt, to its first completed iteration. Prints "step_s cold_s".
cold_run() {  # model nproc dir
  local flags dir=$3 launcher t0 cold_first
  flags=$(model_flags "$1")
  t0=$(now)
  # shellcheck disable=SC2086
  env OMP_NUM_THREADS=1 "$BUILD"/mfsdp-run --nproc-per-node "$2" "$BUILD"/mfsdp-pretrain $flags \
    --train-iters "$ITERS" --load "$dir/ckpt" --ckpt-step "$SAVE_AT" --metrics-file "$dir/cold.jsonl" \
    > "$dir/cold.log" 2>&1 &
  launcher=$!
  wait_lines "$dir/cold.jsonl" 0 "$launcher" "$dir/cold.log"
  cold_first=$(now)
  wait "$launcher"
  python3 - "$dir/cold.jsonl" "$t0" "$cold_first" <<'EOF'
import json, statistics, sys
steps = [json.loads(l)["iter_time_s"] for l in open(sys.argv[1])][1:]  # the first includes warm-up
t0, cold_first = map(float, sys.argv[2:])
print(f"{statistics.median(steps):.3f} {cold_first - t0:.2f}")
EOF
  rm -rf "$dir/ckpt"
}

echo "recovery_time: $(nproc) CPUs ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)), rounds $ROUNDS, checkpoint at iteration $SAVE_AT, variants: $VARIANTS"
results=$OUT/results
: > "$results"
for round in $(seq 1 "$ROUNDS"); do
  for model in $MODELS; do
    for n in $NPROCS; do
      base=$OUT/$round-$model-$n
      # The persistent run first: its checkpoint is the cold start's.
      persistent=$(restart_run "$model" "$n" "$base-persistent" persistent)
      cold=$(cold_run "$model" "$n" "$base-persistent")
      for variant in $VARIANTS; do
        case $variant in
          persistent) echo "$model $n persistent $cold $persistent" >> "$results" ;;
          local)
            local_run=$(restart_run "$model" "$n" "$base-local" local)
            echo "$model $n local $cold $local_run" >> "$results" ;;
          *) echo "unknown variant $variant" >&2; exit 2 ;;
        esac
      done
    done
  done
done
python3 - "$results" <<'EOF'
import collections, statistics, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    model, n, variant, *numbers = line.split()
    runs[(model, int(n), variant)].append([float(x) for x in numbers])
print(f"{'model':8} {'ranks':>5} {'resumes from':>12} {'step (s)':>9} {'cold start (s)':>15} {'recovery (s)':>13} "
      f"{'recovery / cold':>16} | {'wall (s)':>9} {'productive':>10} {'lost':>6} {'restarting':>10} {'goodput':>8}")
for (model, n, variant), rows in runs.items():
    step, cold, rec, wall, prod, lost, restarting, goodput = (statistics.median(r[i] for r in rows) for i in range(8))
    print(f"{model:8} {n:5d} {variant:>12} {step:9.3f} {cold:15.2f} {rec:13.2f} {rec / cold:15.2f}x | "
          f"{wall:9.1f} {prod:10.1f} {lost:6.1f} {restarting:10.1f} {goodput:7.1f}%")
print("medians over the rounds; cold start = a fresh launch from the persistent checkpoint to its first iteration;")
print("recovery = SIGKILL of rank 0 to the restarted start's first iteration (mfsdp-run --max-restarts 1);")
print("right of '|': mfsdp-run's goodput line for the killed-and-restarted job (seconds; goodput = productive / wall)")
EOF
