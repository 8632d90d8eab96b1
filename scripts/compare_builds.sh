#!/usr/bin/env bash
# Are two builds numerically the same? Trains the same small model with mfsdp-pretrain of OLD and
# NEW (2 ranks, mock data, 8 iterations) for every sharding strategy x {fp32, --bf16,
# --bf16 --grad-reduce-in-bf16} and compares the logged losses and grad norms bit for bit.
#
#   scripts/compare_builds.sh OLD_BUILD_DIR NEW_BUILD_DIR [extra flags for NEW only]
#   # e.g. a refactor against its parent, with the parent's attention path:
#   git worktree add /tmp/old HEAD~1 && (cd /tmp/old && ln -s "$PWD/.venv" . && scripts/build.sh)
#   scripts/compare_builds.sh /tmp/old/build build --attention-backend unfused
#
# Prints one line per configuration ("identical" or "DIFFERENT" with both series); exit 1 when any
# differs, 2 on bad usage. MFSDP_SHM=0 in the environment compares the TCP path.
set -u
(($# >= 2)) || { echo "usage: scripts/compare_builds.sh OLD_BUILD_DIR NEW_BUILD_DIR [NEW flags...]" >&2; exit 2; }
old=$1 new=$2
shift 2
for b in "$old" "$new"; do
  [[ -x $b/mfsdp-pretrain && -x $b/mfsdp-run ]] || { echo "compare_builds: $b has no mfsdp-pretrain/mfsdp-run" >&2; exit 2; }
done
model=(--mock-data --vocab-size 64 --make-vocab-size-divisible-by 64 --num-layers 2 --hidden-size 32
       --num-attention-heads 4 --group-query-attention --num-query-groups 2 --swiglu --ffn-hidden-size 48
       --seq-length 16 --micro-batch-size 2 --global-batch-size 8 --train-iters 8 --lr 3e-3
       --lr-warmup-iters 2 --lr-decay-style cosine --min-lr 3e-4 --clip-grad 1.0 --log-interval 1
       --eval-interval 1000 --eval-iters 1 --seed 7)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/compare_builds.XXXXXX")
series() {  # losses and grad norms of a metrics file, exactly as logged
  python3 -c 'import json,sys; print([(r["lm_loss"], r["grad_norm"]) for r in map(json.loads, open(sys.argv[1])) if "eval" not in r])' "$1"
}
status=0
for strategy in no_shard optim optim_grads optim_grads_params; do
  for precision in "" "--bf16" "--bf16 --grad-reduce-in-bf16"; do
    # shellcheck disable=SC2086  # $precision is a list of flags
    "$old/mfsdp-run" --nproc-per-node 2 "$old/mfsdp-pretrain" "${model[@]}" \
      --data-parallel-sharding-strategy $strategy $precision --metrics-file "$tmp/old.jsonl" > "$tmp/old.log" 2>&1 ||
      { echo "OLD failed: $strategy $precision"; tail -3 "$tmp/old.log"; status=1; continue; }
    # shellcheck disable=SC2086
    "$new/mfsdp-run" --nproc-per-node 2 "$new/mfsdp-pretrain" "$@" "${model[@]}" \
      --data-parallel-sharding-strategy $strategy $precision --metrics-file "$tmp/new.jsonl" > "$tmp/new.log" 2>&1 ||
      { echo "NEW failed: $strategy $precision"; tail -3 "$tmp/new.log"; status=1; continue; }
    a=$(series "$tmp/old.jsonl") b=$(series "$tmp/new.jsonl")
    if [[ $a == "$b" ]]; then
      echo "identical: $strategy ${precision:-fp32} (8 iterations, first loss ${a:2:18})"
    else
      printf 'DIFFERENT: %s %s\n  old %s\n  new %s\n' "$strategy" "${precision:-fp32}" "$a" "$b"
      status=1
    fi
  done
done
rm -rf "$tmp"
exit $status
