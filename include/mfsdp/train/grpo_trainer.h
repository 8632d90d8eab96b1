// mfsdp-grpo's step as the stages verl's trainer runs (docs/grpo.md): rollout (this rank's
// prompts, --rollout-n sampled responses each), score (rule rewards, every rank's scores,
// group-normalised advantages), log_probs (the old policy's and the reference's, per
// micro-batch), update (--ppo-epochs passes, one optimizer step per mini-batch), record (metrics
// and the log line). run_grpo (grpo.h) is the loop over them; tests/dist/grpo_stages_test.cpp
// drives them one by one. A GrpoStep carries what one stage hands the next.
// Implemented in src/train/grpo.cpp (with run_grpo); the flags in src/train/grpo_args.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "mfsdp/data/posttrain/chat_dataset.h"
#include "mfsdp/data/tokenizer.h"
#include "mfsdp/models/batched_generate.h"
#include "mfsdp/train/policy_loss.h"
#include "mfsdp/train/chat_eval.h"
#include "mfsdp/train/grpo.h"
#include "mfsdp/train/sft_data.h"
#include "mfsdp/train/training_run.h"

namespace mfsdp {

// One response of the step.
struct Rollout {
  int64_t prompt = 0;  // index in the step's batch (global)
  std::vector<int64_t> prompt_ids;
  std::vector<int64_t> response_ids;
  std::vector<float> rollout_log_probs;  // the sampler's, one per response token
  bool truncated = false;
  double score = 0;
};

// Responses of this rank as training rows: prompt then response, right-padded; the loss mask
// covers the response (all of it, the stop token included), none of it for a truncated one with
// --mask-truncated-completions.
struct RolloutBatch {
  at::Tensor input_ids;          // [B, L]
  at::Tensor labels;             // [B, L] next token
  at::Tensor mask;               // [B, L] float: labels that are trained response tokens
  at::Tensor attention_mask;     // [B, L]
  at::Tensor advantages;         // [B]
  at::Tensor response;           // [B, L] float: labels that are response tokens, trained or not
  at::Tensor rollout_log_probs;  // [B, L] the rollout's log-probs of those labels (0 elsewhere)
  // Under context parallelism the [B, L] tensors hold this rank's chunks of every row (L / CP
  // positions), and this [B] each whole row's trained tokens (seq-mean-token-mean's count).
  at::Tensor row_tokens;
};

// What a step's stages hand each other.
struct GrpoStep {
  int64_t iteration = 0;
  std::chrono::steady_clock::time_point started;
  // rollout
  std::vector<int64_t> batch;     // the step's prompts: rows of the training set
  std::vector<Rollout> rollouts;  // this rank's: --rollout-n per prompt, prompt-major
  // score
  at::Tensor scores;      // [train_batch_size x rollout_n] fp64, every rank's
  at::Tensor advantages;  // [this rank's rollouts] fp32
  double response_tokens = 0;  // over every rank
  // log_probs
  std::vector<RolloutBatch> micro;  // this rank's micro-batches
  std::vector<at::Tensor> old_log_probs, ref_log_probs;  // per micro-batch, [B, L] fp32
  // update
  TrainingRun::StepStats last_stats;  // of the last optimizer step
  double grad_norm = 0;               // mean over the optimizer steps
  double lr = 0;
  // Seconds each stage took (verl's timing_s/*).
  double gen_s = 0, update_weights_s = 0, old_log_prob_s = 0, ref_s = 0, update_s = 0;
  // verl's metric names and values, in the order the stages add them.
  std::vector<std::pair<std::string, double>> metrics;
  double metric(const std::string& name) const;  // NaN when absent
};

class GrpoTrainer {
 public:
  // Everything before the first step: tokenizer, prompts, the starting point (--load, --hf-load
  // or the flags), the sharded policy and optimizer, the reference policy with --use-kl-loss.
  GrpoTrainer(GrpoArgs args, std::shared_ptr<Communicator> comm, std::ostream& log);
  ~GrpoTrainer();

  GrpoStep rollout(int64_t iteration);
  void score(GrpoStep& step);
  void log_probs(GrpoStep& step);
  void update(GrpoStep& step);
  void record(GrpoStep& step);  // into the metrics file (every step)
  void print(const GrpoStep& step) const;  // the log line (at log steps)
  // Greedy accuracy on the validation prompts, logged and recorded; -1 without them.
  double validate(int64_t iteration);
  // Validation, then the loop over the stages (train_loop.h), the curve.
  GrpoResult train();

  TrainingRun& run() { return *run_; }
  int64_t resume_iteration() const { return resume_iteration_; }

 private:
  struct ReferencePolicy;

  GrpoArgs g_;
  std::shared_ptr<Communicator> comm_;
  std::ostream& log_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::string chat_template_;
  int64_t end_of_turn_ = 0, pad_ = 0;
  LossAggMode agg_;
  ScaleRewards scale_;
  KlType kl_type_;
  std::vector<RlExample> train_, val_;
  std::vector<std::vector<int64_t>> train_prompts_;  // chat-formatted, truncated as asked
  std::unique_ptr<TrainingRun> run_;
  std::unique_ptr<ReferencePolicy> ref_;
  int64_t resume_iteration_ = 0;
  std::unique_ptr<SftSampler> sampler_;
  ChatEvalOptions eval_options_;
  SamplingOptions sampling_;
  int64_t prompts_per_rank_ = 0, local_sequences_ = 0, mini_batches_ = 0, local_per_mini_ = 0;
  // This rank's data-parallel replica (its prompts) and the ranks whose sums make the batch's:
  // the data- and context-parallel ranks of its tensor-parallel coordinate (the world without TP).
  int dp_rank_ = 0;
  std::shared_ptr<Communicator> replicas_;
  std::shared_ptr<Communicator> data_replicas_;     // one rank per replica: the rollouts' sums
  std::shared_ptr<Communicator> context_parallel_;  // null without: a rank trains on its chunks of every row
  int64_t length_multiple_ = 1;  // rows padded to a multiple of it (sequence and context parallelism)
};

}  // namespace mfsdp
