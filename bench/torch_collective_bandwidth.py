#!/usr/bin/env python3
"""The c10d baseline of bench/collective_bandwidth.sh: torch.distributed's ProcessGroupGloo
(--backend gloo, CPU tensors; the default) or ProcessGroupNCCL (--backend nccl, CUDA tensors on
cuda:LOCAL_RANK) of the same torch mfsdp is built against, timed exactly like
bench/collective_bandwidth.cpp times ours, and printed in the same table format.

    mfsdp-run --nproc-per-node 2 .venv/bin/python bench/torch_collective_bandwidth.py \
        [--min-bytes 1K] [--max-bytes 256M] [--step-factor 4] [--trials 9] [--op all_gather] \
        [--backend gloo|nccl]

c10d 2.x's gloo and nccl backends have flat collectives: all_gather_into_tensor,
reduce_scatter_tensor, all_reduce and all_to_all_single (equal splits) on one flat fp32 tensor,
so no workaround is timed. With
nccl a collective returns once queued on the stream, so each trial ends with
torch.cuda.synchronize() (as collective_bandwidth.cpp synchronises the device).
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


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_trial(nbytes, op, device):
    """Seconds per call: mean over a trial, slowest rank (as collective_bandwidth.cpp)."""
    iters = min(max((64 << 20) // nbytes, 3), 50)
    dist.barrier()
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        op()
    sync(device)
    t = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def make_op(name, nbytes, n, device):
    numel = max(nbytes // 4 // n, 1) * n
    full, part = torch.randn(numel, device=device), torch.randn(numel // n, device=device)
    ring = (n - 1) / n
    if name == "all_gather":
        return (lambda: dist.all_gather_into_tensor(full, part)), ring
    if name == "reduce_scatter":
        return (lambda: dist.reduce_scatter_tensor(part, full)), ring
    if name == "all_reduce":
        return (lambda: dist.all_reduce(full)), 2 * ring
    if name == "all_to_all_single":
        out = torch.empty_like(full)
        return (lambda: dist.all_to_all_single(out, full)), ring
    raise SystemExit(f"--op: unknown operation {name!r} "
                     "(all_gather, reduce_scatter, all_reduce, all_to_all_single)")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--min-bytes", type=size, default=1 << 10)
    p.add_argument("--max-bytes", type=size, default=256 << 20)
    p.add_argument("--step-factor", type=int, default=4)
    p.add_argument("--trials", type=int, default=9)
    p.add_argument("--op", action="append")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                   help="gloo: CPU tensors; nccl: CUDA tensors, one GPU per rank (cuda:LOCAL_RANK)")
    a = p.parse_args()
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=300)
    if a.backend == "nccl":
        if not torch.cuda.is_available():
            raise SystemExit("torch_collective_bandwidth.py: --backend nccl needs CUDA; "
                             f"torch {torch.__version__} sees no GPU")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
        what = "ProcessGroupNCCL"
    else:
        device = torch.device("cpu")
        host = "127.0.0.1" if os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE") else None
        if host:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", timeout=timeout)
        what = "ProcessGroupGloo"
    n, rank = dist.get_world_size(), dist.get_rank()
    if rank == 0:
        print(f"# c10d {what} (torch {torch.__version__}), {n} ranks, fp32")
        print(f"# time: median of {a.trials} trials")
        print(f"{'op':<17} {'size':>8} | {'us':>10} {'algbw':>9} {'busbw':>9}")
    for name in a.op or ["all_gather", "reduce_scatter", "all_reduce", "all_to_all_single"]:
        nbytes = a.min_bytes
        while nbytes <= a.max_bytes:
            op, bus = make_op(name, nbytes, n, device)
            op()  # warm-up
            sync(device)
            secs = statistics.median(time_trial(nbytes, op, device) for _ in range(a.trials))
            if rank == 0:
                gbs = nbytes / secs / 1e9
                print(f"{name:<17} {human(nbytes):>8} | {secs * 1e6:10.1f} {gbs:9.3f} {gbs * bus:9.3f}",
                      flush=True)
            nbytes *= a.step_factor
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
