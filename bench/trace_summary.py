#!/usr/bin/env python3
"""Where a profiled step's time goes: a summary of a PyTorch profiler trace (the
<host>_<pid>.<ms>.pt.trace.json of `mfsdp-pretrain --profile --use-pytorch-profiler`, or of
torch.profiler's tensorboard_trace_handler).

    bench/trace_summary.py TRACE.pt.trace.json [--top 25]

Prints, per ProfilerStep#N range: its wall time, the GPU's busy time (the union of kernel,
copy and set intervals inside it) and so the idle share; then over all profiled steps the GPU
time by kind (matmul, attention, NCCL, copies, elementwise and the rest), by the range that
launched it, and the kernels with the most GPU time; the CPU time of mfsdp's own ranges
(mfsdp::all_gather, mfsdp::optimizer_step, ...); and the CPU ops with the most time
(inclusive). A CPU-only trace shows the CPU tables alone. torch.profiler's own key_averages() needs the live profiler object, which a C++ run
does not hand to Python; chrome://tracing and Perfetto show one trace but not these sums.
"""
import argparse
import collections
import json
import re
import sys

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
KINDS = [  # (kind, pattern on the kernel name), first match wins
    ("nccl", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|cudnn.*(sdp|mha)", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|xmma|nvjet|sm\d+_|cublas|matmul", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
    ("reduction", re.compile(r"reduce|norm|softmax|cross_entropy|nll|sum", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|pointwise|copy|fill", re.I)),
]


def kind_of(event):
    if event.get("cat") == "gpu_memcpy":
        return "memcpy"
    if event.get("cat") == "gpu_memset":
        return "memset"
    for kind, pattern in KINDS:
        if pattern.search(event["name"]):
            return kind
    return "other"


def union_length(intervals):
    total, end = 0.0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def launching_range(kernel, launches, ranges, main_tid):
    """The innermost user range (an mfsdp:: one) around the CPU call that launched `kernel`; else
    the thread it was launched from: the step's own (forward, optimizer) or autograd's (backward)."""
    launch = launches.get(kernel.get("args", {}).get("correlation"))
    if launch is None:
        return "(launch not recorded)"
    inner = None
    for r in ranges.get(launch["tid"], ()):
        if r["ts"] > launch["ts"]:
            break
        if launch["ts"] < r["ts"] + r["dur"]:
            inner = r  # a later start that still contains it: nested deeper
    if inner is not None:
        return inner["name"]
    return "(step thread, no range)" if launch["tid"] == main_tid else "(autograd thread, no range)"


def short(name, width=90):
    return name if len(name) <= width else name[: width - 3] + "..."


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=25, help="rows of the kernel and CPU op tables")
    args = ap.parse_args()
    try:
        with open(args.trace) as f:
            events = json.load(f)["traceEvents"]
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"trace_summary.py: {args.trace}: not a PyTorch profiler trace ({e})")
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]
    # The CPU's ranges (a GPU trace repeats them on the GPU's timeline as gpu_user_annotation).
    steps = sorted((e for e in spans if e["name"].startswith("ProfilerStep#") and e.get("cat") == "user_annotation"),
                   key=lambda e: e["ts"])
    if not steps:
        sys.exit(f"trace_summary.py: {args.trace}: no ProfilerStep#N range (was the run profiled?)")
    gpu = [e for e in spans if e.get("cat") in GPU_CATS]
    launches = {e["args"]["correlation"]: e for e in spans
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ranges = collections.defaultdict(list)  # tid -> the mfsdp:: ranges on it, by start
    for e in spans:
        if e.get("cat") == "user_annotation" and not e["name"].startswith("ProfilerStep#"):
            ranges[e["tid"]].append(e)
    for v in ranges.values():
        v.sort(key=lambda e: e["ts"])
    cpu = [e for e in spans if e.get("cat") == "cpu_op"]

    def inside(e, s):
        return s["ts"] <= e["ts"] < s["ts"] + s["dur"]

    # GPU work runs after its launch: a step's GPU work is what starts before the next step does.
    print(f"{'step':<18} {'wall ms':>9} {'GPU busy ms':>12} {'GPU idle':>9}")
    for i, s in enumerate(steps):
        end = steps[i + 1]["ts"] if i + 1 < len(steps) else float("inf")
        mine = [(e["ts"], e["ts"] + e["dur"]) for e in gpu if s["ts"] <= e["ts"] < end]
        busy = union_length(mine) / 1000
        wall = s["dur"] / 1000
        idle = f"{max(0.0, 1 - busy / wall):.1%}" if gpu else "-"
        print(f"{s['name']:<18} {wall:>9.1f} {busy:>12.1f} {idle:>9}")
    n = len(steps)
    if gpu:
        by_kind = collections.Counter()
        by_kernel = collections.Counter()
        calls = collections.Counter()
        for e in gpu:
            by_kind[kind_of(e)] += e["dur"]
            by_kernel[e["name"]] += e["dur"]
            calls[e["name"]] += 1
        total = sum(by_kind.values())
        print(f"\nGPU time by kind, ms per step (of {total / 1000 / n:.1f}; kernels may overlap on streams)")
        for kind, t in by_kind.most_common():
            print(f"  {kind:<12} {t / 1000 / n:>9.2f} {t / total:>7.1%}")
        by_range = collections.Counter()
        for e in gpu:
            by_range[launching_range(e, launches, ranges, steps[0]["tid"])] += e["dur"]
        print("\nGPU time by the range that launched it, ms per step (mfsdp::* ranges; the rest by thread)")
        for name, t in by_range.most_common():
            print(f"  {name:<34} {t / 1000 / n:>9.2f} {t / total:>7.1%}")
        print(f"\nkernels by GPU time (top {args.top}): ms per step, calls per step, share")
        for name, t in by_kernel.most_common(args.top):
            print(f"  {t / 1000 / n:>8.2f} {calls[name] / n:>7.1f} {t / total:>7.1%}  {short(name)}")
    in_range = collections.Counter()
    range_calls = collections.Counter()
    for v in ranges.values():
        for e in v:
            if any(inside(e, s) for s in steps):
                in_range[e["name"]] += e["dur"]
                range_calls[e["name"]] += 1
    if in_range:
        print("\nmfsdp's ranges, CPU ms per step (inclusive), calls per step")
        for name, t in sorted(in_range.items(), key=lambda kv: -kv[1]):
            print(f"  {name:<26} {t / 1000 / n:>9.2f} {range_calls[name] / n:>7.1f}")
    by_op = collections.Counter()
    op_calls = collections.Counter()
    for e in cpu:
        if any(inside(e, s) for s in steps):
            by_op[e["name"]] += e["dur"]
            op_calls[e["name"]] += 1
    print(f"\nCPU ops by time (inclusive, top {args.top}): ms per step, calls per step")
    for name, t in by_op.most_common(args.top):
        print(f"  {t / 1000 / n:>8.2f} {op_calls[name] / n:>7.1f}  {short(name)}")


if __name__ == "__main__":
    main()
