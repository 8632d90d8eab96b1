#!/usr/bin/env python3
"""The tables of bench/cpu_step_time.sh, from the outputs in $OUT (run by that script, which
exports the settings this reads from the environment): per precision, step time, tokens/s,
TFLOP/s per rank, MFU and per-rank peak RSS of each run; the runtimes' own buffer figures; then
the ratios the comparison is about."""
import glob
import json
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_flops import megatron_flops_per_iteration  # noqa: E402

env = os.environ
out, warmup = env["OUT"], int(env["WARMUP"])
n, t = int(env["NPROC"]), int(env["THREADS"])
tokens = int(env["GBS"]) * int(env["SEQ"])
divisible = int(env["VOCAB_DIVISIBLE"])
padded_vocab = -(-int(env["VOCAB"]) // divisible) * divisible
flops = megatron_flops_per_iteration(
    int(env["LAYERS"]), int(env["HIDDEN"]), int(env["FFN"]), int(env["HEADS"]),
    int(env["QUERY_GROUPS"]), int(env["SEQ"]), padded_vocab, int(env["GBS"]))
peak = json.load(open(os.path.join(out, "peak.json")))
runs_wanted = env["RUNS"].split()
precisions = env["PRECISIONS"].split()
cuda = env.get("DEVICE", "cpu") == "cuda"
backend = "nccl" if cuda else "gloo"

WHAT = {
    "a": ("mfsdp 1 rank (%s), scaling baseline" % env["BASELINE_STRATEGY"], 1),
    "b": ("mfsdp ZeRO-3 (optim_grads_params), prefetch on", n),
    "c": ("mfsdp ZeRO-3, --no-fsdp-prefetch --no-fsdp-all-gather-in-start-param-sync", n),
    "d": ("mfsdp no_shard (DDP-like)", n),
    "f": ("mfsdp ZeRO-3, prefetch, --fsdp-trace-pool", n),
    "g": ("mfsdp ZeRO-3, prefetch, --fsdp-double-buffer", n),
    "h": ("mfsdp ZeRO-3, prefetch, MFSDP_SHM=0 (loopback TCP)", n),
    "k": ("mfsdp ZeRO-3, MFSDP_KEEP_FREED_MEMORY=0 (glibc returns freed blocks)", n),
    "x": ("mfsdp ZeRO-3, prefetch, --optimizer-implementation fused", n),
    "e": ("PyTorch DDP, %s" % backend, n),
    "p": ("PyTorch FSDP2 (fully_shard), %s" % backend, n),
    "q": ("PyTorch FSDP2, glibc keeping freed memory (GLIBC_TUNABLES)", n),
    "r": ("Megatron-FSDP (megatron-fsdp package), optim_grads_params", n),
    "A": ("as a, OLD_BUILD %s" % env.get("OLD_BUILD", ""), 1),
    "B": ("as b, OLD_BUILD %s" % env.get("OLD_BUILD", ""), n),
}
MEMORY_RE = re.compile(
    r"memory per rank \(MiB\): model weights ([0-9.e+-]+), main weights ([0-9.e+-]+), main grads "
    r"([0-9.e+-]+), optimizer state ([0-9.e+-]+), transient peak ([0-9.e+-]+)")


def mfsdp_result(label, precision):
    """Pooled timed iterations, round medians, final loss, per-rank peak RSS (max over rounds),
    rank 0's buffer report of the last round."""
    times, rounds, last, rss, memory = [], [], None, {}, None
    for path in sorted(glob.glob(os.path.join(out, "%s.%s.r*.jsonl" % (label, precision)))):
        recs = [json.loads(line) for line in open(path) if line.strip()]
        train = [r for r in recs if not r.get("eval")]
        timed = [r["iter_time_s"] for r in train if r["iteration"] > warmup]
        # mem_bytes is rank 0's peak since the start: growth after the warm-up is memory creeping
        # up from step to step (a leak, or a cache that keeps growing).
        peaks = [r["mem_bytes"] for r in train if r["iteration"] > warmup and "mem_bytes" in r]
        if len(peaks) > 1:
            creep.append((label, precision, os.path.basename(path), (peaks[-1] - peaks[0]) / 2**20, len(peaks)))
        times += timed
        rounds += [statistics.median(timed)] if timed else []
        last = train[-1]["lm_loss"] if train else last
        log = open(path[:-len(".jsonl")] + ".log").read()
        # CPU: every rank's RSS (bench/peak_rss.py); CUDA: rank 0's caching-allocator peak.
        pattern = (r"\[rank(\d+)\]:.* cuda:\d+ peak allocated ([0-9.]+)" if cuda
                   else r"\[rank(\d+)\]:\s*peak_rss_mib ([0-9.]+)")
        for rank, mib in re.findall(pattern, log):
            rss[int(rank)] = max(rss.get(int(rank), 0.0), float(mib))
        m = MEMORY_RE.search(log)
        if m:
            memory = dict(zip(("model weights", "main weights", "main grads", "optimizer state",
                               "transient peak"), map(float, m.groups())))
    return times, rounds, last, [rss[r] for r in sorted(rss)], memory


def torch_result(label, precision):
    times, rounds, last, rss, memory = [], [], None, [], None
    for path in sorted(glob.glob(os.path.join(out, "%s.%s.r*.json" % (label, precision)))):
        res = json.loads([line for line in open(path) if line.startswith("{")][-1])
        times += res["iter_times_s"]
        rounds += [statistics.median(res["iter_times_s"])] if res["iter_times_s"] else []
        last = res["final_loss"]
        peaks = res["peak_gpu_mib"] if cuda else res["peak_rss_mib"]
        rss = [max(a, b) for a, b in zip(rss, peaks)] if rss else list(peaks)
        memory = res.get("memory_mib")
    return times, rounds, last, rss, memory


peers = ("PyTorch DDP, FSDP2 and Megatron-FSDP" if "r" in runs_wanted and not env.get("SKIP_R")
         else "PyTorch FSDP2 and DDP")
print("# %s step time: mfsdp side by side with %s (torch %s)"
      % ("GPU" if cuda else "CPU", peers, env["TORCH_VERSION"]))
print()
print("- machine: %s cores, %s; load average before summary %s"
      % (env["MACHINE_NPROC"], env["CPU_MODEL"], env["LOADAVG"]))
print("- date: %s; mfsdp commit %s; torch %s (its libtorch_cpu.so is mfsdp's LibTorch)"
      % (env["DATE"], env["COMMIT"], env["TORCH_VERSION"]))
print("- model: %s" % env["MODEL_DESC"])
print("- timing: median iter_time over iterations %d..%s of %s round(s), runs interleaved; "
      "tokens/s = %d tokens per global batch / median" % (warmup + 1, env["ITERS"], env["ROUNDS"], tokens))
print("- FLOPs per iteration (Megatron's formula, bench/llama_flops.py): %.4g" % flops)
what = peak.get("what") or ("matmul peak per rank (%d processes x %d thread(s), torch.matmul n=%d, best of 3, %s)"
                             % (peak["nproc"], peak["threads"], peak["n"], peak["cpu_capability"]))
print("- MFU peak: %s: fp32 %.1f GFLOP/s, bf16 %.1f GFLOP/s" % (what, peak["fp32_gflops"], peak["bf16_gflops"]))
memory_what = ("peak GPU memory allocated MiB (mfsdp: rank 0)" if cuda else "peak RSS per rank MiB")
if env.get("SKIP_R") and "r" in runs_wanted:
    print("- run r skipped: %s" % env["SKIP_R"])
    runs_wanted.remove("r")

res = {}  # (label, precision) -> dict
creep = []  # (label, precision, file, MiB, iterations) per mfsdp run
for precision in precisions:
    print()
    print("## %s" % precision)
    print()
    print("| run | what | ranks x threads | median ms | round medians ms | tokens/s | TFLOP/s per rank "
          "| MFU | %s | final loss |" % memory_what)
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for label in runs_wanted:
        what, ranks = WHAT[label]
        get = torch_result if label in "epqr" else mfsdp_result
        times, rounds, last, rss, memory = get(label, precision)
        if not times:
            sys.exit("cpu_step_time.sh: run %s (%s) has no timed iterations in %s" % (label, precision, out))
        med = statistics.median(times)
        tflops = flops / med / ranks / 1e12
        mfu = tflops * 1e3 / peak["%s_gflops" % precision]
        res[label, precision] = {"med": med, "rss": max(rss) if rss else float("nan"), "memory": memory,
                                 "mfu": mfu}
        print("| %s | %s | %d x %d | %.1f | %s | %.0f | %.4f | %.1f%% | %s | %.4f |"
              % (label, what, ranks, t, med * 1e3, " / ".join("%.0f" % (m * 1e3) for m in rounds),
                 tokens / med, tflops, 100 * mfu, " / ".join("%.0f" % v for v in rss), last))

print()
print("Own buffer figures, rank 0, MiB (mfsdp: its end-of-run report; PyTorch: local tensor bytes "
      "after the last step):")
print()
print("| run | precision | figures |")
print("|---|---|---|")
for (label, precision), r in res.items():
    if r["memory"]:
        print("| %s | %s | %s |" % (label, precision,
                                    ", ".join("%s %.1f" % (k, v) for k, v in r["memory"].items())))


print()
print("Peak creep (mfsdp, rank 0's peak since the start, from the first timed iteration to the last; "
      "0 MiB: no creep):")
print()
for label, precision, name, mib, count in creep:
    print("- %s %s %s: %+.1f MiB over %d iterations%s" % (label, precision, name, mib, count,
                                                         "" if abs(mib) < 1 else "  <- CREEPS"))


def ratio(name, num, den, precision, text, kind="speed"):
    a, b = res.get((num, precision)), res.get((den, precision))
    if not a or not b:
        return
    value = b["med"] / a["med"] if kind == "speed" else a["rss"] / b["rss"]
    print("- %s %s: **%.2fx** (%s)" % (precision, name, value, text))


print()
print("Ratios (tokens/s of the first over the second; memory: %s, max over ranks):" % memory_what)
for precision in precisions:
    ratio("ZeRO-3 vs FSDP2 b/p", "b", "p", precision, "target >= 1.3")
    ratio("ZeRO-3 vs FSDP2 with the same malloc setting b/q", "b", "q", precision, "> 1: mfsdp faster")
    ratio("ZeRO-3 peak memory vs FSDP2 b/p", "b", "p", precision, "target <= 1 (issue 49; 0.9 the longer-term aim)", kind="rss")
    ratio("ZeRO-3 vs DDP b/e", "b", "e", precision, "target >= 1.2")
    ratio("ZeRO-3 peak memory vs DDP b/e", "b", "e", precision, "< 1: mfsdp smaller", kind="rss")
    ratio("ZeRO-3 vs Megatron-FSDP b/r", "b", "r", precision, "target >= 1.3 on one H200")
    ratio("ZeRO-3 peak memory vs Megatron-FSDP b/r", "b", "r", precision, "target <= 0.9", kind="rss")
    ratio("no_shard vs DDP d/e", "d", "e", precision, "> 1: mfsdp faster")
    ratio("scaling b/a", "b", "a", precision, "ideal %d" % n)
    ratio("OLD_BUILD's scaling B/A", "B", "A", precision, "ideal %d" % n)
    ratio("this build vs OLD_BUILD, 1 rank a/A", "a", "A", precision, "> 1: this build faster")
    ratio("this build vs OLD_BUILD, ZeRO-3 b/B", "b", "B", precision, "> 1: this build faster")
    ratio("OLD_BUILD's ZeRO-3 vs DDP B/e", "B", "e", precision, "as b/e, for the older build")
    ratio("overlap gain b/c", "b", "c", precision, "> 1: prefetch and early all-gather help")
    ratio("keeping freed memory b/k", "b", "k", precision, "> 1: include/mfsdp/train/cpu_malloc.h helps")
    ratio("shared memory vs TCP b/h", "b", "h", precision, "> 1: the shared-memory path helps")
    ratio("trace pool b/f", "b", "f", precision, "> 1: plain allocation faster")
    ratio("double buffer b/g", "b", "g", precision, "> 1: plain allocation faster")
    ratio("fused AdamW x/b", "x", "b", precision, "> 1: at::_fused_adamw_ faster")
    ratio("ZeRO-3 with fused AdamW vs FSDP2 x/p", "x", "p", precision, "target >= 1.3")
if "fp32" in precisions and "bf16" in precisions:
    for label in runs_wanted:
        a, b = res.get((label, "bf16")), res.get((label, "fp32"))
        if a and b:
            print("- bf16 vs fp32, run %s: **%.2fx** tokens/s (MFU %.1f%% bf16, %.1f%% fp32)"
                  % (label, b["med"] / a["med"], 100 * a["mfu"], 100 * b["mfu"]))
