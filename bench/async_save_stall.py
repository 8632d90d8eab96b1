#!/usr/bin/env python3
"""Training stall per checkpoint save, synchronous vs --async-save, in mfsdp-pretrain.

    .venv/bin/python bench/async_save_stall.py --build build              # default model (~117M)
    .venv/bin/python bench/async_save_stall.py --layers 1 --hidden 128 --ffn 352 --vocab 1024 --rounds 1  # smoke

The same run (CPU, NPROC ranks, random tokens, ZeRO-3, AdamW) is trained with --save every
--save-interval iterations, once with the synchronous save and once with --async-save, the two
interleaved round after round. The stall of a save is what the training loop waits for, as
mfsdp-pretrain logs it:
  sync:  "saved checkpoint at iteration N ... in X s"     (write + checksum + fsync + commit)
  async: "checkpoint of iteration N staged in X s"         (waiting for the previous save's
         writers if they are still running, its commit, then copying the shards to staging)
Only the saves inside the run count: the save of the last iteration is waited for before the
process exits under both modes (async logs that wait as "waited X s for the writers"), so it is
reported apart. Also reported: the median iteration time (iter_time_s of --metrics-file) of each
mode, since the writer thread shares the CPU with training, the staging buffer per rank (MiB,
logged by mfsdp-pretrain), and the checkpoint's size on disk.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

SYNC = re.compile(r"saved checkpoint at iteration (\d+) to \S+ in ([0-9.e+-]+) s")
ASYNC = re.compile(r"checkpoint of iteration (\d+) staged in ([0-9.e+-]+) s \(([0-9.]+) MiB of staging")
WAITED = re.compile(r"committed checkpoint of iteration (\d+) \(written in the background; waited ([0-9.e+-]+) s")


def folder_bytes(path):
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(root, f))
    return total


def run(args, mode, workdir):
    save = os.path.join(workdir, mode)
    shutil.rmtree(save, ignore_errors=True)
    metrics = os.path.join(workdir, mode + ".jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = [os.path.join(args.build, "mfsdp-run"), "--nproc-per-node", str(args.nproc),
           os.path.join(args.build, "mfsdp-pretrain"), "--device", "cpu", "--mock-data",
           "--vocab-size", str(args.vocab), "--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
           "--ffn-hidden-size", str(args.ffn), "--num-attention-heads", str(args.heads), "--swiglu",
           "--seq-length", str(args.seq), "--micro-batch-size", "1", "--global-batch-size", str(args.nproc),
           "--train-iters", str(args.iters), "--lr", "1e-4", "--log-interval", "1", "--eval-interval", "100000",
           "--eval-iters", "0", "--save", save, "--save-interval", str(args.save_interval),
           "--metrics-file", metrics]
    if mode == "async":
        cmd.append("--async-save")
    start = time.monotonic()
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.monotonic() - start
    if out.returncode != 0:
        sys.exit(f"{mode} run failed ({out.returncode}):\n{out.stdout[-4000:]}")
    stalls, final, staging = [], None, None
    for m in (SYNC if mode == "sync" else ASYNC).finditer(out.stdout):
        it, s = int(m.group(1)), float(m.group(2))
        if mode == "async":
            staging = float(m.group(3))
        if it == args.iters:
            final = s
        else:
            stalls.append(s)
    if mode == "async":
        for m in WAITED.finditer(out.stdout):
            if int(m.group(1)) == args.iters:
                final = (final or 0) + float(m.group(2))
    iters = []
    with open(metrics) as f:
        for line in f:
            j = json.loads(line)
            if "iter_time_s" in j and j["iteration"] > 1:
                iters.append(j["iter_time_s"])
    size = folder_bytes(os.path.join(save, "iter_%07d" % args.iters))
    shutil.rmtree(save, ignore_errors=True)
    return {"stalls": stalls, "final": final, "staging": staging, "iter": iters, "wall": wall, "size": size}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", default="build")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--iters", type=int, default=9)
    p.add_argument("--save-interval", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workdir", default=None, help="where checkpoints go (default: a temporary folder)")
    args = p.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="mfsdp-async-bench-")
    results = {"sync": [], "async": []}
    for r in range(args.rounds):
        for mode in ("sync", "async") if r % 2 == 0 else ("async", "sync"):
            res = run(args, mode, workdir)
            results[mode].append(res)
            print(f"round {r + 1} {mode:5s}: stalls {['%.3f' % s for s in res['stalls']]} s, last save "
                  f"{res['final']:.3f} s, median iteration {statistics.median(res['iter']):.3f} s, "
                  f"wall {res['wall']:.1f} s", flush=True)
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)

    def pooled(mode, key):
        out = []
        for res in results[mode]:
            out += res[key] if isinstance(res[key], list) else [res[key]]
        return out

    size = results["sync"][0]["size"]
    print()
    print(f"# {args.nproc} ranks, {args.layers} layers x hidden {args.hidden}, ffn {args.ffn}, vocab {args.vocab}; "
          f"checkpoint {size / 2**20:.0f} MiB on disk ({size / args.nproc / 2**20:.0f} MiB per rank); "
          f"saves every {args.save_interval} of {args.iters} iterations; {args.rounds} rounds, interleaved")
    print(f"# medians over every save inside the runs (the last iteration's save apart)")
    print(f"{'mode':6s} | {'stall per save s':>16s} | {'last save s':>11s} | {'iteration s':>11s} | "
          f"{'wall s':>7s} | {'staging MiB/rank':>16s}")
    med = {}
    for mode in ("sync", "async"):
        med[mode] = statistics.median(pooled(mode, "stalls"))
        staging = results[mode][0]["staging"]
        print(f"{mode:6s} | {med[mode]:16.3f} | {statistics.median(pooled(mode, 'final')):11.3f} | "
              f"{statistics.median(pooled(mode, 'iter')):11.3f} | {statistics.median(pooled(mode, 'wall')):7.1f} | "
              f"{('%.0f' % staging) if staging is not None else '-':>16s}")
    print(f"stall ratio sync / async: {med['sync'] / med['async']:.1f}x")


if __name__ == "__main__":
    main()
