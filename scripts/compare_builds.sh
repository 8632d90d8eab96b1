#!/usr/bin/env bash
# Are two builds numerically the same? Trains the same small model with OLD and NEW (mock data
# for mfsdp-pretrain; generated arithmetic conversations for mfsdp-sft and mfsdp-grpo) for every
# sharding strategy x {fp32, --bf16, --bf16 --grad-reduce-in-bf16} and compares the logged
# losses and grad norms (GRPO: its scores, losses, entropies and grad norms; --entropy-coeff gives
# its tiny untrained policy a gradient) bit for bit.
#
#   scripts/compare_builds.sh OLD_BUILD_DIR NEW_BUILD_DIR [extra flags for NEW only]
#   # e.g. a refactor against its parent, with the parent's attention path:
#   git worktree add /tmp/old HEAD~1 && (cd /tmp/old && ln -s "$PWD/.venv" . && scripts/build.sh)
#   scripts/compare_builds.sh /tmp/old/build build --attention-backend unfused
#   # a layout, for both builds, on 4 ranks, SFT:
#   TOOL=sft NPROC=4 LAYOUT="--tensor-model-parallel-size 2 --context-parallel-size 2" scripts/compare_builds.sh OLD NEW
#
# Environment: TOOL [pretrain] (pretrain, sft or grpo), NPROC [2] ranks, LAYOUT [] flags given to
# both builds, STRATEGIES [no_shard optim optim_grads optim_grads_params].
# Prints one line per configuration ("identical" or "DIFFERENT" with both series); exit 1 when any
# differs, 2 on bad usage. MFSDP_SHM=0 in the environment compares the TCP path.
set -u
(($# >= 2)) || { echo "usage: scripts/compare_builds.sh OLD_BUILD_DIR NEW_BUILD_DIR [NEW flags...]" >&2; exit 2; }
old=$1 new=$2
shift 2
tool=${TOOL:-pretrain} nproc=${NPROC:-2}
# shellcheck disable=SC2206  # word splitting of the layout flags is intended
layout=(${LAYOUT:-})
strategies=${STRATEGIES:-no_shard optim optim_grads optim_grads_params}
for b in "$old" "$new"; do
  [[ -x $b/mfsdp-$tool && -x $b/mfsdp-run ]] || { echo "compare_builds: $b has no mfsdp-$tool/mfsdp-run" >&2; exit 2; }
done
common=(--device cpu --num-layers 2 --hidden-size 32 --num-attention-heads 4 --group-query-attention
        --num-query-groups 2 --swiglu --ffn-hidden-size 48 --train-iters 8 --lr 3e-3 --lr-warmup-iters 2
        --lr-decay-style cosine --min-lr 3e-4 --clip-grad 1.0 --log-interval 1 --eval-interval 1000 --seed 7)
case $tool in
  pretrain)
    model=(--mock-data --vocab-size 64 --make-vocab-size-divisible-by 64 --seq-length 16 --micro-batch-size 2
           --global-batch-size 8 --eval-iters 1 "${common[@]}") ;;
  sft)
    model=(--tokenizer-type ByteLevelTokenizer --make-vocab-size-divisible-by 1 --gen-task arith
           --gen-train-size 64 --gen-val-size 0 --max-length 48 --micro-batch-size 1 --global-batch-size 8
           "${common[@]}") ;;
  grpo)
    model=(--tokenizer-type ByteLevelTokenizer --make-vocab-size-divisible-by 1 --gen-task arith
           --gen-train-size 64 --gen-val-size 0 --max-prompt-length 32 --max-response-length 8
           --train-batch-size 4 --rollout-n 4 --micro-batch-size 2 --entropy-coeff 0.01 "${common[@]}") ;;
  *) echo "compare_builds: TOOL=$tool: expected pretrain, sft or grpo" >&2; exit 2 ;;
esac
tmp=$(mktemp -d "${TMPDIR:-/tmp}/compare_builds.XXXXXX")
series() {  # losses and grad norms (GRPO: score, pg_loss, entropy, grad norm) of a metrics file, exactly as logged
  python3 -c '
import json, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if not r.get("eval")]
keys = ("critic/score/mean", "actor/pg_loss", "actor/entropy", "grad_norm") if sys.argv[2] == "grpo" else ("lm_loss", "grad_norm")
print([tuple(r.get(k, r.get("extra", {}).get(k)) for k in keys) for r in rows])' "$1" "$tool"
}
status=0
for strategy in $strategies; do
  for precision in "" "--bf16" "--bf16 --grad-reduce-in-bf16"; do
    # shellcheck disable=SC2086  # $precision is a list of flags
    "$old/mfsdp-run" --nproc-per-node "$nproc" "$old/mfsdp-$tool" "${model[@]}" "${layout[@]}" \
      --data-parallel-sharding-strategy $strategy $precision --metrics-file "$tmp/old.jsonl" > "$tmp/old.log" 2>&1 ||
      { echo "OLD failed: $strategy $precision"; tail -3 "$tmp/old.log"; status=1; continue; }
    # shellcheck disable=SC2086
    "$new/mfsdp-run" --nproc-per-node "$nproc" "$new/mfsdp-$tool" "$@" "${model[@]}" "${layout[@]}" \
      --data-parallel-sharding-strategy $strategy $precision --metrics-file "$tmp/new.jsonl" > "$tmp/new.log" 2>&1 ||
      { echo "NEW failed: $strategy $precision"; tail -3 "$tmp/new.log"; status=1; continue; }
    a=$(series "$tmp/old.jsonl") b=$(series "$tmp/new.jsonl")
    if [[ $a == "$b" ]]; then
      echo "identical: $tool ${LAYOUT:-} $strategy ${precision:-fp32} (8 iterations, first ${a:2:40})"
    else
      printf 'DIFFERENT: %s %s %s %s\n  old %s\n  new %s\n' "$tool" "${LAYOUT:-}" "$strategy" "${precision:-fp32}" "$a" "$b"
      status=1
    fi
  done
done
rm -rf "$tmp"
exit $status
