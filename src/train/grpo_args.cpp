// mfsdp-grpo's flags (docs/grpo.md "Flags"): verl's names on top of Megatron's, and the checks
// that need no data (parse) or the data-parallel size (validate).
#include "mfsdp/train/grpo.h"

#include <algorithm>

#include "mfsdp/checkpoint/tensor_source.h"
#include "mfsdp/data/posttrain/rewards.h"
#include "mfsdp/train/chat_eval.h"
#include "mfsdp/train/parallel_dims.h"
#include "train/tool_flags.h"

namespace mfsdp {

namespace {

// Sharded rollouts decode with the policy's own KV cache, which context parallelism has not; the
// full copy generates whole sequences and training takes each rank's chunks.
void refuse_sharded_context_parallel(const GrpoArgs& a) {
  if (a.base.context_parallel_size > 1 && a.rollout_mode == "sharded")
    flag_error("--rollout-mode", "sharded with --context-parallel-size " + std::to_string(a.base.context_parallel_size) +
                                     ": decoding with a KV cache cannot split the sequence; use --rollout-mode full");
  if (a.base.pipeline_model_parallel_size > 1 && a.rollout_mode == "sharded")
    flag_error("--rollout-mode", "sharded with --pipeline-model-parallel-size " +
                                     std::to_string(a.base.pipeline_model_parallel_size) +
                                     ": each token would cross every stage in turn; use --rollout-mode full (each "
                                     "rank generates from the whole model gathered over the stages)");
}

}  // namespace

ToolFlags grpo_tool_flags(GrpoArgs& a) {
  ToolFlags t;
  t.program = "mfsdp-grpo";
  // Not the pretraining corpus nor mfsdp-pretrain's own section; a step's batch is
  // --train-batch-size prompts x --rollout-n responses.
  t.sections = {Section::kModel,      Section::kMoe,       Section::kTokenizer, Section::kTraining, Section::kOptimizer,
                Section::kCheckpoint, Section::kParallel, Section::kFsdp,      Section::kRuntime,  Section::kLogging,
                Section::kProfiling};
  t.replaced = {{"--global-batch-size", "a step trains on --train-batch-size prompts x --rollout-n responses"}};
  t.extra_title = "GRPO: prompts, rollouts, rewards and the policy loss";
  t.extra = task_source_flags(a.data, "prompts",
                              "verl's {\"prompt\": [{\"role\", \"content\"}], \"reward_model\": "
                              "{\"ground_truth\"}, \"data_source\"} per line");
  const std::vector<ToolFlag> own = {
      string_flag("--reward", a.reward, "rule reward (auto: by each prompt's data_source)", reward_names()),
      string_flag("--chat-template", a.chat_template,
                  "conversation format (auto: the one the tokenizer's special tokens call for; docs/data.md)",
                  chat_template_choices()),
      int_flag("--max-prompt-length", a.max_prompt_length, "longest prompt in tokens (verl data.max_prompt_length)"),
      int_flag("--max-response-length", a.max_response_length, "longest response in tokens"),
      string_flag("--truncation", a.truncation, "a longer prompt is an error, or loses its start (left) or end (right)",
                  {"error", "left", "right"}),
      int_flag("--train-batch-size", a.train_batch_size, "prompts per step (verl data.train_batch_size)"),
      int_flag("--rollout-n", a.rollout_n, "responses sampled per prompt (a group)"),
      double_flag("--temperature", a.temperature, "sampling temperature of the rollout"),
      int_flag("--top-k", a.top_k, "rollout top-k (-1: off)"),
      double_flag("--top-p", a.top_p, "rollout nucleus mass (1: off)"),
      string_flag("--rollout-mode", a.rollout_mode,
                  "full: each rank gathers the whole policy (full_state_dict), generates its prompts and frees it; "
                  "sharded: generate through the shards in lock-step (models that do not fit on one rank)",
                  {"full", "sharded"}),
      string_flag("--scale-rewards", a.scale_rewards,
                  "advantage = (reward - group mean) / std of the group, of the batch, or none (Dr. GRPO)",
                  {"group", "batch", "none"}),
      int_flag("--ppo-epochs", a.ppo_epochs, "passes over each step's responses"),
      int_flag("--ppo-mini-batch-size", a.ppo_mini_batch_size,
               "prompts per optimizer step (their --rollout-n responses each; 0: --train-batch-size)"),
      double_flag("--clip-ratio-low", a.clip_ratio_low, "ratio clip below 1"),
      double_flag("--clip-ratio-high", a.clip_ratio_high, "ratio clip above 1"),
      double_flag("--clip-ratio-c", a.clip_ratio_c, "dual clip of negative advantages (<= 1: off)"),
      string_flag("--loss-agg-mode", a.loss_agg_mode, "how token losses become the loss (verl's agg_loss)",
                  {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"}),
      bool_flag("--use-kl-loss", a.use_kl_loss, "add a KL loss to a frozen reference policy (sharded, forward only)"),
      double_flag("--kl-loss-coef", a.kl_loss_coef, "weight of the KL loss"),
      string_flag("--kl-loss-type", a.kl_loss_type, "KL estimator (low_var_kl is k3)",
                  {"k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl", "k3+", "low_var_kl+"}),
      double_flag("--entropy-coeff", a.entropy_coeff, "weight of the entropy bonus"),
      bool_flag("--mask-truncated-completions", a.mask_truncated_completions,
                "responses cut at --max-response-length get no loss"),
      string_flag("--hf-load", a.hf_load, "start from this Hugging Face model folder"),
      string_flag("--ref-load", a.ref_load,
                  "the reference policy: a checkpoint or Hugging Face folder (default: where training started, "
                  "--hf-load or the --load checkpoint with --finetune)"),
      int_flag("--val-generate-samples", a.val_generate_samples, "held-out prompts scored greedily (0: none)"),
  };
  t.extra.insert(t.extra.end(), own.begin(), own.end());
  return t;
}

GrpoArgs parse_grpo_args(const std::vector<std::string>& argv) {
  GrpoArgs a;
  a.base = parse_pretrain_args(argv, grpo_tool_flags(a));
  auto positive = [](const char* flag, int64_t v) {
    if (v < 1) flag_error(flag, "must be >= 1, got " + std::to_string(v));
  };
  check_task_source(a.data);
  positive("--max-prompt-length", a.max_prompt_length);
  positive("--max-response-length", a.max_response_length);
  positive("--train-batch-size", a.train_batch_size);
  positive("--rollout-n", a.rollout_n);
  positive("--ppo-epochs", a.ppo_epochs);
  // Each step holds train_batch_size x rollout_n responses of up to max_response_length tokens;
  // the bounds are far past real runs (verl: 512 prompts x 16 responses, 32K tokens) and keep a
  // typo from allocating or looping for hours.
  auto at_most = [](const char* flag, int64_t v, int64_t max) {
    if (v > max) flag_error(flag, "must be at most " + std::to_string(max) + ", got " + std::to_string(v));
  };
  at_most("--max-prompt-length", a.max_prompt_length, kMaxSequenceLength);
  at_most("--max-response-length", a.max_response_length, kMaxSequenceLength);
  if (a.max_prompt_length + a.max_response_length > kMaxSequenceLength)
    flag_error("--max-response-length", "--max-prompt-length " + std::to_string(a.max_prompt_length) + " + " +
                                            std::to_string(a.max_response_length) + " tokens is more than " +
                                            std::to_string(kMaxSequenceLength));
  constexpr int64_t kMaxRolloutsPerStep = int64_t{1} << 20;
  at_most("--train-batch-size", a.train_batch_size, kMaxRolloutsPerStep);
  at_most("--rollout-n", a.rollout_n, kMaxRolloutsPerStep);
  if (a.train_batch_size * a.rollout_n > kMaxRolloutsPerStep)
    flag_error("--rollout-n", "--train-batch-size " + std::to_string(a.train_batch_size) + " x " +
                                  std::to_string(a.rollout_n) + " responses per step is more than " +
                                  std::to_string(kMaxRolloutsPerStep));
  if (a.ppo_epochs > 1024) flag_error("--ppo-epochs", "must be at most 1024, got " + std::to_string(a.ppo_epochs));
  if (a.ppo_mini_batch_size == 0) a.ppo_mini_batch_size = a.train_batch_size;
  if (a.ppo_mini_batch_size < 1 || a.train_batch_size % a.ppo_mini_batch_size != 0)
    flag_error("--ppo-mini-batch-size", std::to_string(a.ppo_mini_batch_size) + " does not divide --train-batch-size " +
                                            std::to_string(a.train_batch_size));
  if (!(a.temperature > 0)) flag_error("--temperature", "must be > 0");
  if (!(a.top_p > 0 && a.top_p <= 1)) flag_error("--top-p", "must be in (0, 1]");
  if (a.clip_ratio_low < 0 || a.clip_ratio_high < 0) flag_error("--clip-ratio-low", "clip ratios must be >= 0");
  if (a.val_generate_samples < 0) flag_error("--val-generate-samples", "must be >= 0");
  refuse_sharded_context_parallel(a);  // before the launcher: it needs flags only
  if (a.base.tensor_model_parallel_size > 1) {
    const std::string tp = "--tensor-model-parallel-size " + std::to_string(a.base.tensor_model_parallel_size);
    if (a.base.sequence_parallel && a.rollout_mode == "sharded")
      flag_error("--rollout-mode", "sharded with --sequence-parallel: decoding one token at a time cannot be split "
                                   "along the sequence; use --rollout-mode full");
  }
  if (!a.hf_load.empty() && a.base.finetune) flag_error("--finetune", "conflicts with --hf-load");
  if (!a.hf_load.empty() && !is_hf_folder(a.hf_load))
    flag_error("--hf-load", "'" + a.hf_load + "' is not a Hugging Face model folder (config.json and model.safetensors)");
  if (!a.ref_load.empty() && !is_hf_folder(a.ref_load)) {
    bool checkpoint = false;
    try {
      checkpoint = is_checkpoint(a.ref_load);
    } catch (const std::invalid_argument& e) {
      flag_error("--ref-load", e.what());
    }
    if (!checkpoint)
      flag_error("--ref-load", "'" + a.ref_load + "' is neither a checkpoint nor a Hugging Face model folder");
  }
  if (a.use_kl_loss && a.ref_load.empty() && a.hf_load.empty() && !a.base.finetune)
    flag_error("--use-kl-loss", "needs the reference policy: --ref-load, --hf-load, or --load with --finetune");
  a.base.seq_length = a.max_prompt_length + a.max_response_length;
  a.base.calculate_per_token_loss = true;
  a.base.load_requires_checkpoint = true;
  return a;
}

void validate_grpo_args(GrpoArgs& a, int world, int64_t tokenizer_vocab) {
  refuse_sharded_context_parallel(a);
  // Rows are as long as each micro-batch's longest: between pipeline stages every activation's
  // shape goes ahead of it (Megatron's --variable-seq-lengths).
  a.base.variable_seq_lengths = true;
  // The prompts split over the data-parallel replicas; a replica's tensor- and context-parallel
  // ranks share them.
  const int dp = parallel_dims(a.base, a.base, world).dp();
  if (a.train_batch_size % dp != 0)
    flag_error("--train-batch-size", std::to_string(a.train_batch_size) + " prompts do not split over " +
                                         std::to_string(dp) + " ranks");
  const int64_t sequences = a.ppo_mini_batch_size * a.rollout_n;
  if (sequences % (a.base.micro_batch_size * dp) != 0)
    flag_error("--ppo-mini-batch-size", std::to_string(a.ppo_mini_batch_size) + " prompts x --rollout-n " +
                                            std::to_string(a.rollout_n) + " responses is not a multiple of "
                                            "--micro-batch-size x ranks = " +
                                            std::to_string(a.base.micro_batch_size) + " x " + std::to_string(dp));
  a.base.global_batch_size = sequences;
  validate_training_args(a.base, world, tokenizer_vocab);
}

}  // namespace mfsdp
