#!/usr/bin/env bash
# Post-training on 2 CPU ranks (docs/sft.md, docs/grpo.md): a small Llama learns 2-digit addition
# in chat format with mfsdp-sft, then GRPO improves a deliberately under-trained SFT checkpoint on
# held-out prompts with mfsdp-grpo; both export a Hugging Face folder.
#   1. set up and build;
#   2. SFT (ZeRO-3): generated "ab+cd=" conversations, greedy exact match on held-out ones;
#   3. a short SFT run -> a checkpoint that answers some held-out prompts right;
#   4. GRPO from it: exact-match rewards, group-normalised advantages, accuracy before and after;
#   5. a summary with the curves' files.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
echo "demo: building the tools (first time: a few minutes)"
scripts/build.sh --target mfsdp-run mfsdp-sft mfsdp-grpo >/dev/null
out=build/post_training_demo
rm -rf "$out"
mkdir -p "$out"

model=(--tokenizer-type ByteLevelTokenizer --num-layers 4 --hidden-size 128 --ffn-hidden-size 352
       --num-attention-heads 4 --group-query-attention --num-query-groups 2 --swiglu
       --data-parallel-sharding-strategy optim_grads_params --seed 1234)
task=(--gen-task arith --gen-digits 2 --gen-seed 7 --gen-train-size 7000 --gen-val-size 400)

echo "== SFT: 2-digit addition in chat format, 2 ranks, ZeRO-3"
start=$(date +%s)
build/mfsdp-run --nproc-per-node 2 build/mfsdp-sft "${model[@]}" "${task[@]}" \
  --max-length 48 --micro-batch-size 32 --global-batch-size 64 --train-iters ${SFT_ITERS:-1200} \
  --lr 3e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 50 --weight-decay 0.01 \
  --clip-grad 1.0 --log-interval 100 --eval-interval 400 --eval-iters 2 --val-generate-samples 400 \
  --max-new-tokens 6 --metrics-file "$out/sft.jsonl" --export-hf "$out/sft_hf" | tee "$out/sft.log"
sft_seconds=$(( $(date +%s) - start ))

echo "== a deliberately under-trained SFT checkpoint for GRPO"
build/mfsdp-run --nproc-per-node 2 build/mfsdp-sft "${model[@]}" "${task[@]}" \
  --max-length 48 --micro-batch-size 32 --global-batch-size 64 --train-iters ${WARM_ITERS:-300} \
  --lr 3e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 50 --clip-grad 1.0 \
  --log-interval 100 --eval-interval 100000 --eval-iters 2 --val-generate-samples 400 --max-new-tokens 6 \
  --save "$out/warm" | tee "$out/warm.log"

echo "== GRPO from it: 16 prompts x 8 responses per step, exact-match reward"
start=$(date +%s)
build/mfsdp-run --nproc-per-node 2 build/mfsdp-grpo "${model[@]}" "${task[@]}" \
  --load "$out/warm" --finetune --max-prompt-length 32 --max-response-length 6 \
  --train-batch-size 16 --rollout-n 8 --micro-batch-size 64 --train-iters ${GRPO_ITERS:-150} \
  --lr 1e-4 --clip-grad 1.0 --temperature 1.0 --scale-rewards group --loss-agg-mode token-mean \
  --log-interval 10 --eval-interval 50 --val-generate-samples 400 \
  --metrics-file "$out/grpo.jsonl" --export-hf "$out/grpo_hf" | tee "$out/grpo.log"
grpo_seconds=$(( $(date +%s) - start ))

sft_match=$(grep 'validation at' "$out/sft.log" | tail -1 | grep -o 'exact match: [0-9.]*' | cut -d' ' -f3)
warm_match=$(grep 'validation at' "$out/warm.log" | tail -1 | grep -o 'exact match: [0-9.]*' | cut -d' ' -f3)
before=$(grep 'validation at' "$out/grpo.log" | head -1 | grep -o 'score: [0-9.]*' | cut -d' ' -f2)
after=$(grep 'validation at' "$out/grpo.log" | tail -1 | grep -o 'score: [0-9.]*' | cut -d' ' -f2)
echo
echo "== summary"
echo "   SFT: held-out exact match ${sft_match} after ${sft_seconds} s (curve: $out/sft.svg, metrics: $out/sft.jsonl)"
echo "   GRPO: held-out accuracy ${before} -> ${after} in ${grpo_seconds} s, from an SFT checkpoint at ${warm_match}"
echo "         (reward curve: $out/grpo.reward.svg, metrics: $out/grpo.jsonl)"
echo "   Hugging Face folders: $out/sft_hf, $out/grpo_hf"
