#!/usr/bin/env bash
# Checkpoint save / load throughput, mfsdp's fsdp_dtensor beside PyTorch's
# torch.distributed.checkpoint (FileSystemWriter with TORCH_THREADS writer threads, the .venv's
# torch), on the same sharded model and AdamW state (bench/ckpt_throughput.cpp,
# bench/ckpt_throughput_torch.py), the same NPROC ranks, interleaved round after round:
#   save           NPROC ranks write the checkpoint (into an emptied folder: the previous rep's is removed untimed)
#   load           NPROC ranks read it back into the model and optimizer
#   load@OTHER     OTHER_NPROC ranks read the NPROC-rank checkpoint (resharding)
# GB/s per rank = checkpoint bytes (12 x parameters) / slowest rank's seconds / ranks; median of
# all reps of all rounds. DROP_CACHE_CMD (e.g. "sync; echo 3 > /proc/sys/vm/drop_caches", needs
# root) runs before every load rep; without it loads read from the page cache (said in the table).
#
#   bench/ckpt_throughput.sh                                   # defaults below
#   LAYERS=2 WIDTH=256 ROUNDS=1 REPS=1 bench/ckpt_throughput.sh   # smoke test
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BUILD="${BUILD:-$ROOT/build}"
PYTHON="${MFSDP_PYTHON:-$ROOT/.venv/bin/python}"
LAYERS="${LAYERS:-8}" WIDTH="${WIDTH:-2048}" NPROC="${NPROC:-2}" OTHER_NPROC="${OTHER_NPROC:-1}"
REPS="${REPS:-3}" ROUNDS="${ROUNDS:-2}" TORCH_THREADS="${TORCH_THREADS:-1 4}"
DROP_CACHE_CMD="${DROP_CACHE_CMD:-}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/mfsdp-ckpt-bench-XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
OUT="$WORK/results.jsonl"
common=(--layers "$LAYERS" --width "$WIDTH" --reps "$REPS")
[ -n "$DROP_CACHE_CMD" ] && common+=(--drop-cache-cmd "$DROP_CACHE_CMD")

mfsdp() {  # ranks op
  OMP_NUM_THREADS=1 "$BUILD/mfsdp-run" --no-tag --nproc-per-node "$1" "$BUILD/bench/ckpt_throughput" --dir "$WORK/mfsdp" \
    --op "$2" "${common[@]}" 2>"$WORK/mfsdp.err" | grep '^{' | sed "s/\"op\": \"load\"/\"op\": \"load$3\"/" >> "$OUT" ||
    { echo "mfsdp run failed ($1 ranks, $2):" >&2; tail -20 "$WORK/mfsdp.err" >&2; exit 1; }
}
torch_dcp() {  # ranks op threads
  OMP_NUM_THREADS=1 "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$1" \
    "$ROOT/bench/ckpt_throughput_torch.py" --dir "$WORK/torch$3" --op "$2" --threads "$3" "${common[@]}" \
    2>"$WORK/torch.err" | grep '^{' | sed "s/\"op\": \"load\"/\"op\": \"load$4\"/" >> "$OUT" ||
    { echo "torch run failed ($1 ranks, $2, threads $3); its stderr: ${TMPDIR:-/tmp}/ckpt-bench-torch.err" >&2
      cp "$WORK/torch.err" "${TMPDIR:-/tmp}/ckpt-bench-torch.err"; grep -v '^ ' "$WORK/torch.err" | tail -20 >&2; exit 1; }
}
for round in $(seq "$ROUNDS"); do
  echo "round $round" >&2
  if [ $((round % 2)) = 1 ]; then order="mfsdp torch"; else order="torch mfsdp"; fi
  for impl in $order; do
    if [ "$impl" = mfsdp ]; then
      mfsdp "$NPROC" save ""; mfsdp "$NPROC" load ""; mfsdp "$OTHER_NPROC" load "@$OTHER_NPROC"
    else
      for t in $TORCH_THREADS; do
        torch_dcp "$NPROC" save "$t" ""; torch_dcp "$NPROC" load "$t" ""; torch_dcp "$OTHER_NPROC" load "$t" "@$OTHER_NPROC"
      done
    fi
  done
done
"$PYTHON" - "$OUT" "$NPROC" "${DROP_CACHE_CMD:+dropped}" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
nproc, cache = int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else ""
size = rows[0]["bytes"]
print(f"# checkpoint {size / 2**30:.2f} GiB of tensor data (fp32 weights + AdamW moments), saved by {nproc} ranks; "
      f"page cache {'dropped before each load' if cache else 'NOT dropped (loads may read from memory)'}")
print(f"# GB/s per rank (1 GB = 1e9 bytes), median over every rep of every round")
ops = []
for r in rows:
    if r["op"] not in ops: ops.append(r["op"])
impls = []
for r in rows:
    if r["impl"] not in impls: impls.append(r["impl"])
print(f"{'impl':24s} | " + " | ".join(f"{op:>10s}" for op in ops))
med = {}
for impl in impls:
    cells = []
    for op in ops:
        sel = [r["bytes"] / r["seconds"] / r["ranks"] / 1e9 for r in rows if r["impl"] == impl and r["op"] == op]
        med[impl, op] = statistics.median(sel) if sel else float("nan")
        cells.append(f"{med[impl, op]:10.3f}")
    print(f"{impl:24s} | " + " | ".join(cells))
for base in [i for i in impls if i.startswith("mfsdp")]:
    for impl in [i for i in impls if not i.startswith("mfsdp")]:
        print(f"{base} / {impl}: " + ", ".join(f"{op} {med[base, op] / med[impl, op]:.2f}x" for op in ops
                                                if med[base, op] == med[base, op]))
PY
