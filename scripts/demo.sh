#!/usr/bin/env bash
# The README's main job: pretrain a small Llama with Megatron-FSDP's ZeRO-3 on 2 ranks, on a real
# English corpus (Debian's `fortunes`), then generate text with it.
#   1. set up and build;  2. corpus -> Megatron indexed dataset (mfsdp-preprocess, byte-level);
#   3. mfsdp-run --nproc-per-node 2 mfsdp-pretrain (Megatron flags, optim_grads_params);
#   4. mfsdp-generate from the sharded checkpoint it saved;  5. that checkpoint exported to a
#      Hugging Face folder (mfsdp-ckpt export-hf);  6. a summary.
# DEMO_SIZE=ci trains 60 iterations instead of 400 (ctest ReadmeCommands.DemoAtCiSize runs it so);
# DEMO_OUT moves the output folder.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${DEMO_SIZE:-full}" in
  full) iters=400; every=200; log_every=25; warmup=40 ;;
  ci) iters=60; every=30; log_every=10; warmup=10 ;;
  *) echo "demo: DEMO_SIZE is 'full' or 'ci', not '$DEMO_SIZE'" >&2; exit 2 ;;
esac
scripts/setup.sh
if ! dpkg-query -W -f='${Status}' fortunes 2>/dev/null | grep -q "install ok installed"; then
  sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
  echo "demo: installing the fortunes corpus (Debian package 'fortunes')"
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fortunes >/dev/null
fi
echo "demo: building the tools (first time: a few minutes)"
scripts/build.sh --target mfsdp-run mfsdp-preprocess mfsdp-pretrain mfsdp-generate mfsdp-ckpt >/dev/null
out=${DEMO_OUT:-build/demo}
rm -rf "$out/ckpt" "$out/hf" "$out/model"  # model: what older versions of this demo wrote
mkdir -p "$out"

echo "== corpus: Debian fortunes (one document per fortune)"
# Fortune files separate entries by a line holding '%'; the preprocessor wants blank lines.
for f in fortunes literature people wisdom science computers definitions humorists love \
         education work politics law medicine food; do
  [ -f "/usr/share/games/fortunes/$f" ] && cat "/usr/share/games/fortunes/$f"
done | awk '/^%$/ { print ""; next } { print }' > "$out/fortunes.txt"
echo "   $(wc -c < "$out/fortunes.txt") bytes, $(grep -c '^$' "$out/fortunes.txt") fortunes"
build/mfsdp-preprocess --input "$out/fortunes.txt" --output-prefix "$out/fortunes" \
  --tokenizer-type ByteLevelTokenizer --append-eod --log-interval 0

echo "== pretraining: Llama (4 layers, d=128, GQA, SwiGLU, RoPE) on 2 ranks, ZeRO-3"
start=$(date +%s)
build/mfsdp-run --nproc-per-node 2 build/mfsdp-pretrain --device cpu \
  --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params \
  --no-gradient-accumulation-fusion --use-distributed-optimizer --ckpt-format fsdp_dtensor \
  --data-path "$out/fortunes_text_document" --tokenizer-type ByteLevelTokenizer --split 98,2,0 \
  --num-layers 4 --hidden-size 128 --ffn-hidden-size 352 --num-attention-heads 4 \
  --group-query-attention --num-query-groups 2 --swiglu --normalization RMSNorm \
  --position-embedding-type rope --seq-length 128 --max-position-embeddings 256 \
  --micro-batch-size 8 --global-batch-size 32 --train-iters "$iters" --lr 3e-3 --min-lr 3e-4 \
  --lr-decay-style cosine --lr-warmup-iters "$warmup" --weight-decay 0.1 --clip-grad 1.0 --seed 1234 \
  --log-interval "$log_every" --eval-interval "$every" --eval-iters 4 --metrics-file "$out/metrics.jsonl" \
  --fsdp-double-buffer --save "$out/ckpt" --save-interval "$every" \
  --sample-prompt "The secret of life is" --sample-tokens 120 \
  | tee "$out/train.log"
train_seconds=$(( $(date +%s) - start ))

# The checkpoint as both ranks wrote it: mfsdp-generate assembles the shards in one process.
echo "== generation: mfsdp-generate --model $out/ckpt"
sample=$(build/mfsdp-generate --model "$out/ckpt" --prompt "A programmer " --max-new-tokens 120 \
  --temperature 0.8 --top-k 20 --seed 7)
echo "$sample"

echo "== checkpoint: $out/ckpt (each rank wrote its shard), every byte against its CRC-32C"
build/mfsdp-ckpt verify "$out/ckpt"
echo "== checkpoint -> Hugging Face folder $out/hf"
build/mfsdp-ckpt export-hf "$out/ckpt" "$out/hf" --dtype bf16
ls -l "$out/hf"

first=$(grep -m1 -o 'lm loss: [0-9.E+-]*' "$out/train.log" | head -1 | cut -d' ' -f3)
last=$(grep -v validation "$out/train.log" | grep -o 'lm loss: [0-9.E+-]*' | tail -1 | cut -d' ' -f3)
val=$(grep validation "$out/train.log" | grep -o 'lm loss: [0-9.e+-]*' | tail -1 | cut -d' ' -f3)
tps=$(grep -o 'tokens/s: [0-9.]*' "$out/train.log" | tail -1 | cut -d' ' -f2)
mem=$(grep -o 'memory per rank.*' "$out/train.log" | tail -1)
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a) }' || { echo "demo: the loss did not fall ($first -> $last)"; exit 1; }
cat <<SUMMARY
== demo summary
- trained in ${train_seconds} s on 2 ranks (ZeRO-3: weights, gradients and AdamW state sharded)
- training lm loss ${first} -> ${last}, validation ${val} (byte-level; ln 257 = 5.55 knows
  nothing); ${tps} tokens/s
- ${mem}
- metrics: $out/metrics.jsonl, loss curve: $out/metrics.svg, log: $out/train.log
- sharded checkpoint: $out/ckpt (resume: add --load $out/ckpt, at any number of ranks;
  generate: build/mfsdp-generate --model $out/ckpt --prompt TEXT);
  Hugging Face export: $out/hf (config.json + model.safetensors, LlamaForCausalLM)
SUMMARY
