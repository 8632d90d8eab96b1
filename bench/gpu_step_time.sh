#!/usr/bin/env bash
# GPU step time of mfsdp-pretrain side by side with PyTorch DDP, PyTorch FSDP2 and Megatron-FSDP
# itself (the megatron-fsdp package), the same Llama, batch and sequence length, one rank per GPU,
# on one GPU and then on all of them: bench/cpu_step_time.sh with DEVICE=cuda and GPU defaults
# (Llama-3.2-1B's shape, untied: 1.5B parameters, at sequence length 2048, bf16), once per NPROC
# value. Tokens/s, TFLOP/s per GPU (Megatron's formula, bench/llama_flops.py, as mfsdp's
# metrics), MFU against the GPU's dense bf16 peak, peak memory per GPU (the CUDA caching
# allocator's peak allocated bytes: mfsdp rank 0's, every rank of the PyTorch peers'
# peak_gpu_mib), and the ratios mfsdp/FSDP2, mfsdp/Megatron-FSDP and mfsdp/DDP of throughput and
# of peak memory.
#
#   bench/gpu_step_time.sh                              # 1 GPU, then all (NPROC="1 <GPU count>")
#   NPROC=1 bench/gpu_step_time.sh                      # one GPU only
#   LAYERS=2 HIDDEN=256 FFN=704 HEADS=8 QUERY_GROUPS=8 VOCAB=1024 SEQ=256 ITERS=6 WARMUP=2 bench/gpu_step_time.sh
#
# Runs (RUNS, default "b e p r"; the letters of bench/cpu_step_time.sh): b mfsdp ZeRO-3
# (optim_grads_params; its default --optimizer-implementation auto is fused AdamW on CUDA, so x,
# the same with fused named, is the same run here), e PyTorch DDP (autocast bf16, fp32 weights
# and reduction), p PyTorch
# FSDP2 (torch_llama.py --impl fsdp2: MixedPrecisionPolicy bf16 compute, fp32 reduce), r
# Megatron-FSDP (torch_llama.py --impl megatron_fsdp: bf16 weights, fp32 main weights and
# grads; skipped with a note when megatron_fsdp is not importable). PEAK_TFLOPS defaults from
# the GPU's name (dense bf16, datasheet): H100 SXM / 80GB HBM3 and H200 989.4, H100 PCIe 756,
# A100 312; the choice is printed; set it for any other GPU.
# Environment: bench/cpu_step_time.sh's, with these defaults: NPROC ["1 <nvidia-smi -L count>",
#   a list, duplicates dropped] LAYERS [16] HIDDEN [2048] FFN [8192] HEADS [32] QUERY_GROUPS [8]
#   VOCAB [128256] UNTIE [1] SEQ [2048] MBS [2] GBS [MBS x NPROC, per NPROC value] ITERS [12]
#   WARMUP [4] THREADS [4, at most the CPU cores per rank] PRECISIONS [bf16] RUNS [b e p r]
#   OUT [each NPROC value's own temporary folder; if set: OUT/nproc<N>]
#   PYTHON [<repo>/.venv/bin/python if present, else python3]
# Memory at the default shape, per GPU on 1 GPU: DDP's fp32 weights, gradients and AdamW state
# are 16 B x 1.5e9 = 24 GB, plus activations and logits (2 x 2048 x 128256) of a few GB.
# Time on one H100 (an estimate, not yet measured): 12 iterations of ~0.1-0.3 s per run after
# ~15-25 s of start-up (CUDA and NCCL, the model, the wrapper's buffers) make about 1.5-2 minutes
# per NPROC value for the four runs, so the default two values take under 4 minutes.
# Exit status: 0 when every NPROC value's runs succeeded; else the first failing value's
# bench/cpu_step_time.sh status (1 a run failed, 2 bad settings).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
die() { echo "gpu_step_time.sh: $*" >&2; exit 2; }
if [[ -z ${PYTHON:-} ]]; then
  PYTHON=$ROOT/.venv/bin/python
  [[ -x $PYTHON ]] || PYTHON=python3
fi
gpu_count=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [[ -z ${NPROC:-} ]]; then
  ((gpu_count > 0)) || die "nvidia-smi -L lists no GPU (set NPROC to override)"
  NPROC="1 $gpu_count"
fi
nprocs=()
for n in $NPROC; do
  [[ $n =~ ^[1-9][0-9]*$ ]] || die "NPROC: '$n' is not a positive integer"
  [[ " ${nprocs[*]} " == *" $n "* ]] || nprocs+=("$n")
done
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
if [[ -z ${PEAK_TFLOPS:-} ]]; then
  case $gpu in
    *H100*PCIe*) PEAK_TFLOPS=756 ;;
    *H100* | *H200*) PEAK_TFLOPS=989.4 ;;  # GH200 too
    *A100*) PEAK_TFLOPS=312 ;;
    *) die "unknown GPU '$gpu': set PEAK_TFLOPS (its dense bf16 TFLOP/s)" ;;
  esac
  echo "gpu_step_time.sh: GPU '$gpu': MFU against PEAK_TFLOPS=$PEAK_TFLOPS (its dense bf16 datasheet peak)"
else
  echo "gpu_step_time.sh: GPU '${gpu:-unknown}': MFU against PEAK_TFLOPS=$PEAK_TFLOPS (set by the caller)"
fi
export PYTHON PEAK_TFLOPS DEVICE=cuda
export LAYERS=${LAYERS:-16} HIDDEN=${HIDDEN:-2048} FFN=${FFN:-8192} HEADS=${HEADS:-32}
export QUERY_GROUPS=${QUERY_GROUPS:-8} VOCAB=${VOCAB:-128256} UNTIE=${UNTIE:-1} SEQ=${SEQ:-2048}
export MBS=${MBS:-2} ITERS=${ITERS:-12} WARMUP=${WARMUP:-4}
export PRECISIONS=${PRECISIONS:-bf16} RUNS=${RUNS:-b e p r}
cores=$(nproc)
status=0
for n in "${nprocs[@]}"; do
  # The caller's GBS, THREADS and OUT hold for every value; the defaults follow n.
  threads=${THREADS:-$((cores / n < 4 ? (cores / n > 0 ? cores / n : 1) : 4))}
  out=${OUT:+$OUT/nproc$n}
  NPROC=$n GBS=${GBS:-$((MBS * n))} THREADS=$threads OUT=$out "$ROOT/bench/cpu_step_time.sh"
  rc=$?
  ((rc && !status)) && status=$rc
done
exit "$status"
