#!/usr/bin/env bash
# Pipeline parallelism on NPROC CPU ranks (default 2, one thread each): mfsdp-pretrain
# --pipeline-model-parallel-size NPROC (Megatron's non-interleaved 1F1B, point-to-point activations,
# FSDP inside each stage) against mfsdp data parallelism (FSDP ZeRO-3 over the ranks) and tensor
# parallelism (TP NPROC), and beside PyTorch's own pipelining (torch.distributed.pipelining
# PipelineStage + Schedule1F1B, FSDP2 inside each stage, gloo; bench/torch_pipeline.py), on the same
# Llama, global batch and micro-batch size, in interleaved rounds: tokens/s, per-rank peak RSS, and
# the pipeline bubble measured against the ideal 1F1B bubble (P - 1) / (m + P - 1).
#
#   bench/pipeline_step_time.sh                                   # defaults (below), 3 rounds
#   ROUNDS=1 ITERS=4 WARMUP=1 LAYERS=2 HIDDEN=64 FFN=176 HEADS=4 SEQ=32 VOCAB=256 \
#     bench/pipeline_step_time.sh                                 # smoke test (seconds)
#   RUNS="pp torch_pp" bench/pipeline_step_time.sh                # mfsdp PP vs PyTorch PP only
#
# The default shape is compute-bound (the projection and MLP GEMMs are at least 128 x 512 x 512
# per micro-batch; the p2p message, one micro-batch's hidden states, is 256 KiB against about
# 5.6 GFLOP of one stage's forward and backward of that micro-batch): Llama 4 layers x hidden 512,
# FFN 1536 (SwiGLU), 8 heads, sequence 128, vocabulary 1024, untied output layer, fp32; global
# batch 8 sequences of micro-batch 1, so m = 8 micro-batches per step per pipeline (ideal bubble
# 1/9 = 11.1%) and 4 per rank under DP 2; 90 GFLOP per step (Megatron's formula). Estimated, not
# measured here: 0.5-0.9 s per step on 2 ranks at 50-90 GFLOP/s per rank (the 1-rank references
# about twice that), about 5 minutes for the 3 default rounds of the 7 runs.
#
# Runs (RUNS picks them and their order within a round; every run sees the same global batch GBS
# in micro-batches of MBS, the same model and AdamW):
#   one       mfsdp, 1 rank x THREADS: the whole model, all GBS / MBS micro-batches (the bubble's
#             reference: the same work with no pipeline)
#   pp        mfsdp, PP NPROC (DP 1): --pipeline-model-parallel-size NPROC, the even layer split
#   dp        mfsdp, DP NPROC: FSDP STRATEGY over the ranks, GBS / (MBS x NPROC) micro-batches each
#   tp        mfsdp, TP NPROC (DP 1): --tensor-model-parallel-size NPROC TP_EXTRA
#   trace     mfsdp, pp again with PyTorch's profiler on rank 0 (--profile --use-pytorch-profiler
#             --profile-ranks 0, the timed iterations): stage 0's busy time, measured (below)
#   torch_pp  PyTorch, PP NPROC: bench/torch_pipeline.py (Schedule1F1B, fully_shard per decoder
#             layer and stage over the stage's 1-rank data-parallel mesh, reshard_after_forward
#             False as TorchTitan under PP). Its 1F1B warms up with P - s forwards on stage s
#             (mfsdp and Megatron: P - s - 1), the same steady one-forward-one-backward after
#   torch_one PyTorch, 1 rank: bench/torch_llama.py --impl fsdp2 --nproc 1 (torch_pp's reference)
#
# Timing: every run trains ITERS iterations on random tokens (mfsdp --mock-data); the first WARMUP
# are left out; all rounds' timed iterations are pooled and their median reported (mfsdp:
# iter_time_s of --metrics-file with --log-interval 1; PyTorch: the JSON line's iter_times_s);
# tokens/s = GBS x SEQ / median. Peak RSS per rank: mfsdp ranks run under bench/peak_rss.py
# (getrusage of the rank process after it exits, as bench/cpu_step_time.sh); the PyTorch ranks
# report getrusage(RUSAGE_SELF) themselves before exiting; the max over rounds per rank.
# mfsdp's own end-of-run figures (rank 0: its buffers and "process peak RSS") follow the table.
# The two RSS figures differ in when they stop: in the smoke test (2026-12-03) every mfsdp rank's
# peak_rss.py figure was about 110 MiB above rank 0's own "process peak RSS", and polling
# /proc/PID/status VmHWM showed that rise in the rank's last ~10-50 ms, after that report; the
# PyTorch ranks read theirs before they exit (os._exit, no teardown). Compare the mfsdp / PyTorch
# RSS ratio with that in mind.
#
# The bubble (P = NPROC stages, m = GBS / MBS micro-batches per pipeline):
#   ideal        (P - 1) / (m + P - 1): 1F1B with equal stages and free transfers
#   ideal split  the same schedule with this model's stage costs c_s (Megatron's FLOPs of each
#                stage's layers, the output layer and loss on the last; the embedding lookup 0):
#                T = (m - 1) max_s c_s + sum_s c_s, bubble = 1 - m sum_s c_s / (P T); what the
#                uneven split alone costs
#   est          1 - T_one / (P x T_pp), from the median steps of `one` and `pp` (torch: torch_one
#                and torch_pp): the share of the pipelined step that is not the 1-rank step's work
#                divided over P ranks. Equals the ideal when the stages are equal and the pipeline
#                adds nothing else; it also holds the transfers, the stage imbalance, the per-step
#                work the pipeline does not split (logging, the cross-stage gradient norm) and
#                two ranks sharing the memory bandwidth the single rank had alone. It needs no
#                instrumentation, so it is the one estimate measured the same way on both sides.
#   idle         measured per stage as 1 - busy / phase, the median over the timed steps, where
#                phase is the forward/backward part of the step and busy the time the stage
#                computed in it. mfsdp (run trace, stage 0 only): phase = first
#                mfsdp::pipeline_forward start to last mfsdp::pipeline_backward end of each
#                ProfilerStep; busy = the union of the main thread's cpu_op and mfsdp::* ranges
#                (other than the two pipeline ranges, which also hold the blocking receive) inside
#                it; the receive waits are the gaps. The profiler's own overhead is in busy; the
#                trace run's step time is not used for tokens/s. Stage 1 is not measured:
#                mfsdp-pretrain refuses --profile-ranks 1 under PP (it checks profiled ranks
#                against the data-parallel size, 1, not the world size), and the log has no
#                per-stage busy or wait time. PyTorch (torch_pp, every stage):
#                bench/torch_pipeline.py times PipelineStage.forward_one_chunk, backward_one_chunk,
#                perform_reduce_grad and the loss (busy) within schedule.step (phase).
#
# Environment (defaults in brackets): LAYERS [4] HIDDEN [512] FFN [1536] HEADS [8] QUERY_GROUPS
# [HEADS] SEQ [128] MBS [1] GBS [8] VOCAB [1024] VOCAB_DIVISIBLE [128] ITERS [10] WARMUP [3]
# LR [1e-4] NPROC [2] THREADS [1] ROUNDS [3] RUNS [one pp dp tp trace torch_pp torch_one]
# STRATEGY [optim_grads_params] TP_EXTRA [] (more flags for the tp run, e.g. --sequence-parallel)
# MFSDP_EXTRA_ARGS [] (appended to every mfsdp-pretrain command line) BUILD [<repo>/build]
# PYTHON [<repo>/.venv/bin/python] OUT [a new temporary folder; kept].
# The output layer is always untied (--untie-embeddings-and-output-weights; torch_llama --untie)
# in every run: PyTorch's pipelining keeps no tied copy in sync across stages.
# Exit status: 0 when every run succeeded; 1 when one failed (its output is shown); 2 on bad
# settings or missing binaries.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${BUILD:-$ROOT/build}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
LAYERS=${LAYERS:-4}
HIDDEN=${HIDDEN:-512}
FFN=${FFN:-1536}
HEADS=${HEADS:-8}
QUERY_GROUPS=${QUERY_GROUPS:-$HEADS}
SEQ=${SEQ:-128}
MBS=${MBS:-1}
GBS=${GBS:-8}
VOCAB=${VOCAB:-1024}
VOCAB_DIVISIBLE=${VOCAB_DIVISIBLE:-128}
# shellcheck disable=SC2034  # read by check_step_time_settings (bench/step_time_model.sh)
UNTIE=1
ITERS=${ITERS:-10}
WARMUP=${WARMUP:-3}
LR=${LR:-1e-4}
NPROC=${NPROC:-2}
THREADS=${THREADS:-1}
ROUNDS=${ROUNDS:-3}
RUNS=${RUNS:-one pp dp tp trace torch_pp torch_one}
STRATEGY=${STRATEGY:-optim_grads_params}
TP_EXTRA=${TP_EXTRA:-}
MFSDP_EXTRA_ARGS=${MFSDP_EXTRA_ARGS:-}
OUT=${OUT:-}

die() { echo "pipeline_step_time.sh: $*" >&2; exit 2; }
# shellcheck source=bench/step_time_model.sh
source "$ROOT/bench/step_time_model.sh"
check_step_time_settings  # MODEL_ARGS, TORCH_ARGS (untied); GBS a multiple of MBS x NPROC
((NPROC >= 2)) || die "NPROC=$NPROC: pipeline parallelism needs at least 2 ranks"
((LAYERS % NPROC == 0)) || die "LAYERS=$LAYERS must divide by NPROC=$NPROC (the even split over the stages)"
((GBS / MBS >= NPROC)) || die "GBS / MBS = $((GBS / MBS)) micro-batches: 1F1B needs at least NPROC=$NPROC"
for r in $RUNS; do
  [[ $r =~ ^(one|pp|dp|tp|trace|torch_pp|torch_one)$ ]] ||
    die "RUNS: unknown run '$r' (known: one pp dp tp trace torch_pp torch_one)"
done
TORCH_VERSION=$("$PYTHON" -c 'import torch.distributed.pipelining, torch; print(torch.__version__)' 2>/dev/null) ||
  die "$PYTHON cannot import torch.distributed.pipelining; run scripts/setup.sh (it installs the pinned torch into .venv)"
step_time_out_dir pipeline_step_time
MFSDP_ARGS=("${MODEL_ARGS[@]}" --mock-data --eval-iters 0 --eval-interval 1000 --log-interval 1
            --data-parallel-sharding-strategy "$STRATEGY")
# shellcheck disable=SC2206  # word splitting of the extra flags is intended
MFSDP_ARGS+=($MFSDP_EXTRA_ARGS)

fail() {  # label log
  echo "pipeline_step_time.sh: run $1 failed; its output ($2):" >&2
  cat "$2" >&2
  exit 1
}

run_mfsdp() {  # label round nproc [flags...]
  local label=$1 round=$2 n=$3 base="$OUT/$1.r$2"
  shift 3
  echo "  [$label] round $round: mfsdp $n rank(s) x $THREADS thread(s) $*" >&2
  OMP_NUM_THREADS="$THREADS" "$BUILD/mfsdp-run" --nproc-per-node "$n" \
    "$PYTHON" "$ROOT/bench/peak_rss.py" "$BUILD/mfsdp-pretrain" "${MFSDP_ARGS[@]}" "$@" \
    --metrics-file "$base.jsonl" >"$base.log" 2>&1 || fail "$label" "$base.log"
  [[ -s $base.jsonl ]] || fail "$label (no metrics written)" "$base.log"
}

run_torch() {  # label round script [flags...]
  local label=$1 round=$2 script=$3 base="$OUT/$1.r$2"
  shift 3
  echo "  [$label] round $round: PyTorch $script $*" >&2
  OMP_NUM_THREADS="$THREADS" "$PYTHON" "$ROOT/bench/$script" "${TORCH_ARGS[@]}" "$@" >"$base.json" 2>"$base.log" ||
    { cat "$base.json" >>"$base.log"; fail "$label" "$base.log"; }
  grep -q '"iter_times_s"' "$base.json" || fail "$label (no result line)" "$base.json"
}

run() {  # label round
  local label=$1 round=$2
  case $label in
    one) run_mfsdp one "$round" 1 ;;
    pp) run_mfsdp pp "$round" "$NPROC" --pipeline-model-parallel-size "$NPROC" ;;
    dp) run_mfsdp dp "$round" "$NPROC" ;;
    tp)  # TP_EXTRA: flags, split on purpose
      # shellcheck disable=SC2086
      run_mfsdp tp "$round" "$NPROC" --tensor-model-parallel-size "$NPROC" $TP_EXTRA ;;
    trace)
      rm -rf "$OUT/trace.r$round.tb"
      run_mfsdp trace "$round" "$NPROC" --pipeline-model-parallel-size "$NPROC" --profile --use-pytorch-profiler \
        --profile-step-start "$WARMUP" --profile-step-end "$ITERS" --profile-ranks 0 \
        --tensorboard-dir "$OUT/trace.r$round.tb"
      compgen -G "$OUT/trace.r$round.tb/*.pt.trace.json" >/dev/null || fail "trace (no trace written)" "$OUT/trace.r$round.log" ;;
    torch_pp) run_torch torch_pp "$round" torch_pipeline.py --pipeline-model-parallel-size "$NPROC" ;;
    torch_one) run_torch torch_one "$round" torch_llama.py --impl fsdp2 --nproc 1 ;;
  esac
}

echo "pipeline_step_time.sh: outputs in $OUT" >&2
for ((r = 1; r <= ROUNDS; ++r)); do
  for label in $RUNS; do run "$label" "$r"; done
done

cpu_model=$(grep -m1 '^model name' /proc/cpuinfo 2>/dev/null | sed 's/^[^:]*: *//')
commit=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
git -C "$ROOT" diff --quiet HEAD 2>/dev/null || commit="$commit (+ uncommitted changes)"
export OUT WARMUP ITERS GBS MBS SEQ NPROC THREADS ROUNDS RUNS STRATEGY TP_EXTRA
export LAYERS HIDDEN FFN HEADS QUERY_GROUPS VOCAB VOCAB_DIVISIBLE TORCH_VERSION
MACHINE_NPROC=$(nproc)
DATE=$(date -u '+%Y-%m-%d %H:%M UTC')
LOADAVG=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)
export MACHINE_NPROC CPU_MODEL=${cpu_model:-unknown} COMMIT=$commit DATE LOADAVG
export MODEL_DESC="${MODEL_ARGS[*]}"
"$PYTHON" - <<'EOF' || exit 1
import glob, json, os, re, statistics, sys

env = os.environ
out, warmup, iters = env["OUT"], int(env["WARMUP"]), int(env["ITERS"])
p, gbs, mbs, seq = int(env["NPROC"]), int(env["GBS"]), int(env["MBS"]), int(env["SEQ"])
layers, hidden, ffn = int(env["LAYERS"]), int(env["HIDDEN"]), int(env["FFN"])
heads, groups = int(env["HEADS"]), int(env["QUERY_GROUPS"])
div = int(env["VOCAB_DIVISIBLE"])
vocab = -(-int(env["VOCAB"]) // div) * div
runs = env["RUNS"].split()
tokens = gbs * seq
m = gbs // mbs  # micro-batches per pipeline (PP and TP: DP 1)

WHAT = {
    "one": ("mfsdp, 1 rank, %d micro-batches (the bubble's reference)" % m, 1),
    "pp": ("mfsdp PP %d (1F1B), DP 1, %d micro-batches" % (p, m), p),
    "dp": ("mfsdp DP %d, FSDP %s, %d micro-batches per rank" % (p, env["STRATEGY"], m // p), p),
    "tp": ("mfsdp TP %d%s, DP 1, %d micro-batches" % (p, (" " + env["TP_EXTRA"]).rstrip(), m), p),
    "trace": ("mfsdp PP %d under the profiler (rank 0): bubble only, not timed" % p, p),
    "torch_pp": ("PyTorch PP %d, Schedule1F1B + FSDP2 per stage, gloo, %d micro-batches" % (p, m), p),
    "torch_one": ("PyTorch FSDP2, 1 rank, %d micro-batches (torch_pp's reference)" % m, 1),
}
MEMORY_RE = re.compile(r"memory per rank \(MiB\): model weights ([0-9.e+-]+), main weights [0-9.e+-]+, main grads "
                       r"([0-9.e+-]+), optimizer state ([0-9.e+-]+).*process peak RSS ([0-9.e+-]+)")


def mfsdp_result(label):
    times, rounds, rss, own, last = [], [], {}, None, None
    for path in sorted(glob.glob(os.path.join(out, "%s.r*.jsonl" % label))):
        recs = [json.loads(l) for l in open(path) if l.strip() and '"eval":true' not in l]
        timed = [r["iter_time_s"] for r in recs if r["iteration"] > warmup]
        times += timed
        rounds += [statistics.median(timed)] if timed else []
        last = recs[-1]["lm_loss"] if recs else last
        log = open(path[:-len(".jsonl")] + ".log").read()
        for rank, mib in re.findall(r"\[rank(\d+)\]:\s*peak_rss_mib ([0-9.]+)", log):
            rss[int(rank)] = max(rss.get(int(rank), 0.0), float(mib))
        mm = MEMORY_RE.search(log)
        if mm:
            own = "rank 0: weights %.2f, main grads %.2f, optimizer %.2f MiB; its own process peak RSS %.1f MiB" % tuple(
                float(x) for x in mm.groups())
    return times, rounds, [rss[r] for r in sorted(rss)], own, last


def torch_result(label):
    times, rounds, rss, own, last, pipe = [], [], [], None, None, []
    for path in sorted(glob.glob(os.path.join(out, "%s.r*.json" % label))):
        res = json.loads([l for l in open(path) if l.startswith("{")][-1])
        times += res["iter_times_s"]
        rounds += [statistics.median(res["iter_times_s"])]
        rss = [max(x, y) for x, y in zip(rss, res["peak_rss_mib"])] if rss else list(res["peak_rss_mib"])
        mem = res["memory_mib"]
        own = "rank 0: params %.2f, grads %.2f, optimizer %.2f MiB (local tensors after the last step)" % (
            mem["params"], mem["grads"], mem["optimizer"])
        last = res["final_loss"]
        if "pipeline" in res:
            pipe.append(res["pipeline"])
    return times, rounds, rss, own, last, pipe


def union(intervals):
    total, cur = 0.0, None
    for a, b in sorted(intervals):
        if cur is None or a > cur[1]:
            if cur:
                total += cur[1] - cur[0]
            cur = [a, b]
        else:
            cur[1] = max(cur[1], b)
    return total + (cur[1] - cur[0] if cur else 0.0)


def trace_idle(path):
    """Per ProfilerStep of rank 0's trace: (phase us, busy us) as the header describes."""
    events = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X"]
    pipeline = ("mfsdp::pipeline_forward", "mfsdp::pipeline_backward")
    steps = []
    for s in (e for e in events if e["name"].startswith("ProfilerStep#")):
        lo, hi, tid = s["ts"], s["ts"] + s["dur"], s["tid"]
        inside = [e for e in events if e["tid"] == tid and lo <= e["ts"] < hi]
        ranges = [e for e in inside if e["name"] in pipeline]
        if not ranges:
            continue
        a, b = min(e["ts"] for e in ranges), max(e["ts"] + e["dur"] for e in ranges)
        work = [(max(e["ts"], a), min(e["ts"] + e["dur"], b)) for e in inside
                if (e.get("cat") == "cpu_op" or (e.get("cat") == "user_annotation" and e["name"].startswith("mfsdp::")
                                                 and e["name"] not in pipeline))
                and e["ts"] < b and e["ts"] + e["dur"] > a]
        steps.append((b - a, union(work)))
    return steps


print("# Pipeline parallelism on CPU: mfsdp PP %d vs DP %d vs TP %d, beside PyTorch's pipelining (torch %s)"
      % (p, p, p, env["TORCH_VERSION"]))
print()
print("- machine: %s cores, %s; load average before summary %s" % (env["MACHINE_NPROC"], env["CPU_MODEL"], env["LOADAVG"]))
print("- date: %s; mfsdp commit %s" % (env["DATE"], env["COMMIT"]))
print("- model: %s" % env["MODEL_DESC"])
print("- %d ranks x %s thread(s) (1-rank references: 1 x %s); global batch %d = %d micro-batches of %d; "
      "%d tokens per step" % (p, env["THREADS"], env["THREADS"], gbs, m, mbs, tokens))
print("- timing: median iter time over iterations %d..%d of %s round(s), runs interleaved in the order %s"
      % (warmup + 1, iters, env["ROUNDS"], " ".join(runs)))
print()
print("| run | what | ranks | median ms | round medians ms | tokens/s | peak RSS per rank MiB | final loss |")
print("|---|---|---:|---:|---:|---:|---:|---:|")
res, notes = {}, []
for label in runs:
    if label == "trace":
        continue
    what, ranks = WHAT[label]
    if label.startswith("torch"):
        times, rounds, rss, own, last, pipe = torch_result(label)
    else:
        (times, rounds, rss, own, last), pipe = mfsdp_result(label), []
    if not times:
        sys.exit("pipeline_step_time.sh: run %s has no timed iterations in %s" % (label, out))
    med = statistics.median(times)
    res[label] = {"med": med, "rss": rss, "pipe": pipe}
    if own:
        notes.append("%s: %s" % (label, own))
    print("| %s | %s | %d | %.1f | %s | %.0f | %s | %.4f |"
          % (label, what, ranks, med * 1e3, " / ".join("%.0f" % (x * 1e3) for x in rounds), tokens / med,
             " / ".join("%.0f" % x for x in rss), last))
print()
print("Own buffer figures (mfsdp: its end-of-run report; PyTorch: local tensors):")
for n in notes:
    print("- " + n)

# The bubble.
print()
print("## Pipeline bubble (P = %d stages, m = %d micro-batches per step)" % (p, m))
print()
ideal = (p - 1) / (m + p - 1)
per_layer = 12.0 * gbs * seq * hidden * hidden * (1.0 + groups / heads + seq / hidden + ffn / hidden * 1.5)
logits = 6.0 * gbs * seq * hidden * vocab
cost = [per_layer * layers / p + (logits if s == p - 1 else 0.0) for s in range(p)]
t_split = (m - 1) * max(cost) + sum(cost)
ideal_split = 1.0 - m * sum(cost) / (p * t_split)
print("- ideal 1F1B, (P - 1) / (m + P - 1): **%.1f%%**" % (100 * ideal))
print("- ideal for this split (stage FLOPs %s GFLOP per step): %.1f%%"
      % (" / ".join("%.1f" % (c / 1e9) for c in cost), 100 * ideal_split))


def est(one, pp, name):
    if one in res and pp in res:
        t1, tp_ = res[one]["med"], res[pp]["med"]
        print("- %s, est = 1 - T_%s / (P x T_%s) = 1 - %.1f / (%d x %.1f) ms: **%.1f%%**"
              % (name, one, pp, t1 * 1e3, p, tp_ * 1e3, 100 * (1 - t1 / (p * tp_))))
    else:
        print("- %s, est: needs runs %s and %s" % (name, one, pp))


est("one", "pp", "mfsdp")
est("torch_one", "torch_pp", "PyTorch")
if "trace" in runs:
    steps = []
    for path in sorted(glob.glob(os.path.join(out, "trace.r*.tb", "*.pt.trace.json"))):
        steps += trace_idle(path)
    if steps:
        idle = statistics.median(1 - b / a for a, b in steps if a > 0)
        print("- mfsdp, idle measured on stage 0 (profiler, %d steps; median phase %.1f ms, busy %.1f ms): **%.1f%%**; "
              "stage 1: not measurable (--profile-ranks refuses rank 1 under PP)"
              % (len(steps), statistics.median(a for a, _ in steps) / 1e3,
                 statistics.median(b for _, b in steps) / 1e3, 100 * idle))
    else:
        print("- mfsdp, idle measured on stage 0: no ProfilerStep with pipeline ranges in the traces")
if res.get("torch_pp", {}).get("pipe"):
    pipes = res["torch_pp"]["pipe"]
    stages = pipes[0]["stage_of_rank"]
    idle = [statistics.median(pp_["idle_fraction"][r] for pp_ in pipes) for r in range(len(stages))]
    busy = [statistics.median(pp_["busy_s"][r] for pp_ in pipes) for r in range(len(stages))]
    phase = [statistics.median(pp_["phase_s"][r] for pp_ in pipes) for r in range(len(stages))]
    print("- PyTorch, idle measured per stage (instrumented, median of the round medians): %s"
          % "; ".join("stage %d **%.1f%%** (busy %.1f of %.1f ms)" % (stages[r], 100 * idle[r], busy[r] * 1e3,
                                                                      phase[r] * 1e3) for r in range(len(stages))))

# Ratios.
print()
print("## Ratios (tokens/s of the first over the second: > 1 the first is faster; peak RSS: max over ranks, "
      "< 1 the first is leaner)")
print()


def ratio(a, b, text):
    if a in res and b in res:
        speed = res[b]["med"] / res[a]["med"]
        mem = max(res[a]["rss"]) / max(res[b]["rss"]) if res[a]["rss"] and res[b]["rss"] else float("nan")
        print("- %s / %s: tokens/s **%.2fx**, peak RSS %.2fx (%s)" % (a, b, speed, mem, text))


ratio("pp", "torch_pp", "mfsdp PP vs PyTorch PP: the comparison this script is for")
ratio("pp", "dp", "pipeline vs data parallelism on the same ranks")
ratio("pp", "tp", "pipeline vs tensor parallelism on the same ranks")
ratio("dp", "tp", "data vs tensor parallelism")
ratio("pp", "one", "pipeline scaling, ideal %d x (1 - ideal bubble) = %.2f" % (p, p * (1 - ideal)))
ratio("torch_pp", "torch_one", "PyTorch's pipeline scaling")
ratio("one", "torch_one", "1 rank, mfsdp vs PyTorch FSDP2")
EOF
