#!/usr/bin/env python3
"""fp32 and bf16 matmul speed of the LibTorch mfsdp links (the pinned torch wheel: MKL for fp32,
oneDNN for bf16), against numpy's bundled OpenBLAS in the same script: the question is whether
the OpenBLAS switch Debian's LibTorch 1.13 needed still buys anything.

    .venv/bin/python bench/matmul_speed.py [--sizes 256 1024 2048] [--threads 1]

--peak --nproc N: this machine's matmul peak per rank for MFU (bench/cpu_step_time.sh): N
processes at once, each with --threads threads (as N ranks would run), each timing torch.matmul
of the largest --sizes square in fp32 and in bf16 (best of 3 trials). Prints one JSON line:
{"fp32_gflops": <mean over ranks>, "bf16_gflops": ..., "per_rank": {...}, "nproc", "threads", "n"}.
"""
import argparse
import os
import sys
import time

# OpenBLAS reads its thread count once, when numpy loads it.
_threads = sys.argv[sys.argv.index("--threads") + 1] if "--threads" in sys.argv else "1"
os.environ["OPENBLAS_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = _threads
import numpy as np  # noqa: E402
import torch  # noqa: E402


def gflops(fn, n, repeat):
    fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - start) / repeat)
    return 2 * n**3 / best / 1e9


def peak_worker(rank, n, threads, barrier, results):
    torch.set_num_threads(threads)
    x = torch.randn(n, n)
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a, b = x.to(dtype), x.t().contiguous().to(dtype)
        barrier.wait()  # every rank multiplies at the same time, as in training
        out[name] = gflops(lambda: a @ b, n, max(1, int(4e9 / (2 * n**3))))
    results[rank] = out


def peak(a):
    import json
    import multiprocessing as mp
    ctx = mp.get_context("fork")  # torch has run no threads yet; fork keeps start-up short
    barrier, results = ctx.Barrier(a.nproc), ctx.Manager().dict()
    n = max(a.sizes)
    procs = [ctx.Process(target=peak_worker, args=(r, n, a.threads, barrier, results))
             for r in range(a.nproc)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        if p.exitcode != 0:
            sys.exit("matmul_speed.py: a peak process exited with %s" % p.exitcode)
    per_rank = {r: results[r] for r in range(a.nproc)}
    mean = {k: sum(v[k] for v in per_rank.values()) / a.nproc for k in ("fp32", "bf16")}
    print(json.dumps({"fp32_gflops": mean["fp32"], "bf16_gflops": mean["bf16"], "per_rank": per_rank,
                      "nproc": a.nproc, "threads": a.threads, "n": n, "torch": torch.__version__,
                      "cpu_capability": torch.backends.cpu.get_cpu_capability()}))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 2048])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--peak", action="store_true", help="per-rank peak of --nproc concurrent processes, JSON")
    p.add_argument("--nproc", type=int, default=1)
    a = p.parse_args()
    if a.peak:
        return peak(a)
    print(f"# torch {torch.__version__} ({torch.backends.mkl.is_available() and 'MKL' or 'no MKL'}), "
          f"numpy {np.__version__}; GFLOP/s, best of 3; ratio = torch fp32 / numpy fp32")
    print(f"{'n':>6} {'threads':>7} | {'torch fp32':>10} {'torch bf16':>10} {'numpy fp32':>10} | {'ratio':>6}")
    torch.set_num_threads(a.threads)
    for threads in [a.threads]:
        for n in a.sizes:
            repeat = max(1, int(2e9 / (2 * n**3)))
            x, y = torch.randn(n, n), torch.randn(n, n)
            xb, yb = x.bfloat16(), y.bfloat16()
            xn, yn = x.numpy(), y.numpy()
            t32 = gflops(lambda: x @ y, n, repeat)
            t16 = gflops(lambda: xb @ yb, n, repeat)
            npf = gflops(lambda: xn @ yn, n, repeat)
            print(f"{n:>6} {threads:>7} | {t32:10.1f} {t16:10.1f} {npf:10.1f} | {t32 / npf:6.2f}", flush=True)


if __name__ == "__main__":
    main()
