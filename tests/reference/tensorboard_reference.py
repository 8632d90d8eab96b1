"""mfsdp-pretrain --tensorboard-dir, read back by the tensorboard package from PyPI.

Runs a 2-rank job through mfsdp-run with --metrics-file and --tensorboard-dir, loads the event
file with tensorboard.backend.event_processing.event_accumulator (which checks every record's
masked CRC-32C), and compares each scalar with the metrics file's record of the same iteration.
Exits non-zero with the reason on any difference.

    tensorboard_reference.py MFSDP_RUN MFSDP_PRETRAIN WORK_DIR
"""
import glob
import json
import math
import os
import shutil
import subprocess
import sys

from tensorboard.backend.event_processing import event_accumulator


def main():
    run, pretrain, work = sys.argv[1:4]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    tb_dir, metrics = os.path.join(work, "tb"), os.path.join(work, "metrics.jsonl")
    cmd = [run, "--nproc-per-node", "2", pretrain, "--device", "cpu", "--mock-data", "--vocab-size", "64",
           "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "48",
           "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "6",
           "--lr", "3e-3", "--log-interval", "1", "--eval-interval", "3", "--eval-iters", "1",
           "--log-params-norm", "--metrics-file", metrics, "--tensorboard-dir", tb_dir]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"mfsdp-pretrain failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    files = glob.glob(os.path.join(tb_dir, "events.out.tfevents.*"))
    if len(files) != 1:
        sys.exit(f"expected one event file in {tb_dir} (rank 0 writes), found {files}")
    acc = event_accumulator.EventAccumulator(files[0], size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    records = [json.loads(line) for line in open(metrics)]
    train = [r for r in records if not r.get("eval")]
    evals = [r for r in records if r.get("eval")]
    expected = {"lm loss": "lm_loss", "learning-rate": "lr", "grad-norm": "grad_norm",
                "iteration-time": "iter_time_s", "tokens-per-sec": "tokens_per_sec",
                "throughput": "tflops_per_rank", "mem-bytes": "mem_bytes", "params-norm": "params_norm"}
    missing = set(expected) - tags
    if missing or "lm loss validation" not in tags:
        sys.exit(f"scalars missing from the event file: {sorted(missing)}; found {sorted(tags)}")
    for tag, key in expected.items():
        events = acc.Scalars(tag)
        if [e.step for e in events] != [r["iteration"] for r in train]:
            sys.exit(f"{tag}: steps {[e.step for e in events]} != iterations {[r['iteration'] for r in train]}")
        for e, r in zip(events, train):
            if not math.isclose(e.value, r[key], rel_tol=1e-6, abs_tol=1e-30) and not (
                    abs(e.value - r[key]) <= 1e-7 * max(1.0, abs(r[key]))):
                sys.exit(f"{tag} at step {e.step}: event file {e.value!r}, metrics file {r[key]!r}")
    val = acc.Scalars("lm loss validation")
    # The event file holds float32, the metrics file a double: compare at rel 1e-6 (float32 is
    # good to ~6e-8), not by rounding, which splits values either side of a rounding boundary.
    if [e.step for e in val] != [r["iteration"] for r in evals] or not all(
            math.isclose(e.value, r["lm_loss"], rel_tol=1e-6) for e, r in zip(val, evals)):
        sys.exit(f"lm loss validation: {[(e.step, e.value) for e in val]} vs {evals}")
    print(f"ok: {len(tags)} scalar tags, {len(train)} training steps, {len(val)} validation points")


if __name__ == "__main__":
    main()
