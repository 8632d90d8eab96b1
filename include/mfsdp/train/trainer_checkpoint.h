// mfsdp-pretrain's --save / --load: what the trainer records in a checkpoint (arguments, model
// config, LR schedule, progress) and the rules for resuming from one (docs/checkpoints.md).
#pragma once

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>

#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/comm/comm.h"
#include "mfsdp/fsdp/fully_shard.h"
#include "mfsdp/models/causal_lm.h"
#include "mfsdp/models/model_spec.h"
#include "mfsdp/optim/optim.h"
#include "mfsdp/train/config/sections.h"
#include "mfsdp/train/pretrain_args.h"

namespace mfsdp {

// Where each of this rank's parameters of `model` (sharded as `root`) lies in the whole tensor
// a checkpoint or a Hugging Face folder holds, under tensor parallelism
// (CausalLM::tensor_parallel_split): split ones at their rank's rows or columns, replicated ones
// written by tensor-parallel rank 0 only. Under pipeline parallelism the last stage's copy of a
// tied embedding (CausalLM::embedding_copy) is read like the first stage's and never written.
// Empty without either.
TensorSlices model_parallel_checkpoint_slices(const CausalLM& model, const FsdpHandle& root);

struct ResumePoint {
  int64_t iteration = 0;         // the last completed iteration
  int64_t consumed_samples = 0;  // training samples consumed before it
};

// What --load (at --ckpt-step) names, resolved once by locate_checkpoint and opened once: the
// one reader that the model config (SFT/GRPO's starting point), load_training_checkpoint and
// GRPO's reference policy (when it is the same checkpoint) all read, so a load parses the
// checkpoint's metadata once per rank.
struct OpenedCheckpoint {
  std::shared_ptr<const CheckpointReader> reader;  // null: --load is unset or holds no checkpoint
  std::string missing;  // --load set but no checkpoint there: why ("does not exist", "holds no
                        // checkpoint (...)"), for the caller's warning or error
  // --non-persistent-ckpt-type global: `reader` is the non-persistent checkpoint when it is newer
  // than --load's own, which is then `fallback` (loaded instead, with a warning, if the
  // non-persistent one fails to load); `origin` says which was taken and why, for the log.
  std::shared_ptr<const CheckpointReader> fallback;
  std::string origin;
};
// With --non-persistent-ckpt-type global (and no --ckpt-step) the newer of --load's latest and
// the non-persistent folder's latest is opened.
// Throws std::invalid_argument "--load: ..." ("--load / --ckpt-step: ..." with a step) for a
// path that cannot be meant (locate_checkpoint), and CheckpointReader's error, naming the file,
// for a checkpoint whose metadata is unreadable. Not collective: every rank opens the same
// shared folder and so decides alike.
OpenedCheckpoint open_training_checkpoint(const CheckpointSection& checkpoint);

// --load: restores the model, and unless --finetune / --no-load-optim / --no-load-rng the
// optimizer, the generators and the progress, all from `opened` (open_training_checkpoint of
// the same `checkpoint` section). A folder with no checkpoint yet starts from scratch (a notice,
// as Megatron does); without --load it does nothing. Errors name the flag or checkpoint field at
// fault: a model config that differs from the flags, a different global batch size
// (training.global_batch_size), an LR schedule that differs (unless
// --override-opt_param-scheduler or --use-checkpoint-opt_param-scheduler, which sets `schedule`
// from the checkpoint). Collective.
ResumePoint load_training_checkpoint(const OpenedCheckpoint& opened, const CheckpointSection& checkpoint,
                                     const TrainingSection& training, const ModelConfig& config,
                                     const std::shared_ptr<Communicator>& world, FsdpHandle& model,
                                     DistributedOptimizer& optimizer, LRSchedule& schedule, std::ostream& log,
                                     const TensorSlices& slices = {});
// --save: the checkpoint of `iteration`. Collective. With --async-save it first commits the
// save in flight (waiting for its writers), then stages this one and returns while writer threads
// write it; the save of the run's last iteration (--train-iters, or an --exit-interval stop) is
// waited for and committed before returning, since the process ends after it.
void save_training_checkpoint(const PretrainArgs& args, const ModelConfig& config,
                              const std::shared_ptr<Communicator>& world, const FsdpHandle& model,
                              const DistributedOptimizer& optimizer, const LRSchedule& schedule,
                              int64_t iteration, std::ostream& log, const ToolFlags& tool = {},
                              const TensorSlices& slices = {});

// The LR schedule as a checkpoint records it, and Megatron's rule on resuming: the schedule flags
// must match the checkpoint's (`saved`, from the checkpoint at `where`) unless
// --override-opt_param-scheduler (this run's wins) or --use-checkpoint-opt_param-scheduler (the
// checkpoint's, into `schedule`). Throws std::invalid_argument naming the field.
nlohmann::json lr_schedule_json(const LRSchedule& schedule);
void reconcile_schedule(const CheckpointSection& checkpoint, const nlohmann::json& saved, LRSchedule& schedule,
                        const std::string& where);

// --non-persistent-save-interval with --non-persistent-ckpt-type global: the checkpoint of
// `iteration` into the non-persistent folder (the same format and rules as save_training_checkpoint,
// --async-save included), then every other iteration there removed: only the newest is kept.
// Collective.
void save_non_persistent_global_checkpoint(const PretrainArgs& args, const ModelConfig& config,
                                           const std::shared_ptr<Communicator>& world, const FsdpHandle& model,
                                           const DistributedOptimizer& optimizer, const LRSchedule& schedule,
                                           int64_t iteration, std::ostream& log, const ToolFlags& tool = {},
                                           const TensorSlices& slices = {});
// The folder global non-persistent checkpoints go to (`base`: --save when saving, --load when
// loading): --non-persistent-global-ckpt-dir, or Megatron's <base>/non_persistent.
std::string non_persistent_global_dir(const CheckpointSection& checkpoint, const std::string& base);

// --async-save: commits the save in flight, waiting for its writers (a write that failed on any
// rank throws here, naming the rank and the file). Call before the process exits. Collective;
// does nothing without a save in flight.
void finish_training_checkpoints(const std::shared_ptr<Communicator>& world, std::ostream& log);

// --async-save, once per iteration: commits the save in flight if every rank's writer is done
// (one small all-reduce, so every rank decides alike; Megatron's maybe_finalize_async_save).
// Collective; does nothing without a save in flight.
void poll_training_checkpoints(const std::shared_ptr<Communicator>& world, std::ostream& log);

}  // namespace mfsdp
