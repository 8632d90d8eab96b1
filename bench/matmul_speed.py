#!/usr/bin/env python3
"""fp32 and bf16 matmul speed of the LibTorch mfsdp links (the pinned torch wheel: MKL for fp32,
oneDNN for bf16), against numpy's bundled OpenBLAS in the same script: the question is whether
the OpenBLAS switch Debian's LibTorch 1.13 needed still buys anything.

    .venv/bin/python bench/matmul_speed.py [--sizes 256 1024 2048] [--threads 1]
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


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 2048])
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
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
