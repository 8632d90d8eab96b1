#!/usr/bin/env bash
# MoE step time of mfsdp-pretrain on 2 ranks: the experts on every rank (EP 1) against the
# experts split over the ranks (EP 2, all-to-all dispatch), EP 2 with --moe-grouped-gemm, and a
# dense model of the same active parameters per token (MLP width = top-k x expert width), in
# interleaved rounds; tokens/s from the median of the pooled timed iterations (iter_time_s of
# --metrics-file, --log-interval 1), rank 0's peak RSS, and its FSDP buffers (model weights,
# main grads, optimizer state) next to the formula dense / DP + experts / (EDP x EP).
# Beside them, in the same rounds, the PyTorch peer (bench/torch_llama.py --impl fsdp2 with the
# same --num-experts/--moe-* flags): FSDP2 with TorchTitan-style expert parallelism (experts
# stacked, torch._grouped_mm, all_to_all_single dispatch over gloo, experts sharded over the
# expert-data-parallel mesh), the same shape, global batch, AdamW, clipping and aux-loss weight,
# on uniform random tokens (mfsdp: --mock-data). fsdp2: EP 2 (EP 1 when NPROC is 1), the peer of
# ep2 / grouped; fsdp2_ep1: EP 1, the peer of ep1. Its iteration times and rank 0's peak RSS
# (getrusage in the rank, as mfsdp's mem_bytes) are its own JSON line's, its buffers rank 0's
# local shards; then the ratios mfsdp / PyTorch.
#
#   bench/moe_step_time.sh                        # defaults below
#   ROUNDS=1 ITERS=6 WARMUP=2 bench/moe_step_time.sh   # smoke test
#   DEVICE=cuda NPROC=1 RUNS="ep1 grouped dense" EXTRA=--bf16 bench/moe_step_time.sh   # one GPU
#   NPROC=4 RUNS="ep4 cp2ep2 hsdp2ep2 tp2ep2 tp2ep2etp2" bench/moe_step_time.sh   # 4 ranks, vs ep4
#   MODEL=deepseek bench/moe_step_time.sh         # a DeepSeek-V3-style model, both sides
#
# MODEL=llama (the default): Llama attention, every layer an MoE layer with softmax top-k routing.
# MODEL=deepseek: a DeepSeek-V3-style model of the same size, by the same Megatron flags to
# mfsdp-pretrain and to bench/torch_llama.py: multi-head latent attention in every layer
# (--multi-latent-attention --q-lora-rank Q_LORA_RANK --kv-lora-rank KV_LORA_RANK --qk-head-dim
# QK_HEAD_DIM --qk-pos-emb-head-dim QK_POS_EMB_HEAD_DIM --v-head-dim V_HEAD_DIM, plain RoPE), the
# first DENSE_LAYERS layers dense (--moe-layer-freq "([0]*DENSE_LAYERS+[1]*(LAYERS-DENSE_LAYERS))",
# their MLP --ffn-hidden-size MOE_FFN, as the MoE runs' --ffn-hidden-size), and in the MoE layers
# DeepSeek-V3's routing: sigmoid scores with the aux-loss-free expert bias
# (--moe-router-score-function sigmoid --moe-router-enable-expert-bias), group-limited top-k
# (--moe-router-num-groups ROUTER_GROUPS --moe-router-group-topk GROUP_TOPK), the top-k weights
# times TOPK_SCALING (--moe-router-topk-scaling-factor), and an ungated shared expert SHARED_FFN
# wide (--moe-shared-expert-intermediate-size); --moe-aux-loss-coeff 1e-2 as for llama. The dense
# run is the same model with every MLP (TOPK + 1) x MOE_FFN wide: the MoE layers' active width
# with the shared expert (the DENSE_LAYERS dense layers' MOE_FFN is then widened too).
#
# Environment (defaults in brackets): LAYERS [4] HIDDEN [256] HEADS [8] EXPERTS [8] TOPK [2]
# MOE_FFN [256] SEQ [128] MBS [4] GBS [16] VOCAB [1024] ITERS [12] WARMUP [3] ROUNDS [3]
# RUNS [ep1 ep2 grouped dense fsdp2 fsdp2_ep1; also ep4 cp2ep2 hsdp2ep2 tp2ep2 tp2ep2etp2 with NPROC 4] STRATEGY [optim_grads_params] DEVICE [cpu]
# NPROC [2] (ep2 needs 2) EXTRA [] (more mfsdp-pretrain flags) TORCH_EXTRA [--bf16 when EXTRA
# has --bf16, else nothing] (more bench/torch_llama.py flags, e.g. --moe-expert-impl loop)
# BUILD [<repo>/build] PYTHON [<repo>/.venv/bin/python] OUT [a new temporary folder; kept]
# MODEL [llama; or deepseek] and with MODEL=deepseek: Q_LORA_RANK [HIDDEN/2] KV_LORA_RANK
# [HIDDEN/4] QK_HEAD_DIM [32] QK_POS_EMB_HEAD_DIM [16] V_HEAD_DIM [32] SHARED_FFN [MOE_FFN]
# ROUTER_GROUPS [2] GROUP_TOPK [1] TOPK_SCALING [2.5] DENSE_LAYERS [1] (LAYERS must exceed it)
# Exit status 0 when every run succeeded, 1 when one failed (its output is shown), 2 for bad
# settings or a missing tool.
set -uo pipefail
# The mfsdp flags travel as words (flags_of, $EXTRA), one of them with MODEL=deepseek a Python
# list such as ([0]*1+[1]*3): no pathname expansion of them.
set -f

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${BUILD:-$ROOT/build}
LAYERS=${LAYERS:-4} HIDDEN=${HIDDEN:-256} HEADS=${HEADS:-8} EXPERTS=${EXPERTS:-8} TOPK=${TOPK:-2}
MOE_FFN=${MOE_FFN:-256} SEQ=${SEQ:-128} MBS=${MBS:-4} GBS=${GBS:-16} VOCAB=${VOCAB:-1024}
ITERS=${ITERS:-12} WARMUP=${WARMUP:-3} ROUNDS=${ROUNDS:-3} RUNS=${RUNS:-"ep1 ep2 grouped dense fsdp2 fsdp2_ep1"}
STRATEGY=${STRATEGY:-optim_grads_params} DEVICE=${DEVICE:-cpu} NPROC=${NPROC:-2} EXTRA=${EXTRA:-}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
if [[ -z ${TORCH_EXTRA+x} ]]; then
  TORCH_EXTRA=""
  [[ " $EXTRA " == *" --bf16 "* ]] && TORCH_EXTRA=--bf16
fi
MODEL=${MODEL:-llama}
case $MODEL in
  llama)
    model=() moe_model=() dense_ffn=$((TOPK * MOE_FFN)) moe_layers=$LAYERS ;;
  deepseek)
    Q_LORA_RANK=${Q_LORA_RANK:-$((HIDDEN / 2))} KV_LORA_RANK=${KV_LORA_RANK:-$((HIDDEN / 4))}
    QK_HEAD_DIM=${QK_HEAD_DIM:-32} QK_POS_EMB_HEAD_DIM=${QK_POS_EMB_HEAD_DIM:-16} V_HEAD_DIM=${V_HEAD_DIM:-32}
    SHARED_FFN=${SHARED_FFN:-$MOE_FFN} ROUTER_GROUPS=${ROUTER_GROUPS:-2} GROUP_TOPK=${GROUP_TOPK:-1}
    TOPK_SCALING=${TOPK_SCALING:-2.5} DENSE_LAYERS=${DENSE_LAYERS:-1}
    if ((DENSE_LAYERS < 0 || DENSE_LAYERS >= LAYERS)); then
      echo "moe_step_time: MODEL=deepseek needs 0 <= DENSE_LAYERS ($DENSE_LAYERS) < LAYERS ($LAYERS)" >&2; exit 2
    fi
    if ((ROUTER_GROUPS < 1 || EXPERTS % ROUTER_GROUPS != 0 || GROUP_TOPK < 1 || GROUP_TOPK > ROUTER_GROUPS ||
         TOPK > GROUP_TOPK * (EXPERTS / ROUTER_GROUPS))); then
      echo "moe_step_time: MODEL=deepseek: ROUTER_GROUPS ($ROUTER_GROUPS) must divide EXPERTS ($EXPERTS)," \
           "GROUP_TOPK ($GROUP_TOPK) be 1 .. ROUTER_GROUPS and TOPK ($TOPK) at most GROUP_TOPK x EXPERTS /" \
           "ROUTER_GROUPS" >&2; exit 2
    fi
    model=(--multi-latent-attention --q-lora-rank "$Q_LORA_RANK" --kv-lora-rank "$KV_LORA_RANK"
           --qk-head-dim "$QK_HEAD_DIM" --qk-pos-emb-head-dim "$QK_POS_EMB_HEAD_DIM" --v-head-dim "$V_HEAD_DIM")
    moe_model=(--moe-shared-expert-intermediate-size "$SHARED_FFN" --moe-router-score-function sigmoid
               --moe-router-enable-expert-bias --moe-router-num-groups "$ROUTER_GROUPS"
               --moe-router-group-topk "$GROUP_TOPK" --moe-router-topk-scaling-factor "$TOPK_SCALING"
               --moe-layer-freq "([0]*$DENSE_LAYERS+[1]*$((LAYERS - DENSE_LAYERS)))")
    dense_ffn=$(((TOPK + 1) * MOE_FFN)) moe_layers=$((LAYERS - DENSE_LAYERS)) ;;
  *) echo "moe_step_time: unknown MODEL '$MODEL' (llama or deepseek)" >&2; exit 2 ;;
esac
OUT=${OUT:-$(mktemp -d /tmp/moe_step_time.XXXX)}
mkdir -p "$OUT"
for tool in mfsdp-run mfsdp-pretrain; do
  [[ -x $BUILD/$tool ]] || { echo "moe_step_time: $BUILD/$tool is missing (scripts/build.sh)" >&2; exit 2; }
done

common=(--device "$DEVICE" --mock-data --vocab-size "$VOCAB" --num-layers "$LAYERS" --hidden-size "$HIDDEN"
        --num-attention-heads "$HEADS" --swiglu --seq-length "$SEQ" --micro-batch-size "$MBS"
        --global-batch-size "$GBS" --train-iters "$ITERS" --lr 1e-4 --log-interval 1 --eval-interval 100000
        --eval-iters 0 --data-parallel-sharding-strategy "$STRATEGY" --seed 3 "${model[@]}")
moe=(--num-experts "$EXPERTS" --moe-router-topk "$TOPK" --moe-ffn-hidden-size "$MOE_FFN" --moe-aux-loss-coeff 1e-2
     "${moe_model[@]}")
flags_of() {
  case $1 in
    ep1) echo "${moe[*]} --ffn-hidden-size $MOE_FFN --expert-model-parallel-size 1" ;;
    ep2) echo "${moe[*]} --ffn-hidden-size $MOE_FFN --expert-model-parallel-size 2" ;;
    grouped) echo "${moe[*]} --ffn-hidden-size $MOE_FFN --expert-model-parallel-size $((NPROC > 1 ? 2 : 1)) --moe-grouped-gemm" ;;
    dense) echo "--ffn-hidden-size $dense_ffn" ;;
    # 4 ranks: EP 4 against EP 2 with context parallelism or HSDP over the other factor of 2.
    ep4) echo "${moe[*]} --ffn-hidden-size $MOE_FFN --expert-model-parallel-size 4" ;;
    cp2ep2) echo "${moe[*]} --ffn-hidden-size $MOE_FFN --expert-model-parallel-size 2 --context-parallel-size 2" ;;
    hsdp2ep2) echo "${moe[*]} --ffn-hidden-size $MOE_FFN --expert-model-parallel-size 2 --num-distributed-optimizer-instances 2" ;;
    # TP 2 (with sequence parallelism, as MoE layers need) x EP 2: experts whole (ETP 1, sharded
    # over the expert-data-parallel group that spans the TP pair) or split over the pair (ETP 2).
    tp2ep2) echo "${moe[*]} --ffn-hidden-size $MOE_FFN --expert-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel --expert-tensor-parallel-size 1" ;;
    tp2ep2etp2) echo "${moe[*]} --ffn-hidden-size $MOE_FFN --expert-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel --expert-tensor-parallel-size 2" ;;
    *) echo "moe_step_time: unknown run '$1' (ep1 ep2 grouped dense ep4 cp2ep2 hsdp2ep2 tp2ep2 tp2ep2etp2 fsdp2 fsdp2_ep1)" >&2; exit 2 ;;
  esac
}
# The PyTorch peer: the same model, batch and schedule (torch_llama.py's defaults are mfsdp's:
# tied embedding, vocabulary padded to 128, init std 0.02, AdamW betas/eps, weight decay 0.01,
# --clip-grad 1, linear decay to 0).
torch_common=(--impl fsdp2 --nproc "$NPROC" --threads 1 --device "$DEVICE" --num-layers "$LAYERS"
              --hidden-size "$HIDDEN" --ffn-hidden-size "$MOE_FFN" --num-attention-heads "$HEADS"
              --seq-length "$SEQ" --micro-batch-size "$MBS" --global-batch-size "$GBS" --vocab-size "$VOCAB"
              --train-iters "$ITERS" --warmup-iters "$WARMUP" --lr 1e-4 --seed 3 "${model[@]}" "${moe[@]}")
torch_ep_of() {
  case $1 in
    fsdp2) echo $((NPROC > 1 ? 2 : 1)) ;;
    fsdp2_ep1) echo 1 ;;
  esac
}
for run in $RUNS; do
  case $run in
    fsdp2 | fsdp2_ep1)
      "$PYTHON" -c 'import torch' 2>/dev/null ||
        { echo "moe_step_time: $PYTHON cannot import torch (run $run)" >&2; exit 2; } ;;
    *) flags_of "$run" >/dev/null || exit 2 ;;
  esac
done

failed=0
for round in $(seq 1 "$ROUNDS"); do
  for run in $RUNS; do
    log=$OUT/$run.$round.log
    if [[ $run == fsdp2 || $run == fsdp2_ep1 ]]; then
      # shellcheck disable=SC2086
      if ! OMP_NUM_THREADS=1 "$PYTHON" "$ROOT/bench/torch_llama.py" "${torch_common[@]}" \
          --expert-model-parallel-size "$(torch_ep_of "$run")" $TORCH_EXTRA >"$OUT/$run.$round.json" 2>"$log" ||
          ! grep -q '"iter_times_s"' "$OUT/$run.$round.json"; then
        echo "moe_step_time: run $run (round $round) failed:" >&2
        tail -20 "$log" "$OUT/$run.$round.json" >&2
        failed=1
      fi
      continue
    fi
    # shellcheck disable=SC2046
    if ! OMP_NUM_THREADS=1 "$BUILD/mfsdp-run" --nproc-per-node "$NPROC" "$BUILD/mfsdp-pretrain" "${common[@]}" \
        $(flags_of "$run") $EXTRA --metrics-file "$OUT/$run.$round.jsonl" >"$log" 2>&1; then
      echo "moe_step_time: run $run (round $round) failed:" >&2
      tail -20 "$log" >&2
      failed=1
    fi
  done
done

"$PYTHON" - "$OUT" "$WARMUP" "$GBS" "$SEQ" "$RUNS" "$LAYERS" "$HIDDEN" "$EXPERTS" "$MOE_FFN" \
    "$VOCAB" "$NPROC" "$moe_layers" "$MODEL" <<'EOF'
import glob, json, re, statistics, sys
out, warmup, gbs, seq, runs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5].split()
layers, hidden, experts, moe_ffn, vocab, nproc, moe_layers = map(int, sys.argv[6:13])
model = sys.argv[13]
rows, notes = {}, []
for run in runs:
    times, rss, buffers, loss = [], [], None, None
    if run.startswith("fsdp2"):  # the PyTorch peer: its own JSON line per round
        peaks = []
        for path in sorted(glob.glob(f"{out}/{run}.*.json")):
            recs = [json.loads(l) for l in open(path) if l.startswith("{")]
            if not recs: continue
            r = recs[-1]
            times += r["iter_times_s"]  # already after --warmup-iters
            rss.append(r["peak_rss_mib"][0] * 2**20)  # rank 0, as mfsdp's mem_bytes
            m = r["memory_mib"]
            buffers = (m["params"], m["grads"], m["optimizer"])
            loss = loss or (r["first_loss"], r["final_loss"])
            peaks.append("/".join(f"{x:.0f}" for x in r["peak_rss_mib"]))
            what = (f"{run}: PyTorch {r['torch']} FSDP2, EP {r['moe']['expert_model_parallel_size']}, experts "
                    f"{r['moe']['moe_expert_impl']}, {r['precision']}; peak RSS MiB per rank, round by round:")
        if peaks: notes.append(what + " " + " ".join(peaks))
    for path in sorted(glob.glob(f"{out}/{run}.*.jsonl")):
        recs = [json.loads(l) for l in open(path) if '"eval":true' not in l]
        times += [r["iter_time_s"] for r in recs[warmup:]]
        rss += [r["mem_bytes"] for r in recs]
        if recs and loss is None: loss = (recs[0]["lm_loss"], recs[-1]["lm_loss"])
        log = open(path[:-6] + ".log").read()
        m = re.search(r"memory per rank \(MiB\): model weights ([\d.]+), main weights [\d.]+, main grads ([\d.]+), "
                      r"optimizer state ([\d.]+)", log)
        if m: buffers = tuple(float(x) for x in m.groups())
    if times: rows[run] = (statistics.median(times), max(rss) / 2**20, buffers, loss)
if not rows: sys.exit("no run produced timings")
print(f"model: {model}, {layers} layers ({moe_layers} MoE), hidden {hidden}, {experts} experts")
base_run = "ep1" if "ep1" in rows else next(iter(rows))
base = rows[base_run][0]
print(f"{'run':10} {'iter ms':>9} {'tokens/s':>10} {'vs ' + base_run:>8} {'peak RSS MiB':>13} {'weights MiB':>12} "
      f"{'grads MiB':>10} {'adam MiB':>9}  lm loss 1st>last")
for run, (t, r, b, l) in rows.items():
    w, g, o = b if b else (float("nan"),) * 3
    print(f"{run:10} {t*1e3:9.1f} {gbs*seq/t:10.0f} {base/t:8.2f} {r:13.1f} {w:12.3f} {g:10.3f} {o:9.3f}"
          + (f"  {l[0]:.3f}>{l[1]:.3f}" if l else ""))
# Per-rank fp32 model weights under ZeRO-3 by the formula: dense / (DP x TP) + experts / (EDP x EP
# x ETP), with EDP x EP x ETP = NPROC whatever the split.
expert_params = moe_layers * experts * 3 * hidden * moe_ffn
print(f"expert parameters {expert_params} ({expert_params*4/2**20:.3f} MiB fp32): per rank "
      f"{expert_params*4/2**20/nproc:.3f} MiB over {nproc} rank(s) whatever the EP x EDP split (ZeRO-3)")
for n in notes: print(n)
# mfsdp against its PyTorch peer at the same expert-parallel size: tokens/s above 1 is mfsdp
# faster; peak RSS above 1 is mfsdp larger (rank 0 both).
for ours, peer in (("ep2", "fsdp2"), ("grouped", "fsdp2"), ("ep1", "fsdp2_ep1")):
    if ours in rows and peer in rows:
        print(f"mfsdp {ours} / PyTorch {peer}: tokens/s x{rows[peer][0] / rows[ours][0]:.2f}, "
              f"peak RSS (rank 0) x{rows[ours][1] / rows[peer][1]:.2f}")
EOF
exit $failed
