#!/usr/bin/env bash
# GPU step time of mfsdp-pretrain side by side with PyTorch DDP, PyTorch FSDP2 and Megatron-FSDP
# itself (the megatron-fsdp package), the same Llama, batch and sequence length, one rank per GPU:
# bench/cpu_step_time.sh with DEVICE=cuda and GPU defaults (a ~1.5B Llama-3.2-1B-shaped model,
# untied, at sequence length 2048, bf16). Tokens/s, TFLOP/s per GPU (Megatron's formula), MFU
# against the GPU's dense bf16 peak, peak allocated memory, and the ratios.
#
#   bench/gpu_step_time.sh                              # all GPUs (NPROC = nvidia-smi -L count)
#   NPROC=1 bench/gpu_step_time.sh                      # one GPU
#   LAYERS=2 HIDDEN=256 FFN=704 HEADS=8 QUERY_GROUPS=8 VOCAB=1024 SEQ=256 ITERS=6 WARMUP=2 bench/gpu_step_time.sh
#
# Runs (RUNS, default "b e p r"; see bench/cpu_step_time.sh): b mfsdp ZeRO-3, e PyTorch DDP
# (autocast bf16), p PyTorch FSDP2 (MixedPrecisionPolicy bf16 / fp32 reduce), r Megatron-FSDP
# (bf16 weights, fp32 main weights and grads; skipped with a note when megatron_fsdp is not
# importable). PEAK_TFLOPS defaults from the GPU's name (dense bf16, datasheet): H100 SXM and
# H200 989.4, H100 PCIe 756, A100 312; set it for any other GPU.
# Environment: bench/cpu_step_time.sh's, with these defaults: LAYERS [16] HIDDEN [2048]
#   FFN [8192] HEADS [32] QUERY_GROUPS [8] VOCAB [128256] UNTIE [1] SEQ [2048] MBS [2]
#   GBS [MBS x NPROC] ITERS [12] WARMUP [4] THREADS [4] PRECISIONS [bf16] RUNS [b e p r]
#   PYTHON [<repo>/.venv/bin/python if present, else python3]
# Time on one H100 (estimate: ~12 iterations of ~1-2 s per run plus start-up): about 2 minutes
# per NPROC value for the four runs.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
die() { echo "gpu_step_time.sh: $*" >&2; exit 2; }
if [[ -z ${PYTHON:-} ]]; then
  PYTHON=$ROOT/.venv/bin/python
  [[ -x $PYTHON ]] || PYTHON=python3
fi
if [[ -z ${NPROC:-} ]]; then
  NPROC=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  ((NPROC > 0)) || die "nvidia-smi -L lists no GPU (set NPROC to override)"
fi
if [[ -z ${PEAK_TFLOPS:-} ]]; then
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  case $gpu in
    *H100*PCIe*) PEAK_TFLOPS=756 ;;
    *H100* | *H200* | *GH200*) PEAK_TFLOPS=989.4 ;;
    *A100*) PEAK_TFLOPS=312 ;;
    *) die "unknown GPU '$gpu': set PEAK_TFLOPS (its dense bf16 TFLOP/s)" ;;
  esac
fi
export PYTHON NPROC PEAK_TFLOPS DEVICE=cuda
export LAYERS=${LAYERS:-16} HIDDEN=${HIDDEN:-2048} FFN=${FFN:-8192} HEADS=${HEADS:-32}
export QUERY_GROUPS=${QUERY_GROUPS:-8} VOCAB=${VOCAB:-128256} UNTIE=${UNTIE:-1} SEQ=${SEQ:-2048}
export MBS=${MBS:-2} && export GBS=${GBS:-$((MBS * NPROC))}
export ITERS=${ITERS:-12} WARMUP=${WARMUP:-4} THREADS=${THREADS:-4}
export PRECISIONS=${PRECISIONS:-bf16} RUNS=${RUNS:-b e p r}
exec "$ROOT/bench/cpu_step_time.sh"
