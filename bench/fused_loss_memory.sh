#!/usr/bin/env bash
# The loss without full logits (--cross-entropy-loss-fusion, the default) against the loss from
# the full logits (--no-cross-entropy-loss-fusion): peak RSS and step time of mfsdp-pretrain on a
# small Llama with a real-size vocabulary, where the logits dominate memory.
#
#   bench/fused_loss_memory.sh [ROUNDS]      (default 3; BUILD=build)
#
# Model: Llama 4 x d256 (GQA 8/4 heads, SwiGLU FFN 704), vocabulary 128256 (Llama 3's), untied,
# sequence 512, micro-batch 4 (2048 tokens a micro-batch: 2048 x 128256 fp32 logits are 1 GiB a
# copy), 1 rank, fp32, mock data, 6 iterations; bench/pretrain_variants.sh runs and tabulates.
set -euo pipefail
MODEL=" --device cpu --mock-data --vocab-size 128256 --make-vocab-size-divisible-by 128 --num-layers 4
 --hidden-size 256 --num-attention-heads 8 --group-query-attention --num-query-groups 4 --swiglu
 --ffn-hidden-size 704 --untie-embeddings-and-output-weights --seq-length 512 --micro-batch-size 4
 --global-batch-size 4 --train-iters 6 --lr 1e-4 --log-interval 1 --eval-interval 1000 --eval-iters 1 --seed 1" \
TITLE="fused loss vs full logits: Llama 4 x d256, vocabulary 128256, 2048 tokens a micro-batch, 1 rank, fp32" \
  exec "$(dirname "$0")/pretrain_variants.sh" "${1:-3}" "fused (--cross-entropy-loss-fusion)::" \
  "full logits::--no-cross-entropy-loss-fusion"
