#!/usr/bin/env python3
"""The c10d baseline of bench/collective_bandwidth.sh: torch.distributed's ProcessGroupGloo of
the project's pinned torch (the same LibTorch mfsdp is built against), timed exactly like
bench/collective_bandwidth.cpp times ours, and printed in the same table format.

    mfsdp-run --nproc-per-node 2 .venv/bin/python bench/torch_collective_bandwidth.py \
        [--min-bytes 1K] [--max-bytes 256M] [--step-factor 4] [--trials 9] [--op all_gather]

c10d 2.x's gloo backend has flat collectives: all_gather_into_tensor, reduce_scatter_tensor and
all_reduce on one flat fp32 tensor, so no workaround is timed.
"""
import argparse
import datetime
import os
import statistics
import time

import torch
import torch.distributed as dist


def size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    n = int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return n


def human(n):
    return f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K"


def time_trial(nbytes, op):
    """Seconds per call: mean over a trial, slowest rank (as collective_bandwidth.cpp)."""
    iters = min(max((64 << 20) // nbytes, 3), 50)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        op()
    t = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def make_op(name, nbytes, n):
    numel = max(nbytes // 4 // n, 1) * n
    full, part = torch.randn(numel), torch.randn(numel // n)
    ring = (n - 1) / n
    if name == "all_gather":
        return (lambda: dist.all_gather_into_tensor(full, part)), ring
    if name == "reduce_scatter":
        return (lambda: dist.reduce_scatter_tensor(part, full)), ring
    if name == "all_reduce":
        return (lambda: dist.all_reduce(full)), 2 * ring
    raise SystemExit(f"--op: unknown operation {name!r} (all_gather, reduce_scatter, all_reduce)")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--min-bytes", type=size, default=1 << 10)
    p.add_argument("--max-bytes", type=size, default=256 << 20)
    p.add_argument("--step-factor", type=int, default=4)
    p.add_argument("--trials", type=int, default=9)
    p.add_argument("--op", action="append")
    a = p.parse_args()
    torch.set_num_threads(1)
    host = "127.0.0.1" if os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE") else None
    if host:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    n, rank = dist.get_world_size(), dist.get_rank()
    if rank == 0:
        print(f"# c10d ProcessGroupGloo (torch {torch.__version__}), {n} ranks, fp32")
        print(f"# time: median of {a.trials} trials")
        print(f"{'op':<15} {'size':>8} | {'us':>10} {'algbw':>9} {'busbw':>9}")
    for name in a.op or ["all_gather", "reduce_scatter", "all_reduce"]:
        nbytes = a.min_bytes
        while nbytes <= a.max_bytes:
            op, bus = make_op(name, nbytes, n)
            op()  # warm-up
            secs = statistics.median(time_trial(nbytes, op) for _ in range(a.trials))
            if rank == 0:
                gbs = nbytes / secs / 1e9
                print(f"{name:<15} {human(nbytes):>8} | {secs * 1e6:10.1f} {gbs:9.3f} {gbs * bus:9.3f}",
                      flush=True)
            nbytes *= a.step_factor
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
