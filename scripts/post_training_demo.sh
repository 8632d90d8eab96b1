#!/usr/bin/env bash
# Post-training on 2 CPU ranks (docs/sft.md, docs/grpo.md): a small Llama learns 2-digit addition
# in chat format with mfsdp-sft, then GRPO improves a deliberately under-trained SFT checkpoint on
# held-out prompts with mfsdp-grpo; both export a Hugging Face folder.
#   1. set up and build;
#   2. SFT (ZeRO-3): generated "ab+cd=" conversations, greedy exact match on held-out ones;
#   3. GRPO from the run's early checkpoint (iteration 350), which answers some held-out prompts
#      right: exact-match rewards, group-normalised advantages, accuracy before and after;
#   4. a summary with the curves' files. It fails (exit 1, a line saying why) when GRPO did not
#      start from that checkpoint or did not improve on it.
# DEMO_SIZE=ci runs a prefix of the same demo (ctest ReadmeCommands.PostTrainingDemoAtCiSize): SFT
# stops at its iteration-350 checkpoint (--exit-interval 350; the same checkpoint as the full run),
# GRPO runs 50 steps instead of 200. DEMO_OUT moves the output folder.
set -euo pipefail
cd "$(dirname "$0")/.."
size=${DEMO_SIZE:-full}
case "$size" in
  full) sft_stop=(); grpo_iters=200 ;;
  ci) sft_stop=(--exit-interval 350); grpo_iters=50 ;;
  *) echo "post_training_demo: DEMO_SIZE is 'full' or 'ci', not '$size'" >&2; exit 2 ;;
esac
scripts/setup.sh
echo "demo: building the tools (first time: a few minutes)"
scripts/build.sh --target mfsdp-run mfsdp-sft mfsdp-grpo >/dev/null
out=${DEMO_OUT:-build/post_training_demo}
rm -rf "$out"
mkdir -p "$out"

model=(--tokenizer-type ByteLevelTokenizer --num-layers 4 --hidden-size 128 --ffn-hidden-size 352
       --num-attention-heads 4 --group-query-attention --num-query-groups 2 --swiglu
       --data-parallel-sharding-strategy optim_grads_params --seed 1234)
task=(--gen-task arith --gen-digits 2 --gen-seed 7 --gen-train-size 7000 --gen-val-size 400)

echo "== SFT: 2-digit addition in chat format, 2 ranks, ZeRO-3 (checkpoints every 350 iterations)"
start=$(date +%s)
build/mfsdp-run --nproc-per-node 2 build/mfsdp-sft "${model[@]}" "${task[@]}" \
  --max-length 48 --micro-batch-size 32 --global-batch-size 64 --train-iters 1000 \
  --lr 3e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 50 --weight-decay 0.01 \
  --clip-grad 1.0 --log-interval 50 --eval-interval 350 --eval-iters 2 --val-generate-samples 400 \
  --max-new-tokens 6 --metrics-file "$out/sft.jsonl" --save "$out/sft_ckpt" --save-interval 350 \
  --export-hf "$out/sft_hf" "${sft_stop[@]}" | tee "$out/sft.log"
sft_seconds=$(( $(date +%s) - start ))

# GRPO starts from the deliberately under-trained checkpoint of iteration 350 (held-out exact
# match ~20-30%: it sometimes answers right, so groups have a reward signal).
warm="$out/sft_ckpt/iter_0000350"

echo "== GRPO from it: 32 prompts x 16 responses per step, exact-match reward, KL to a sharded reference"
start=$(date +%s)
build/mfsdp-run --nproc-per-node 2 build/mfsdp-grpo "${model[@]}" "${task[@]}" \
  --load "$warm" --finetune --max-prompt-length 32 --max-response-length 6 \
  --train-batch-size 32 --rollout-n 16 --micro-batch-size 128 --train-iters "$grpo_iters" \
  --lr 5e-4 --lr-warmup-iters 10 --lr-decay-style constant --clip-grad 1.0 --temperature 1.0 \
  --scale-rewards group --loss-agg-mode token-mean --use-kl-loss --kl-loss-coef 0.001 \
  --kl-loss-type low_var_kl --log-interval 10 --eval-interval 50 --val-generate-samples 400 \
  --metrics-file "$out/grpo.jsonl" --export-hf "$out/grpo_hf" | tee "$out/grpo.log"
grpo_seconds=$(( $(date +%s) - start ))

sft_match=$(grep 'validation at' "$out/sft.log" | tail -1 | grep -o 'exact match: [0-9.]*' | cut -d' ' -f3 || true)
warm_match=$(grep 'validation at iteration 350 ' "$out/sft.log" | grep -o 'exact match: [0-9.]*' | cut -d' ' -f3 || true)
before=$(grep 'validation at' "$out/grpo.log" | head -1 | grep -o 'score: [0-9.]*' | cut -d' ' -f2 || true)
after=$(grep 'validation at' "$out/grpo.log" | tail -1 | grep -o 'score: [0-9.]*' | cut -d' ' -f2 || true)
echo
echo "== summary"
echo "   SFT: held-out exact match ${sft_match} after ${sft_seconds} s (curve: $out/sft.svg, metrics: $out/sft.jsonl)"
echo "   GRPO: held-out accuracy ${before} -> ${after} in ${grpo_seconds} s, from an SFT checkpoint at ${warm_match}"
echo "         (reward curve: $out/grpo.reward.svg, metrics: $out/grpo.jsonl)"
hf_folders=$(for f in "$out/sft_hf" "$out/grpo_hf"; do [ -d "$f" ] && printf '%s ' "$f"; done || true)
echo "   Hugging Face folders: ${hf_folders:-none (SFT stopped at 350: DEMO_SIZE=ci)}"
# GRPO's accuracy before its first step is the checkpoint's: the same 400 prompts, answered greedily.
grep -q "loaded checkpoint $warm" "$out/grpo.log" ||
  { echo "post_training_demo: FAILED: GRPO did not load $warm (no 'loaded checkpoint' line in $out/grpo.log)"; exit 1; }
[ -n "$before" ] && [ -n "$warm_match" ] && awk -v a="$before" -v b="$warm_match" 'BEGIN { exit !(a == b) }' ||
  { echo "post_training_demo: FAILED: GRPO started at ${before}, not at its checkpoint's ${warm_match}"; exit 1; }
awk -v a="$before" -v b="$after" 'BEGIN { exit !(b > a) }' ||
  { echo "post_training_demo: FAILED: GRPO did not improve the held-out accuracy (${before} -> ${after})"; exit 1; }
