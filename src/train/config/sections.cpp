// Each section's own checks (src/train/config/sections.h). The messages name the flag, as
// Megatron's argparse errors do, and each check says why the value cannot train.
#include "train/config/sections.h"

#include <unistd.h>

#include <filesystem>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <tuple>

#include "mfsdp/models/model_spec.h"

namespace mfsdp {
namespace {

std::string number(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

void at_least(const char* flag, double v, double min) {
  if (!(v >= min)) flag_error(flag, "must be >= " + number(min) + ", got " + number(v));
}

void positive(const char* flag, int64_t v) {
  if (v < 1) flag_error(flag, "must be >= 1, got " + std::to_string(v));
}

void at_most(const char* flag, int64_t v, int64_t max) {
  if (v > max) flag_error(flag, "must be at most " + std::to_string(max) + ", got " + std::to_string(v));
}

// Learning rates and the like become fp32 scalars of the optimizer's kernels.
void fits_fp32(const char* flag, double v) {
  if (v > std::numeric_limits<float>::max())
    flag_error(flag, number(v) + " is beyond fp32's range (at most " + number(std::numeric_limits<float>::max()) + ")");
}

// Where the run will write `path` (a folder with `folder`, else a file): what exists of it must
// be of that kind, and its nearest existing folder writable, so that a run does not train for
// hours and then fail to save. Checks only: nothing is created here.
void check_output_path(const char* flag, const std::string& path, bool folder) {
  if (path.empty()) return;
  namespace fs = std::filesystem;
  std::error_code ec;  // the error_code forms: a path we may not look into is "not there"
  const fs::path p = fs::absolute(path, ec);
  if (ec) flag_error(flag, "'" + path + "': " + ec.message());
  if (folder && fs::exists(p, ec) && !fs::is_directory(p, ec))
    flag_error(flag, "'" + path + "' exists and is not a folder");
  if (!folder && fs::is_directory(p, ec)) flag_error(flag, "'" + path + "' is a folder, not a file");
  fs::path existing = folder ? p : p.parent_path();
  while (!existing.empty() && existing != existing.root_path() && !fs::exists(existing, ec))
    existing = existing.parent_path();
  if (!fs::is_directory(existing, ec))
    flag_error(flag, "cannot create '" + path + "': '" + existing.string() + "' is not a folder");
  if (access(existing.c_str(), W_OK | X_OK) != 0)
    flag_error(flag, "cannot write '" + path + "': the folder '" + existing.string() + "' is not writable");
}

}  // namespace

void flag_error(const std::string& flag, const std::string& what) {
  throw std::invalid_argument(flag + ": " + what);
}

const char* section_title(Section s) {
  switch (s) {
    case Section::kModel: return "model: the transformer (Megatron's network size arguments)";
    case Section::kMoe: return "mixture of experts (Megatron's MoE arguments; inert without --num-experts)";
    case Section::kTokenizer: return "tokenizer";
    case Section::kData: return "data: the pretraining corpus";
    case Section::kTraining: return "training: batches, iterations, precision";
    case Section::kOptimizer: return "optimizer and learning-rate schedule";
    case Section::kCheckpoint: return "checkpoints";
    case Section::kFsdp: return "Megatron-FSDP and the distributed optimizer";
    case Section::kRuntime: return "runtime: device, collectives, host memory, attention kernels";
    case Section::kLogging: return "logging and evaluation";
    case Section::kProfiling: return "profiling";
    case Section::kPretraining: return "mfsdp-pretrain only: loss normalisation, samples, simulated scale";
  }
  return "?";
}

const std::vector<Section>& all_sections() {
  static const std::vector<Section> all = {Section::kModel,      Section::kMoe,       Section::kTokenizer, Section::kData,
                                           Section::kTraining,   Section::kOptimizer, Section::kCheckpoint,
                                           Section::kFsdp,       Section::kRuntime,   Section::kLogging,
                                           Section::kProfiling,  Section::kPretraining};
  return all;
}

std::vector<int64_t> MoeSection::moe_layer_pattern() const {
  const std::string& f = moe_layer_freq;
  if (!f.empty() && f.front() == '[' && f.back() == ']') {
    std::vector<int64_t> out;
    std::stringstream in(f.substr(1, f.size() - 2));
    for (std::string item; std::getline(in, item, ',');) {
      const size_t a = item.find_first_not_of(' '), b = item.find_last_not_of(' ');
      const std::string v = a == std::string::npos ? "" : item.substr(a, b - a + 1);
      if (v != "0" && v != "1") flag_error("--moe-layer-freq", "a list holds 0 (dense) or 1 (MoE) per layer, found '" + v + "'");
      out.push_back(v == "1");
    }
    return out;
  }
  size_t used = 0;
  long long n = 0;
  try {
    n = std::stoll(f, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != f.size() || f.empty() || n <= 0)
    flag_error("--moe-layer-freq", "expected a positive integer or a list such as [1,0,1,0], got '" + f + "'");
  return {n};
}

void MoeSection::validate(int64_t num_layers) const {
  if (num_experts < 0) flag_error("--num-experts", "must be >= 0, got " + std::to_string(num_experts));
  if (expert_model_parallel_size < 1)
    flag_error("--expert-model-parallel-size", "must be >= 1, got " + std::to_string(expert_model_parallel_size));
  // Without --num-experts the model may still have experts (mfsdp-sft and mfsdp-grpo take the
  // model of --load or --hf-load): build_sharded_model checks --expert-model-parallel-size there.
  if (num_experts == 0) return;
  if (moe_router_topk < 1 || moe_router_topk > num_experts)
    flag_error("--moe-router-topk", "must be 1 .. --num-experts " + std::to_string(num_experts) + ", got " +
                                        std::to_string(moe_router_topk));
  if (num_experts % expert_model_parallel_size != 0)
    flag_error("--expert-model-parallel-size", std::to_string(expert_model_parallel_size) +
                                                   " does not divide --num-experts " + std::to_string(num_experts));
  at_least("--moe-ffn-hidden-size", static_cast<double>(moe_ffn_hidden_size), 0);
  at_least("--moe-shared-expert-intermediate-size", static_cast<double>(moe_shared_expert_intermediate_size), 0);
  at_least("--moe-router-topk-scaling-factor", moe_router_topk_scaling_factor, 0);
  at_least("--moe-aux-loss-coeff", moe_aux_loss_coeff, 0);
  at_least("--moe-z-loss-coeff", moe_z_loss_coeff, 0);
  at_least("--moe-expert-capacity-factor", moe_expert_capacity_factor, 0);
  if (moe_shared_expert_gate && moe_shared_expert_intermediate_size == 0)
    flag_error("--moe-shared-expert-gate", "needs --moe-shared-expert-intermediate-size");
  if (moe_router_pre_softmax && moe_router_score_function != "softmax")
    flag_error("--moe-router-pre-softmax", "is for --moe-router-score-function softmax");
  if (moe_router_enable_expert_bias && moe_router_score_function != "sigmoid")
    flag_error("--moe-router-enable-expert-bias", "needs --moe-router-score-function sigmoid (as in Megatron-LM)");
  at_least("--moe-router-bias-update-rate", moe_router_bias_update_rate, 0);
  const std::vector<int64_t> pattern = moe_layer_pattern();
  if (pattern.size() > 1 && static_cast<int64_t>(pattern.size()) != num_layers)
    flag_error("--moe-layer-freq", "lists " + std::to_string(pattern.size()) + " layers, --num-layers is " +
                                       std::to_string(num_layers));
}

void ModelSection::validate() {
  at_least("--ffn-hidden-size", static_cast<double>(ffn_hidden_size), 0);
  at_least("--max-position-embeddings", static_cast<double>(max_position_embeddings), 0);
  at_most("--num-layers", num_layers, kMaxLayers);
  at_most("--hidden-size", hidden_size, kMaxHiddenSize);
  at_most("--ffn-hidden-size", ffn_hidden_size, kMaxFfnHiddenSize);
  at_most("--max-position-embeddings", max_position_embeddings, kMaxSequenceLength);
  at_least("--init-method-std", init_method_std, 0);
  at_least("--norm-epsilon", norm_epsilon, 0);
  fits_fp32("--init-method-std", init_method_std);
  fits_fp32("--norm-epsilon", norm_epsilon);
  if (!(rotary_base > 0)) flag_error("--rotary-base", "must be > 0, got " + number(rotary_base));
  positive("--num-layers", num_layers);
  positive("--hidden-size", hidden_size);
  positive("--num-attention-heads", num_attention_heads);
  at_least("--kv-channels", static_cast<double>(kv_channels), 0);
  if (kv_channels % 2 != 0) flag_error("--kv-channels", "must be even for RoPE, got " + std::to_string(kv_channels));
  if (kv_channels == 0 && hidden_size % num_attention_heads != 0)
    flag_error("--hidden-size", std::to_string(hidden_size) + " is not divisible by --num-attention-heads " +
                                    std::to_string(num_attention_heads));
  if (!group_query_attention) num_query_groups = num_attention_heads;
  positive("--num-query-groups", num_query_groups);
  if (kv_channels == 0 && hidden_size / num_attention_heads % 2 != 0)
    flag_error("--num-attention-heads", "gives an odd head size " + std::to_string(hidden_size / num_attention_heads) +
                                            " (--hidden-size / --num-attention-heads); RoPE needs an even one");
  if (num_attention_heads % num_query_groups != 0)
    flag_error("--num-query-groups", std::to_string(num_query_groups) + " does not divide --num-attention-heads " +
                                         std::to_string(num_attention_heads));
  if (ffn_hidden_size == 0) {
    ffn_hidden_size = megatron_default_ffn_hidden_size(hidden_size, swiglu);
    if (ffn_hidden_size == 0)
      flag_error("--ffn-hidden-size", "is needed: Megatron's default with --swiglu, int(4 x --hidden-size " +
                                          std::to_string(hidden_size) + " x 2/3 / 64) x 64, is 0");
  }
  positive("--make-vocab-size-divisible-by", make_vocab_size_divisible_by);
  if (make_vocab_size_divisible_by > kMaxVocabSize)
    flag_error("--make-vocab-size-divisible-by", "must be at most " + std::to_string(kMaxVocabSize) +
                                                     " (the largest vocabulary), got " +
                                                     std::to_string(make_vocab_size_divisible_by));
  if (!recompute_granularity.empty()) recompute_activations = true;
}

void DataSection::validate() const {
  at_least("--vocab-size", static_cast<double>(vocab_size), 0);
  at_most("--vocab-size", vocab_size, kMaxVocabSize);
  at_most("--seq-length", seq_length, kMaxSequenceLength);
  positive("--seq-length", seq_length);
}

void TrainingSection::validate() const {
  at_least("--global-batch-size", static_cast<double>(global_batch_size), 0);
  positive("--micro-batch-size", micro_batch_size);
  if (train_iters < 0) flag_error("--train-iters", "must be >= 0");
  // Megatron seeds numpy's RandomState with it, which takes 0 .. 2^32 - 1; so does the data order here.
  if (seed < 0 || seed > 4294967295LL) flag_error("--seed", "must be in [0, 4294967295], got " + std::to_string(seed));
}

void OptimizerSection::validate() const {
  at_least("--lr-decay-iters", static_cast<double>(lr_decay_iters), 0);
  for (auto [flag, v] : {std::pair{"--lr", lr}, {"--min-lr", min_lr}, {"--weight-decay", weight_decay},
                         {"--adam-eps", adam_eps}, {"--sgd-momentum", sgd_momentum}, {"--clip-grad", clip_grad}}) {
    at_least(flag, v, 0);
    fits_fp32(flag, v);
  }
  for (auto [flag, beta] : {std::pair{"--adam-beta1", adam_beta1}, {"--adam-beta2", adam_beta2}})
    if (!(beta >= 0 && beta < 1)) flag_error(flag, "must be in [0, 1), got " + number(beta));
  if (optimizer_implementation == "fused" && optimizer != "adam")
    flag_error("--optimizer-implementation", "fused is AdamW's kernel; --optimizer " + optimizer + " has none");
  if (min_lr > lr) flag_error("--min-lr", "is larger than --lr");
  if (lr_warmup_iters < 0) flag_error("--lr-warmup-iters", "must be >= 0");
}

void CheckpointSection::validate() const {
  check_output_path("--save", save, /*folder=*/true);
  check_output_path("--export-hf", export_hf, /*folder=*/true);
  check_output_path("--dump-param-to-param-group-map", dump_param_to_param_group_map, /*folder=*/true);
  if (save_interval < 0) flag_error("--save-interval", "must be >= 0");
  if (save_interval > 0 && save.empty()) flag_error("--save-interval", "needs --save");
  if (exit_interval < 0) flag_error("--exit-interval", "must be >= 0");
  for (auto [set, flag] : {std::pair{finetune, "--finetune"}, {no_load_optim, "--no-load-optim"},
                           {no_load_rng, "--no-load-rng"}, {ckpt_step >= 0, "--ckpt-step"}})
    if (set && load.empty()) flag_error(flag, "needs --load");
  if (ckpt_step < -1)
    flag_error("--ckpt-step", "must be an iteration >= 0 (or -1: the latest), got " + std::to_string(ckpt_step));
  if (no_save_optim && save.empty()) flag_error("--no-save-optim", "needs --save");
  if (async_save && save.empty()) flag_error("--async-save", "needs --save");
  // The earlier format's writer (safetensors) has no staging path; it is kept one release only.
  if (async_save && ckpt_format != "fsdp_dtensor")
    flag_error("--async-save", "needs --ckpt-format fsdp_dtensor (got --ckpt-format " + ckpt_format + ")");
  if (override_opt_param_scheduler && use_checkpoint_opt_param_scheduler)
    flag_error("--override-opt_param-scheduler", "conflicts with --use-checkpoint-opt_param-scheduler");
}

void FsdpSection::validate() const {
  if (fsdp_double_buffer && fsdp_trace_pool) flag_error("--fsdp-trace-pool", "conflicts with --fsdp-double-buffer");
  if (tensor_model_parallel_size < 1)
    flag_error("--tensor-model-parallel-size", "must be >= 1, got " + std::to_string(tensor_model_parallel_size));
  if (context_parallel_size < 1)
    flag_error("--context-parallel-size", "must be >= 1, got " + std::to_string(context_parallel_size));
  if (num_distributed_optimizer_instances < 1)
    flag_error("--num-distributed-optimizer-instances",
               "must be >= 1, got " + std::to_string(num_distributed_optimizer_instances));
  // Megatron-FSDP's HFSDP shards the main weights across the instances: it builds on ZeRO-3 inside.
  if (outer_dp_sharding_strategy == "optim" && data_parallel_sharding_strategy != "optim_grads_params")
    flag_error("--outer-dp-sharding-strategy",
               "optim (HFSDP) needs --data-parallel-sharding-strategy optim_grads_params, got " +
                   data_parallel_sharding_strategy);
  if (outer_dp_sharding_strategy == "optim" && num_distributed_optimizer_instances < 2)
    flag_error("--outer-dp-sharding-strategy",
               "optim shards across the instances of --num-distributed-optimizer-instances, which is " +
                   std::to_string(num_distributed_optimizer_instances) + " (needs 2 or more)");
}

void RuntimeSection::validate() const {
  const double timeout_ms = distributed_timeout_minutes * 60000.0;
  if (!(timeout_ms >= 1 && distributed_timeout_minutes <= 1e6))
    flag_error("--distributed-timeout-minutes",
               "must be a positive number of minutes (at most 1000000), got " + number(distributed_timeout_minutes));
}

void LoggingSection::validate() const {
  check_output_path("--metrics-file", metrics_file, /*folder=*/false);
  check_output_path("--tensorboard-dir", tensorboard_dir, /*folder=*/true);
  if (tensorboard_log_interval < 1)
    flag_error("--tensorboard-log-interval", "must be >= 1, got " + std::to_string(tensorboard_log_interval));
  positive("--log-interval", log_interval);
  positive("--eval-interval", eval_interval);
  if (eval_iters < 0) flag_error("--eval-iters", "must be >= 0");
}

void ProfilingSection::validate() const {
  if (!profile) {
    if (use_pytorch_profiler)
      flag_error("--use-pytorch-profiler", "needs --profile (Megatron's: it picks --profile's tool)");
    return;
  }
  if (profile_step_start < 0)
    flag_error("--profile-step-start", "must be >= 0, got " + std::to_string(profile_step_start));
  if (profile_step_end <= profile_step_start)
    flag_error("--profile-step-end", "must be greater than --profile-step-start (" +
                                         std::to_string(profile_step_start) + "), got " +
                                         std::to_string(profile_step_end));
  for (int64_t r : profile_ranks)
    if (r < 0) flag_error("--profile-ranks", "ranks are >= 0, got " + std::to_string(r));
}

void PretrainingSection::validate() const {
  at_least("--sample-tokens", static_cast<double>(sample_tokens), 0);
  at_most("--sample-tokens", sample_tokens, kMaxSequenceLength);
  if (simulate_world_size < 0) flag_error("--simulate-world-size", "must be >= 0");
  at_most("--simulate-world-size", simulate_world_size, kMaxSimulatedWorldSize);
  if (simulate_world_size > 0 && (simulate_rank < 0 || simulate_rank >= simulate_world_size))
    flag_error("--simulate-rank", std::to_string(simulate_rank) + " is not a rank of --simulate-world-size " +
                                      std::to_string(simulate_world_size));
  if (simulate_world_size == 0 && simulate_rank != 0) flag_error("--simulate-rank", "needs --simulate-world-size");
}

}  // namespace mfsdp
