#!/usr/bin/env bash
# The README's main job. Until fully_shard lands (issue "fully_shard") this demo shows what the
# foundation does: 2 ranks started by mfsdp-run train a small model data-parallel with the Gloo
# communicator (gradients averaged by all_reduce), then the collective bandwidth benchmark
# compares our Gloo collectives with c10d's ProcessGroupGloo in the same run.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
echo "== data-parallel SGD on 2 ranks (mfsdp-run + Gloo communicator)"
build/mfsdp-run --nproc-per-node 2 build/mfsdp-example-allreduce-sgd --steps 200
echo "== collective bandwidth, 2 ranks, ours vs c10d ProcessGroupGloo (1 KiB .. 64 MiB)"
build/mfsdp-run --nproc-per-node 2 --no-tag build/bench/collective_bandwidth --max-bytes 64M
