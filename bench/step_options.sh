#!/usr/bin/env bash
# What the step's memory options cost and save (issue 49): activation recompute (selective, its
# modules, full) and the optimizers (bf16 moments of the precision-aware AdamW, Muon) against
# the defaults (no recompute, AdamW with fp32 moments), on a compute-bound shape.
#
#   bench/step_options.sh [ROUNDS]      (default 2; BUILD=build)
#
# Model: Llama 4 x d512 (GQA 8/4 heads, SwiGLU FFN 1408), vocabulary 32000, sequence 1024,
# micro-batch 4 (4096 tokens), 1 rank, fp32, mock data, 6 iterations; bench/pretrain_variants.sh
# runs and tabulates (peak RSS, step time, optimizer state bytes a parameter).
set -euo pipefail
MODEL=" --device cpu --mock-data --vocab-size 32000 --make-vocab-size-divisible-by 128 --num-layers 4
 --hidden-size 512 --num-attention-heads 8 --group-query-attention --num-query-groups 4 --swiglu
 --ffn-hidden-size 1408 --untie-embeddings-and-output-weights --seq-length 1024 --micro-batch-size 4
 --global-batch-size 4 --train-iters 6 --lr 1e-4 --log-interval 1 --eval-interval 1000 --eval-iters 1 --seed 1" \
TITLE="step options: Llama 4 x d512, 4096 tokens a micro-batch, 1 rank, fp32" \
  exec "$(dirname "$0")/pretrain_variants.sh" "${1:-2}" "defaults::" \
  "selective core_attn::--recompute-granularity selective" \
  "selective core_attn, layernorm, mlp::--recompute-granularity selective --recompute-modules core_attn layernorm mlp" \
  "full uniform 1::--recompute-granularity full --recompute-method uniform --recompute-num-layers 1" \
  "bf16 moments::--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16" \
  "muon::--optimizer muon"
