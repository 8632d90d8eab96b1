#!/usr/bin/env bash
# Our communicator against c10d's of the same torch, on this machine: the CPU communicator
# against ProcessGroupGloo (BACKEND=gloo, the default), or our NCCL communicator against
# ProcessGroupNCCL on CUDA tensors, one GPU per rank (BACKEND=nccl). Runs
# build/bench/collective_bandwidth (ours) and bench/torch_collective_bandwidth.py (c10d) under
# mfsdp-run, alternating, ROUNDS times each, and prints per (op, size) the median time of each
# over the rounds and the ratio c10d / ours (> 1: ours faster).
#
#   bench/collective_bandwidth.sh [flags for both, e.g. --op all_gather --max-bytes 64M]
#   (ops: all_gather reduce_scatter all_reduce all_to_all_single; default all, one --op at most)
#   MFSDP_SHM=0 bench/collective_bandwidth.sh        # our TCP path instead of shared memory
#   bench/collective_bandwidth.sh --backend nccl     # or BACKEND=nccl: GPUs (one rank per GPU)
#
# Environment: BACKEND [gloo; a --backend flag wins] NPROC [2; with nccl the number of GPUs,
# nvidia-smi -L] ROUNDS [3] BUILD [<repo>/build] PYTHON [<repo>/.venv/bin/python].
# One GPU gives NCCL a world of 1 rank: still a valid (degenerate) measurement of the call
# overhead and the local copies; busbw is 0 there.
# Exit status: 0 on success, 1 when a run failed (its output is shown), 2 on bad settings.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${BUILD:-$ROOT/build}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
BACKEND=${BACKEND:-gloo}
ROUNDS=${ROUNDS:-3}
die() { echo "collective_bandwidth.sh: $*" >&2; exit 2; }
fail() { echo "collective_bandwidth.sh: $*" >&2; exit 1; }
# --backend is ours: take it out of the flags and pass it to both programs once.
args=()
while (($#)); do
  case $1 in
    --backend) (($# >= 2)) || die "--backend needs a value (gloo or nccl)"; BACKEND=$2; shift 2 ;;
    --backend=*) BACKEND=${1#--backend=}; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
[[ $BACKEND == gloo || $BACKEND == nccl ]] || die "BACKEND=$BACKEND: expected gloo or nccl"
if [[ $BACKEND == nccl ]]; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU') || true
  ((gpus > 0)) || [[ -n ${NPROC:-} ]] || die "BACKEND=nccl but nvidia-smi -L lists no GPU (set NPROC to override)"
  NPROC=${NPROC:-$gpus}
else
  NPROC=${NPROC:-2}
fi
[[ $NPROC =~ ^[1-9][0-9]*$ ]] || die "NPROC=$NPROC: expected a positive integer"
[[ -x $BUILD/bench/collective_bandwidth && -x $BUILD/mfsdp-run ]] ||
  die "$BUILD/bench/collective_bandwidth or mfsdp-run missing: build first (scripts/build.sh)"
"$PYTHON" -c 'import torch.distributed' 2>/dev/null || die "PYTHON=$PYTHON has no torch (scripts/setup.sh)"
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || die "ROUNDS=$ROUNDS: expected a positive integer"

out=$(mktemp -d "${TMPDIR:-/tmp}/collective_bandwidth.XXXXXX")
args+=(--backend "$BACKEND")
for ((r = 1; r <= ROUNDS; ++r)); do
  "$BUILD/mfsdp-run" --nproc-per-node "$NPROC" --no-tag "$BUILD/bench/collective_bandwidth" "${args[@]}" \
    > "$out/ours.$r" 2>&1 || { cat "$out/ours.$r"; fail "ours failed in round $r"; }
  OMP_NUM_THREADS=1 "$BUILD/mfsdp-run" --nproc-per-node "$NPROC" --no-tag "$PYTHON" \
    "$ROOT/bench/torch_collective_bandwidth.py" "${args[@]}" > "$out/c10d.$r" 2>&1 ||
    { cat "$out/c10d.$r"; fail "c10d failed in round $r"; }
done
grep -m1 '^# mfsdp' "$out/ours.1" || true
grep -m1 '^# c10d' "$out/c10d.1" || true
"$PYTHON" - "$out" "$ROUNDS" "$BACKEND" <<'PY'
import statistics, sys
out, rounds, backend = sys.argv[1], int(sys.argv[2]), sys.argv[3]
base_name = f"c10d {backend}"
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
print(f"# median over {rounds} rounds of each, alternating; ratio = {base_name} us / ours us (> 1: ours faster)")
print(f"{'op':<17} {'size':>8} | {'ours us':>10} {'GB/s':>7} | {base_name + ' us':>13} {'GB/s':>7} | {'ratio':>6}")
for key in ours:
    if key not in base:
        continue
    a, b = statistics.median(ours[key]), statistics.median(base[key])
    n = mb(key[1])
    print(f"{key[0]:<17} {key[1]:>8} | {a:10.1f} {n / a / 1e3:7.3f} | {b:13.1f} {n / b / 1e3:7.3f} | {b / a:6.2f}")
PY
echo "# raw outputs: $out"
