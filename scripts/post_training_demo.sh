#!/usr/bin/env bash
# Post-training on 2 CPU ranks (docs/sft.md, docs/grpo.md): a small Llama learns 2-digit addition
# in chat format with mfsdp-sft, then GRPO improves an under-trained SFT checkpoint on held-out
# prompts with mfsdp-grpo; both export a Hugging Face folder.
#   1. set up and build;
#   2. SFT (ZeRO-3): generated "ab+cd=" conversations, greedy exact match on 400 held-out ones
#      every 25 iterations, a checkpoint at each;
#   3. GRPO from the first of those checkpoints whose exact match reaches warm_min (0.20): chosen by
#      accuracy, not by iteration, because where SFT's steep rise (a few % to 90% within ~250
#      iterations) starts moves with the seed and with the CPU's kernels (MKL and oneDNN round
#      differently on Intel and AMD, and hundreds of clipped Adam steps amplify that);
#   4. a summary with the curves' files. It fails (exit 1, a line saying why) when no checkpoint
#      falls in [warm_min, warm_max], when GRPO did not start from the chosen one, or when it raised
#      the held-out accuracy by less than min_gain (0.30 in 300 steps; 0.15 in 150 at DEMO_SIZE=ci).
# DEMO_SIZE=ci runs a prefix of the same demo (ctest ReadmeCommands.post_training_at_ci_size): SFT
# stops at iteration 500 (--exit-interval; every measured seed and kernel path reached 0.20 by
# 400, docs/PERFORMANCE.md) with the same checkpoints as the full run, and GRPO runs the first 150
# steps of the full run's 300 (the learning rate is constant after warm-up, so they are the same
# steps). DEMO_OUT moves the output folder; DEMO_SEED (default 1234) seeds the model's
# initialisation, the data order and the rollouts (the task and its held-out split stay fixed).
set -euo pipefail
cd "$(dirname "$0")/.."
size=${DEMO_SIZE:-full}
case "$size" in
  full) sft_stop=(); grpo_iters=300 min_gain=0.30 ;;
  ci) sft_stop=(--exit-interval 500); grpo_iters=150 min_gain=0.15 ;;
  *) echo "post_training_demo: DEMO_SIZE is 'full' or 'ci', not '$size'" >&2; exit 2 ;;
esac
seed=${DEMO_SEED:-1234}
[[ $seed =~ ^[0-9]+$ ]] || { echo "post_training_demo: DEMO_SEED is a non-negative integer, not '$seed'" >&2; exit 2; }
# The band the starting checkpoint's held-out exact match must fall in. Below ~0.15 too few of
# GRPO's groups hold a right answer for it to learn (measured: from 0.10, +4 points in 50 steps);
# above 0.5 there is little left to gain.
warm_min=0.20 warm_max=0.50
scripts/setup.sh
echo "demo: building the tools (first time: a few minutes)"
scripts/build.sh --target mfsdp-run mfsdp-sft mfsdp-grpo >/dev/null
out=${DEMO_OUT:-build/post_training_demo}
rm -rf "$out"
mkdir -p "$out"

model=(--tokenizer-type ByteLevelTokenizer --num-layers 4 --hidden-size 128 --ffn-hidden-size 352
       --num-attention-heads 4 --group-query-attention --num-query-groups 2 --swiglu
       --data-parallel-sharding-strategy optim_grads_params --seed "$seed")
task=(--gen-task arith --gen-digits 2 --gen-seed 7 --gen-train-size 7000 --gen-val-size 400)

# AdamW 1e-3 (cosine to 1e-4): at 3e-3 one seed of four stayed on the loss plateau of ~0.7 per
# token (0.17 exact match after 1000 iterations) where at 1e-3 all four leave it by iteration
# ~400 (docs/PERFORMANCE.md).
echo "== SFT: 2-digit addition in chat format, 2 ranks, ZeRO-3 (evaluated and saved every 25 iterations)"
start=$(date +%s)
build/mfsdp-run --nproc-per-node 2 build/mfsdp-sft --device cpu "${model[@]}" "${task[@]}" \
  --max-length 48 --micro-batch-size 32 --global-batch-size 64 --train-iters 1000 \
  --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 50 --weight-decay 0.01 \
  --clip-grad 1.0 --log-interval 50 --eval-interval 25 --eval-iters 2 --val-generate-samples 400 \
  --max-new-tokens 6 --metrics-file "$out/sft.jsonl" --save "$out/sft_ckpt" --save-interval 25 \
  --export-hf "$out/sft_hf" "${sft_stop[@]}" | tee "$out/sft.log"
sft_seconds=$(( $(date +%s) - start ))

# The starting checkpoint: the first validation whose exact match reaches warm_min.
points=$(sed -n 's/.*validation at iteration \([0-9]*\) .*exact match: \([0-9.]*\).*/\1 \2/p' "$out/sft.log")
read -r warm_iter warm_match < <(awk -v lo="$warm_min" '$2 >= lo { print; exit }' <<<"$points") || true
echo "   SFT held-out exact match by iteration: $(tr ' ' ':' <<<"$points" | paste -sd' ')"
[ -n "${warm_iter:-}" ] ||
  { echo "post_training_demo: FAILED: no SFT checkpoint reached held-out exact match $warm_min"; exit 1; }
awk -v m="$warm_match" -v hi="$warm_max" 'BEGIN { exit !(m <= hi) }' ||
  { echo "post_training_demo: FAILED: SFT jumped past the band: the first checkpoint at >= $warm_min is iteration $warm_iter at $warm_match (> $warm_max)"; exit 1; }
warm="$out/sft_ckpt/$(printf 'iter_%07d' "$warm_iter")"
[ -f "$warm/.metadata" ] || { echo "post_training_demo: FAILED: no checkpoint $warm"; exit 1; }
# Keep the chosen checkpoint and the last one; the others were only candidates (~9 MB each).
last=$(cat "$out/sft_ckpt/latest_checkpointed_iteration.txt")
for d in "$out"/sft_ckpt/iter_*; do
  case "$(basename "$d")" in "$(basename "$warm")"|"$(printf 'iter_%07d' "$last")") ;; *) rm -rf "$d" ;; esac
done
echo "== GRPO from the first SFT checkpoint at >= $warm_min: iteration $warm_iter, held-out exact match $warm_match"
echo "   128 prompts x 4 responses per step, exact-match reward, KL to a sharded reference"

# GRPO settings, measured on this task (docs/PERFORMANCE.md): 128 prompts x 4 responses per step
# learn faster than 32 x 16 or 64 x 8 at the same 512 responses (more prompts per step, and a
# group of 4 still holds a right answer for most prompts at a 20-50% start); AdamW 5e-4, where
# 1.5e-3 collapsed and 2.5e-4 was slower; one on-policy update per step (2 mini-batches gained
# little for twice the update time); a small KL loss to the SFT checkpoint (low_var_kl, 0.001),
# verl's default, keeping the policy near it without slowing it.
start=$(date +%s)
build/mfsdp-run --nproc-per-node 2 build/mfsdp-grpo --device cpu "${model[@]}" "${task[@]}" \
  --load "$warm" --finetune --max-prompt-length 32 --max-response-length 6 \
  --train-batch-size 128 --rollout-n 4 --micro-batch-size 128 --train-iters "$grpo_iters" \
  --lr 5e-4 --lr-warmup-iters 10 --lr-decay-style constant --clip-grad 1.0 --temperature 1.0 \
  --scale-rewards group --loss-agg-mode token-mean --use-kl-loss --kl-loss-coef 0.001 \
  --kl-loss-type low_var_kl --log-interval 10 --eval-interval 50 --val-generate-samples 400 \
  --metrics-file "$out/grpo.jsonl" --export-hf "$out/grpo_hf" | tee "$out/grpo.log"
grpo_seconds=$(( $(date +%s) - start ))

sft_match=$(grep 'validation at' "$out/sft.log" | tail -1 | grep -o 'exact match: [0-9.]*' | cut -d' ' -f3 || true)
before=$(grep 'validation at' "$out/grpo.log" | head -1 | grep -o 'score: [0-9.]*' | cut -d' ' -f2 || true)
after=$(grep 'validation at' "$out/grpo.log" | tail -1 | grep -o 'score: [0-9.]*' | cut -d' ' -f2 || true)
echo
echo "== summary"
echo "   SFT: held-out exact match ${sft_match} after ${sft_seconds} s (curve: $out/sft.svg, metrics: $out/sft.jsonl)"
echo "   GRPO: held-out accuracy ${before} -> ${after} in ${grpo_seconds} s, from the SFT checkpoint of iteration ${warm_iter} at ${warm_match}"
echo "         (reward curve: $out/grpo.reward.svg, metrics: $out/grpo.jsonl)"
hf_folders=$(for f in "$out/sft_hf" "$out/grpo_hf"; do [ -d "$f" ] && printf '%s ' "$f"; done || true)
echo "   Hugging Face folders: ${hf_folders:-none (SFT stopped early: DEMO_SIZE=ci)}"
# GRPO's accuracy before its first step is the checkpoint's: the same 400 prompts, answered greedily.
grep -q "loaded checkpoint $warm" "$out/grpo.log" ||
  { echo "post_training_demo: FAILED: GRPO did not load $warm (no 'loaded checkpoint' line in $out/grpo.log)"; exit 1; }
[ -n "$before" ] && awk -v a="$before" -v b="$warm_match" 'BEGIN { exit !(a == b) }' ||
  { echo "post_training_demo: FAILED: GRPO started at ${before}, not at its checkpoint's ${warm_match}"; exit 1; }
awk -v a="$before" -v b="$after" -v g="$min_gain" 'BEGIN { exit !(b >= a + g) }' ||
  { echo "post_training_demo: FAILED: GRPO raised the held-out accuracy by less than $min_gain (${before} -> ${after})"; exit 1; }
