# shellcheck shell=bash
# Sourced by bench/cpu_step_time.sh and bench/gpu_step_time.sh (not run on its own): checks the
# model and batch settings both take from the environment (LAYERS HIDDEN FFN HEADS QUERY_GROUPS
# SEQ MBS GBS VOCAB VOCAB_DIVISIBLE UNTIE ITERS WARMUP LR NPROC THREADS ROUNDS, set by the caller)
# and the binaries, and builds the flags of that model:
#   MODEL_ARGS  mfsdp-pretrain's model, batch and schedule flags
#   TORCH_ARGS  bench/torch_llama.py's flags for the same model and batch
# The caller defines die() (message, exit 2) and sets BUILD and PYTHON first.

check_step_time_settings() {
  local v
  for v in LAYERS HIDDEN FFN HEADS QUERY_GROUPS SEQ MBS GBS VOCAB VOCAB_DIVISIBLE ITERS NPROC THREADS ROUNDS; do
    [[ ${!v} =~ ^[1-9][0-9]*$ ]] || die "$v=${!v}: expected a positive integer"
  done
  if ! [[ $WARMUP =~ ^[0-9]+$ ]] || ((WARMUP >= ITERS)); then
    die "WARMUP=$WARMUP: expected 0 <= WARMUP < ITERS ($ITERS)"
  fi
  ((GBS % (MBS * NPROC) == 0)) || die "GBS=$GBS must be a multiple of MBS x NPROC = $((MBS * NPROC))"
  ((QUERY_GROUPS > HEADS)) && die "QUERY_GROUPS=$QUERY_GROUPS exceeds HEADS=$HEADS"
  local exe
  for exe in mfsdp-run mfsdp-pretrain; do
    [[ -x $BUILD/$exe ]] || die "$BUILD/$exe not found: build first (scripts/build.sh)"
  done
  command -v "$PYTHON" >/dev/null || die "PYTHON=$PYTHON not found (it also parses the metrics)"

  MODEL_ARGS=(--num-layers "$LAYERS" --hidden-size "$HIDDEN" --ffn-hidden-size "$FFN"
              --num-attention-heads "$HEADS" --swiglu --seq-length "$SEQ"
              --micro-batch-size "$MBS" --global-batch-size "$GBS" --vocab-size "$VOCAB"
              --make-vocab-size-divisible-by "$VOCAB_DIVISIBLE" --train-iters "$ITERS" --lr "$LR")
  ((QUERY_GROUPS < HEADS)) && MODEL_ARGS+=(--group-query-attention --num-query-groups "$QUERY_GROUPS")
  ((UNTIE)) && MODEL_ARGS+=(--untie-embeddings-and-output-weights)
  TORCH_ARGS=(--num-layers "$LAYERS" --hidden-size "$HIDDEN" --ffn-hidden-size "$FFN"
              --num-attention-heads "$HEADS" --num-query-groups "$QUERY_GROUPS" --seq-length "$SEQ"
              --micro-batch-size "$MBS" --global-batch-size "$GBS" --vocab-size "$VOCAB"
              --make-vocab-size-divisible-by "$VOCAB_DIVISIBLE" --train-iters "$ITERS"
              --warmup-iters "$WARMUP" --lr "$LR" --nproc "$NPROC" --threads "$THREADS")
  ((UNTIE)) && TORCH_ARGS+=(--untie)
  return 0
}

# OUT, or a new temporary folder named after `name` when OUT is empty.
step_time_out_dir() {  # name
  if [[ -z $OUT ]]; then
    OUT=$(mktemp -d "${TMPDIR:-/tmp}/$1.XXXXXX") || die "mktemp failed"
  else
    mkdir -p "$OUT" || die "cannot create OUT=$OUT"
  fi
}
