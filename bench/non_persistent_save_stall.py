#!/usr/bin/env python3
"""Training stall per checkpoint: persistent (sync, --async-save) vs non-persistent (global, local).

    python3 bench/non_persistent_save_stall.py                   # 2 ranks, 4 x d512, 3 rounds (~3 min)
    python3 bench/non_persistent_save_stall.py --rounds 1 --iters 5 --layers 1 --hidden 128 --ffn 352  # smoke

mfsdp-pretrain (CPU, --nproc ranks of one thread, random tokens, ZeRO-3 =
--data-parallel-sharding-strategy optim_grads_params, fp32 AdamW, 1 micro-batch per rank) runs
--iters iterations with a checkpoint every --interval, under each of these variants, interleaved
round after round (the order rotates each round):
  none    --save-interval 1000000: no checkpoint inside the run (the baseline)
  sync    (a) persistent, synchronous: --save-interval INTERVAL
  async   (b) persistent, --save-interval INTERVAL --async-save
  global  (c) non-persistent global (synchronous, <save>/non_persistent):
          --non-persistent-save-interval INTERVAL --non-persistent-ckpt-type global
  local   (d) non-persistent local: --non-persistent-ckpt-type local into a folder under /dev/shm
          (in-memory staging and a peer exchange in the loop, the file write in the background)
A warm-up run (not counted) comes first. Every variant has --save in a folder on the disk
(default: under /var/tmp), so every run, the baseline included, ends with the same persistent
save of the last iteration; --iters is odd so that no interval save falls on it. The stall of a
save is measured three ways:
  log:  the time the trainer logs for each save inside the run (the last iteration's apart):
        "saved checkpoint at iteration N to ... in X s" (sync, global),
        "checkpoint of iteration N staged in X s" (async: includes waiting for the previous
        save's writers), "local checkpoint of iteration N staged in X s (Y MiB per rank)" (local:
        joining the previous local write and removing the older iteration's files, the copy
        into one buffer, the exchange with the peer rank);
  wall: (wall time of the run - wall time of the same round's baseline) / saves in the run, which
        also counts what the log lines do not (a background writer's CPU on a busy machine, the
        commit of an async save after a later iteration, collectives around the save);
  loop: the same difference of the training loops' times: "productive" in mfsdp-run's goodput
        line (from the loop's start to the last iteration's end, saves inside the run included;
        without the process start-up and the last iteration's save, so less noisy than wall).
MiB per rank: the checkpoint's files of one save divided by the ranks (sync, async, global), the
local checkpoint's own log figure (local: the rank's staged state; each rank also keeps its
peer's replica, as much again in /dev/shm).
"""
import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = ("none", "sync", "async", "global", "local")
LABELS = {
    "none": "no save (baseline)",
    "sync": "(a) persistent sync",
    "async": "(b) persistent --async-save",
    "global": "(c) non-persistent global",
    "local": "(d) non-persistent local",
}
# Each save's log line: iteration and seconds (the local line also its MiB per rank).
SAVED = re.compile(r"saved checkpoint at iteration (\d+) to (\S+) in ([0-9.e+-]+) s")
STAGED = re.compile(r"(?<!local )checkpoint of iteration (\d+) staged in ([0-9.e+-]+) s")
GOODPUT = re.compile(r"mfsdp-run: goodput: wall ([0-9.]+) s,.* productive ([0-9.]+) s ")
LOCAL = re.compile(r"local checkpoint of iteration (\d+) staged in ([0-9.e+-]+) s \(([0-9.]+) MiB per rank\)")


def folder_bytes(path):
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def fs_type(path):
    return subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True).stdout.strip()


def run(args, variant, disk, shm, tag):
    save = os.path.join(disk, tag)
    local_dir = os.path.join(shm, tag)
    interval = str(args.interval)
    cmd = [os.path.join(args.build, "mfsdp-run"), "--nproc-per-node", str(args.nproc),
           os.path.join(args.build, "mfsdp-pretrain"), "--device", "cpu", "--tokenizer-type", "NullTokenizer",
           "--vocab-size", str(args.vocab), "--mock-data", "--seed", "1",
           "--num-layers", str(args.layers), "--hidden-size", str(args.hidden), "--ffn-hidden-size", str(args.ffn),
           "--swiglu", "--num-attention-heads", str(args.heads), "--seq-length", str(args.seq),
           "--micro-batch-size", "1", "--global-batch-size", str(args.global_batch),
           "--data-parallel-sharding-strategy", "optim_grads_params",
           "--train-iters", str(args.iters), "--log-interval", "1", "--eval-interval", "100000", "--eval-iters", "0",
           "--save", save]
    cmd += {
        "none": ["--save-interval", "1000000"],
        "sync": ["--save-interval", interval],
        "async": ["--save-interval", interval, "--async-save"],
        "global": ["--save-interval", "1000000", "--non-persistent-save-interval", interval,
                   "--non-persistent-ckpt-type", "global"],
        "local": ["--save-interval", "1000000", "--non-persistent-save-interval", interval,
                  "--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", local_dir],
    }[variant]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.monotonic()
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=1200)
    wall = time.monotonic() - start
    if out.returncode != 0:
        sys.exit(f"{variant} run failed ({out.returncode}): {' '.join(cmd)}\n{out.stdout[-4000:]}")
    last = args.iters
    stalls, mib = [], None
    if variant in ("sync", "global"):
        for m in SAVED.finditer(out.stdout):  # global: the lines of <save>/non_persistent
            if int(m.group(1)) != last and ("non_persistent" in m.group(2)) == (variant == "global"):
                stalls.append(float(m.group(3)))
    elif variant == "async":
        stalls = [float(m.group(2)) for m in STAGED.finditer(out.stdout) if int(m.group(1)) != last]
    elif variant == "local":
        for m in LOCAL.finditer(out.stdout):
            if int(m.group(1)) != last:
                stalls.append(float(m.group(2)))
                mib = float(m.group(3))
    saves = 0 if variant == "none" else len(range(args.interval, last, args.interval))
    if len(stalls) != saves:
        sys.exit(f"{variant}: {len(stalls)} save lines, expected {saves}:\n{out.stdout[-4000:]}")
    one = {"sync": save, "async": save, "global": os.path.join(save, "non_persistent")}.get(variant)
    if one is not None:  # one interval save's files: the newest below the last iteration
        newest = os.path.join(one, "iter_%07d" % ((last - 1) // args.interval * args.interval))
        mib = folder_bytes(newest) / args.nproc / 2**20
    goodput = GOODPUT.search(out.stdout)
    if not goodput:
        sys.exit(f"{variant}: no goodput line from mfsdp-run:\n{out.stdout[-4000:]}")
    shutil.rmtree(save, ignore_errors=True)
    shutil.rmtree(local_dir, ignore_errors=True)
    return {"wall": wall, "loop": float(goodput.group(2)), "stalls": stalls, "saves": saves, "mib": mib}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", default="build")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=1536)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=2, help="1 micro-batch per rank: short steps, so the saves are a larger share of the run")
    p.add_argument("--iters", type=int, default=21, help="odd, so no interval save is the last iteration's")
    p.add_argument("--interval", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--disk-dir", default="/var/tmp", help="where persistent checkpoints go (not tmpfs)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    args = p.parse_args()
    variants = args.variants.split(",")
    if "none" not in variants or "sync" not in variants:
        sys.exit("--variants needs none (the wall-time baseline) and sync (the ratios' baseline)")
    if args.iters % args.interval == 0:
        sys.exit("--iters must not be a multiple of --interval (the last iteration's save is every run's)")
    disk = tempfile.mkdtemp(prefix="mfsdp-np-stall-", dir=args.disk_dir)
    shm = tempfile.mkdtemp(prefix="mfsdp-np-stall-", dir="/dev/shm")
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print(f"non_persistent_save_stall: {os.cpu_count()} CPUs ({cpu}); {args.nproc} ranks, {args.layers} layers x "
          f"hidden {args.hidden}, FFN {args.ffn}, vocab {args.vocab}, seq {args.seq}, global batch "
          f"{args.global_batch}; {args.iters} iterations, a save every {args.interval}; persistent in {disk} "
          f"({fs_type(disk)}), local in {shm} ({fs_type(shm)}); {args.rounds} rounds", flush=True)
    results = {v: [] for v in variants}
    try:
        run(args, "none", disk, shm, "warm-up")  # not counted: the first run of a session starts slower (cold caches)
        for r in range(args.rounds):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            walls, loops = {}, {}
            for v in order:
                res = run(args, v, disk, shm, f"{r}-{v}")
                walls[v], loops[v] = res["wall"], res["loop"]
                results[v].append(res)
                log = statistics.mean(res["stalls"]) if res["stalls"] else 0.0
                print(f"round {r + 1} {v:6s}: wall {res['wall']:6.2f} s, loop {res['loop']:6.2f} s, {res['saves']} saves, "
                      f"logged stall per save {log:.3f} s", flush=True)
            for v in variants:
                res = results[v][-1]
                res["wall_stall"] = (walls[v] - walls["none"]) / res["saves"] if res["saves"] else 0.0
                res["loop_stall"] = (loops[v] - loops["none"]) / res["saves"] if res["saves"] else 0.0
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)

    def med(v, key):
        return statistics.median(r[key] for r in results[v])

    rows = {}
    for v in variants:
        log = statistics.median(statistics.mean(r["stalls"]) if r["stalls"] else 0.0 for r in results[v])
        mib = results[v][0]["mib"]
        rows[v] = (log, med(v, "wall_stall"), med(v, "loop_stall"), med(v, "wall"), med(v, "loop"), mib)
    print()
    print(f"{'variant':30s} {'stall/save (s): log':>20s} {'wall':>7s} {'loop':>7s} | {'run wall (s)':>12s} "
          f"{'loop (s)':>9s} {'MiB per rank':>13s} | {'vs (a): log':>11s} {'wall':>7s} {'loop':>7s}")
    base = rows["sync"]
    for v in variants:
        log, wall_stall, loop_stall, wall, loop, mib = rows[v]
        ratio = lambda x, b: f"{x / b:.2f}x" if v != "none" and b > 0 else "-"
        print(f"{LABELS[v]:30s} {log:20.3f} {wall_stall:7.3f} {loop_stall:7.3f} | {wall:12.2f} {loop:9.2f} "
              f"{(f'{mib:.1f}' if mib is not None else '-'):>13s} | {ratio(log, base[0]):>11s} "
              f"{ratio(wall_stall, base[1]):>7s} {ratio(loop_stall, base[2]):>7s}")
    print(f"medians over {args.rounds} rounds; log = mean of the run's logged save times; wall, loop = (the run's - the "
          f"same round's baseline's) / {results['sync'][0]['saves']} saves; loop = mfsdp-run's 'productive'; "
          f"ratios: the variant's stall / (a)'s")


if __name__ == "__main__":
    main()
