// mfsdp-grpo: Group Relative Policy Optimization on the sharded runtime (docs/grpo.md), with
// verl's algorithm and names: per step, --train-batch-size prompts x --rollout-n sampled
// responses, rule rewards, group-normalised advantages, the clipped ratio loss over
// --ppo-epochs x mini-batches, an optional KL loss to a frozen, sharded reference policy.
#pragma once

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>

#include "mfsdp/comm/comm.h"
#include "mfsdp/train/pretrain_args.h"
#include "mfsdp/train/task_source.h"

namespace mfsdp {

struct GrpoArgs {
  PretrainArgs base;  // --seq-length is --max-prompt-length + --max-response-length here
  // Data: verl's RL JSONL, or generated verifiable tasks.
  TaskSource data;
  std::string reward = "auto";    // auto: by data_source
  std::string chat_template = "auto";
  int64_t max_prompt_length = 64;
  int64_t max_response_length = 32;
  std::string truncation = "error";  // over-long prompts
  // Rollout.
  int64_t train_batch_size = 8;  // prompts per step
  int64_t rollout_n = 4;         // responses per prompt
  double temperature = 1.0;
  int64_t top_k = -1;
  double top_p = 1.0;
  std::string rollout_mode = "full";  // full: a gathered copy per rank; sharded: lock-step through the shards
  // Actor update.
  std::string scale_rewards = "group";
  int64_t ppo_epochs = 1;
  int64_t ppo_mini_batch_size = 0;  // prompts per optimizer step (0: --train-batch-size)
  double clip_ratio_low = 0.2;
  double clip_ratio_high = 0.2;
  double clip_ratio_c = 3.0;
  std::string loss_agg_mode = "token-mean";
  bool use_kl_loss = false;
  double kl_loss_coef = 0.001;
  std::string kl_loss_type = "low_var_kl";
  double entropy_coeff = 0.0;
  bool mask_truncated_completions = false;
  std::string hf_load;
  std::string ref_load;  // the reference policy (default: the starting point)
  int64_t val_generate_samples = 200;
};

ToolFlags grpo_tool_flags(GrpoArgs& args);
// Parses and checks what needs no data or communicator. Throws std::invalid_argument naming the flag.
GrpoArgs parse_grpo_args(const std::vector<std::string>& argv);
// Checks what needs the number of ranks (--train-batch-size and --ppo-mini-batch-size against
// --micro-batch-size x data-parallel ranks, the world over --tensor-model-parallel-size) and sets
// base.global_batch_size (sequences per optimizer step), then validate_training_args.
void validate_grpo_args(GrpoArgs& args, int world_size, int64_t tokenizer_vocab);

struct GrpoResult {
  double val_score_before = -1;  // -1: no validation set
  double val_score_after = -1;
  double last_score_mean = 0;
  int64_t iterations = 0;
};

GrpoResult run_grpo(GrpoArgs args, const std::shared_ptr<Communicator>& comm, std::ostream& log);

}  // namespace mfsdp
