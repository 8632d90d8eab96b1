#!/usr/bin/env bash
# Our CPU communicator against c10d's ProcessGroupGloo of the same pinned torch, on this machine:
# runs build/bench/collective_bandwidth (ours) and bench/torch_collective_bandwidth.py (c10d)
# under mfsdp-run, alternating, ROUNDS times each, and prints per (op, size) the median time of
# each over the rounds and the ratio c10d / ours (> 1: ours faster).
#
#   bench/collective_bandwidth.sh [flags for both, e.g. --op all_gather --max-bytes 64M]
#   MFSDP_SHM=0 bench/collective_bandwidth.sh        # our TCP path instead of shared memory
#
# Environment: NPROC [2] ROUNDS [3] BUILD [<repo>/build] PYTHON [<repo>/.venv/bin/python].
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${BUILD:-$ROOT/build}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
NPROC=${NPROC:-2}
ROUNDS=${ROUNDS:-3}
die() { echo "collective_bandwidth.sh: $*" >&2; exit 2; }
[[ -x $BUILD/bench/collective_bandwidth && -x $BUILD/mfsdp-run ]] ||
  die "$BUILD/bench/collective_bandwidth or mfsdp-run missing: build first (scripts/build.sh)"
"$PYTHON" -c 'import torch.distributed' 2>/dev/null || die "PYTHON=$PYTHON has no torch (scripts/setup.sh)"
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || die "ROUNDS=$ROUNDS: expected a positive integer"

out=$(mktemp -d "${TMPDIR:-/tmp}/collective_bandwidth.XXXXXX")
for ((r = 1; r <= ROUNDS; ++r)); do
  "$BUILD/mfsdp-run" --nproc-per-node "$NPROC" --no-tag "$BUILD/bench/collective_bandwidth" "$@" \
    > "$out/ours.$r" || { cat "$out/ours.$r"; die "ours failed in round $r"; }
  OMP_NUM_THREADS=1 "$BUILD/mfsdp-run" --nproc-per-node "$NPROC" --no-tag "$PYTHON" \
    "$ROOT/bench/torch_collective_bandwidth.py" "$@" > "$out/c10d.$r" ||
    { cat "$out/c10d.$r"; die "c10d failed in round $r"; }
done
head -1 "$out/ours.1"
head -1 "$out/c10d.1"
"$PYTHON" - "$out" "$ROUNDS" <<'PY'
import statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def read(kind):
    rows = {}
    for r in range(1, rounds + 1):
        for line in open(f"{out}/{kind}.{r}"):
            f = line.split()
            if len(f) == 6 and f[2] == "|" and f[0] != "op":
                rows.setdefault((f[0], f[1]), []).append(float(f[3]))
    return rows
ours, base = read("ours"), read("c10d")
def mb(size):
    return int(size[:-1]) << (20 if size[-1] == "M" else 10)
print(f"# median over {rounds} rounds of each, alternating; ratio = c10d us / ours us (> 1: ours faster)")
print(f"{'op':<15} {'size':>8} | {'ours us':>10} {'GB/s':>7} | {'c10d us':>10} {'GB/s':>7} | {'ratio':>6}")
for key in ours:
    if key not in base:
        continue
    a, b = statistics.median(ours[key]), statistics.median(base[key])
    n = mb(key[1])
    print(f"{key[0]:<15} {key[1]:>8} | {a:10.1f} {n / a / 1e3:7.3f} | {b:10.1f} {n / b / 1e3:7.3f} | {b / a:6.2f}")
PY
echo "# raw outputs: $out"
