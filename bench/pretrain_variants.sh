#!/usr/bin/env bash
# Runs mfsdp-pretrain under several sets of flags in interleaved rounds (this VM is noisy) and
# prints, per set, the median peak RSS, step time and optimizer state, and each set's ratios to
# the first one (the baseline of the table). The engine of bench/fused_loss_memory.sh and
# bench/step_options.sh, which say what they compare.
#
#   MODEL="<mfsdp-pretrain flags>" TITLE="<one line>" bench/pretrain_variants.sh ROUNDS 'label::flags' ...
#
# Each run: one rank under mfsdp-run with bench/peak_rss.py around it (getrusage of the rank
# process), OMP_NUM_THREADS=2. Step time: the median iter_time_s of iterations 2.. from
# --metrics-file. Optimizer state: bytes a parameter, from the run's closing "memory per rank"
# line (optimizer state / main grads x 4: main grads are fp32, one element a parameter).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BUILD="${BUILD:-$ROOT/build}"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
: "${MODEL:?MODEL: the mfsdp-pretrain flags every run shares}"
ROUNDS="${1:?usage: MODEL=... bench/pretrain_variants.sh ROUNDS label::flags ...}"
shift
[ $# -ge 2 ] || { echo "pretrain_variants.sh: give a baseline and at least one other set of flags" >&2; exit 2; }
for tool in mfsdp-run mfsdp-pretrain; do
  [ -x "$BUILD/$tool" ] || { echo "pretrain_variants.sh: $BUILD/$tool is not built" >&2; exit 1; }
done
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

run_one() {  # $1 index, $2 flags; appends "index peak_mib median_s state_bytes_per_param" to $work/results
  local log="$work/$1.log" metrics="$work/$1.jsonl"
  rm -f "$metrics"
  # shellcheck disable=SC2086  # flags are words
  OMP_NUM_THREADS=2 "$BUILD/mfsdp-run" --nproc-per-node 1 "$PYTHON" "$ROOT/bench/peak_rss.py" \
    "$BUILD/mfsdp-pretrain" $MODEL $2 --metrics-file "$metrics" >"$log" 2>&1 ||
    { echo "pretrain_variants.sh: the run with '$2' failed:" >&2; tail -20 "$log" >&2; exit 1; }
  "$PYTHON" - "$1" "$log" "$metrics" >>"$work/results" <<'PY'
import json, re, statistics, sys
index, log, metrics = sys.argv[1:]
text = open(log).read()
peak = float(re.findall(r"peak_rss_mib ([0-9.]+)", text)[-1])
memory = re.findall(r"main grads ([0-9.]+), optimizer state ([0-9.]+)", text)[-1]
times = [json.loads(l)["iter_time_s"] for l in open(metrics) if '"eval"' not in l]
print(index, peak, statistics.median(times[1:]), 4 * float(memory[1]) / float(memory[0]))
PY
}

for r in $(seq 1 "$ROUNDS"); do
  i=0
  for variant in "$@"; do
    run_one "$i" "${variant#*::}"
    i=$((i + 1))
  done
done

"$PYTHON" - "$work/results" "$ROUNDS" "${TITLE:-}" "$@" <<'PY'
import statistics, sys
results, rounds, title, *variants = sys.argv[1:]
rows = [l.split() for l in open(results)]
def median(index, col):
    return statistics.median(float(r[col]) for r in rows if r[0] == str(index))
print("%s, %s rounds (medians)" % (title, rounds) if title else "%s rounds (medians)" % rounds)
print("| run | flags | peak RSS MiB | step s | optimizer state B/param | RSS vs first | step vs first |")
print("|---|---|---:|---:|---:|---:|---:|")
for i, v in enumerate(variants):
    label, flags = v.split("::", 1)
    print("| %s | %s | %.0f | %.3f | %.1f | %.2fx | %.2fx |" % (
        label, "`%s`" % flags.strip() if flags.strip() else "(defaults)", median(i, 1), median(i, 2), median(i, 3),
        median(i, 1) / median(0, 1), median(i, 2) / median(0, 2)))
PY
