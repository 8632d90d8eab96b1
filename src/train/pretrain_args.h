// The command line of mfsdp-pretrain: Megatron-LM's flag names (the Megatron-FSDP user guide and
// Megatron-LM's megatron/training/arguments.py), parsed and validated before any work.
// Every flag is declared once in pretrain_args.cpp with its default and help text; --help and
// docs/pretrain.md list them from there.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace mfsdp {

struct PretrainArgs {
  // Model.
  int64_t num_layers = 2;
  int64_t hidden_size = 64;
  int64_t ffn_hidden_size = 0;  // 0: Megatron's default, megatron_default_ffn_hidden_size (llama.h)
  int64_t num_attention_heads = 4;
  bool group_query_attention = false;
  int64_t num_query_groups = 1;
  int64_t seq_length = 64;
  int64_t max_position_embeddings = 0;  // 0: seq_length
  std::string normalization = "RMSNorm";
  bool swiglu = false;  // as in Megatron: off builds the GeLU MLP (LlamaConfig::swiglu)
  std::string position_embedding_type = "rope";
  double rotary_base = 10000;
  bool untie_embeddings_and_output_weights = false;
  double init_method_std = 0.02;
  double norm_epsilon = 1e-5;
  int64_t vocab_size = 0;  // with --mock-data and no tokenizer
  int64_t make_vocab_size_divisible_by = 128;
  bool recompute_activations = false;
  std::string recompute_granularity;  // "full" (only)

  // Training.
  int64_t micro_batch_size = 1;
  int64_t global_batch_size = 0;  // 0: micro_batch_size x data-parallel size
  int64_t train_iters = 0;
  double lr = 1e-4;
  double min_lr = 0.0;
  std::string lr_decay_style = "linear";
  int64_t lr_warmup_iters = 0;
  int64_t lr_decay_iters = 0;  // 0: train_iters
  double weight_decay = 0.01;
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.999;
  double adam_eps = 1e-8;
  double sgd_momentum = 0.9;
  double clip_grad = 1.0;
  int64_t seed = 1234;
  bool bf16 = false;
  // Megatron's --check-for-nan-in-loss-and-grad (on; --no-check-for-nan-in-loss-and-grad turns
  // it off): a NaN or Inf loss or gradient stops training before the optimizer step.
  bool check_for_nan_in_loss_and_grad = true;
  std::string optimizer = "adam";
  // AdamWOptions::fused when "fused", or "auto" on CUDA (Megatron trains with a fused Adam there).
  std::string optimizer_implementation = "auto";
  bool skip_train = false;

  // Data.
  std::string data_path;
  std::string split = "969,30,1";
  std::string tokenizer_type;
  std::string tokenizer_model;
  std::string vocab_file;
  std::string merge_file;
  bool mock_data = false;

  // Logging.
  int64_t log_interval = 100;
  int64_t eval_interval = 1000;
  int64_t eval_iters = 100;
  std::string metrics_file;
  std::string tensorboard_dir;           // TensorBoard event files (src/train/tensorboard_writer.h)
  int64_t tensorboard_log_interval = 1;
  std::string sample_prompt;  // ours: print a generated sample after training
  std::string export_hf;      // ours: write a Hugging Face folder at the end
  int64_t sample_tokens = 64;
  bool log_params_norm = false;        // " params norm: " (after the step, all parameters)
  bool log_num_zeros_in_grad = false;  // " num zeros: " (gradient elements == 0, after clipping)
  // Megatron's profiling (src/train/step_profiler.h): iterations profile_step_start + 1 ..
  // profile_step_end (1-based, as logged) on the ranks in profile_ranks; with
  // use_pytorch_profiler a Kineto trace into tensorboard_dir, else nsys's capture range.
  bool profile = false;
  bool use_pytorch_profiler = false;
  int64_t profile_step_start = 10;
  int64_t profile_step_end = 12;
  std::vector<int64_t> profile_ranks{0};

  // Checkpoints (fsdp_dtensor).
  std::string save;           // folder to save into
  int64_t save_interval = 0;  // iterations between saves (0: only at the end)
  std::string load;           // a save folder (its latest iteration) or an iteration folder
  int64_t ckpt_step = -1;     // --ckpt-step: the save folder's iteration to load (-1: the latest)
  bool finetune = false;      // --load reads model weights only; iteration restarts at 0
  bool no_load_optim = false;
  bool no_load_rng = false;
  bool no_save_optim = false;
  int64_t exit_interval = 0;  // stop (after saving) once the iteration is a multiple of this
  bool override_opt_param_scheduler = false;        // resume with this run's LR schedule
  bool use_checkpoint_opt_param_scheduler = false;  // resume with the checkpoint's LR schedule

  // Megatron-FSDP.
  bool use_megatron_fsdp = false;
  std::string data_parallel_sharding_strategy = "optim_grads_params";
  bool no_gradient_accumulation_fusion = false;
  bool use_distributed_optimizer = false;
  std::string ckpt_format = "fsdp_dtensor";  // or "mfsdp" (the earlier format)
  std::string dump_param_to_param_group_map;  // folder for Megatron's parameter -> group map
  bool calculate_per_token_loss = false;
  bool init_model_with_meta_device = false;
  bool grad_reduce_in_bf16 = false;
  bool no_fsdp_prefetch = false;                         // ours: no all-gather prefetch
  bool no_fsdp_all_gather_in_start_param_sync = false;   // ours: nothing in flight between steps
  bool fsdp_double_buffer = false;
  bool fsdp_trace_pool = false;  // ours: trace-then-plan pool for unsharded buffers
  bool use_nccl_ub = false;
  // Timeout of every collective (Megatron's --distributed-timeout-minutes): how long a silent
  // peer may keep a rank waiting; fractions of a minute are allowed here.
  double distributed_timeout_minutes = 10;
  std::string device = "auto";
  // "on", "off" or "" (unset: the environment variable decides, docs/comm.md).
  std::string cpu_comm_shared_memory;  // CommOptions::shared_memory (MFSDP_SHM)
  std::string socket_ifname;           // CommOptions::socket_ifname (MFSDP_SOCKET_IFNAME, GLOO_SOCKET_IFNAME)
  std::string keep_freed_cpu_memory;   // keep_freed_cpu_memory() (MFSDP_KEEP_FREED_MEMORY)
  std::string attention_backend = "auto";  // auto: SDPA; unfused: the explicit math path  // (mfsdp) auto, cpu or cuda: where the model trains

  // Simulated scale (ours): this single process plays one rank of a larger job.
  int64_t simulate_world_size = 0;  // 0: off
  int64_t simulate_rank = 0;
  bool memory_plan = false;  // ours: print the per-rank memory plan and exit (mfsdp-pretrain only)

  // Set by the tool before validation: mfsdp-sft and mfsdp-grpo start from what --load names, so
  // a --load without a checkpoint is an error there (mfsdp-pretrain starts afresh, as Megatron).
  bool load_requires_checkpoint = false;

  // Derived by validate().
  std::string load_dir;  // the iteration folder --load names (locate_checkpoint); empty: none there
  int64_t num_micro_batches = 1;
  int64_t real_vocab_size = 0;    // the tokenizer's (or --vocab-size): token ids must be below it
  int64_t padded_vocab_size = 0;  // real_vocab_size rounded up (--make-vocab-size-divisible-by)
};

// The other trainers (mfsdp-sft, mfsdp-grpo) take Megatron's model, optimizer, sharding,
// checkpoint and logging flags from here, plus flags of their own, and leave out the ones that
// mean nothing to them (pretraining data).
struct ToolFlag {
  std::string name;
  std::string help;
  bool takes_value = true;
  std::vector<std::string> choices;  // empty: any value
  std::function<void(const std::string&)> set;  // writes the tool's own args (captured)
  std::function<std::string()> show;            // the current value, as --help shows it
  // argparse's nargs='+': every following token up to the next --flag, joined by spaces.
  bool many_values = false;
};
struct ToolFlags {
  std::string program = "mfsdp-pretrain";
  std::vector<ToolFlag> extra;
  std::vector<std::string> excluded;  // PretrainArgs flags this tool does not take
};

// Parses argv (argv[0] is the program). Throws std::invalid_argument naming the flag for an
// unknown flag, a missing or malformed value, or a value outside its allowed set.
PretrainArgs parse_pretrain_args(const std::vector<std::string>& argv, const ToolFlags& tool = {});

// Checks what needs the data-parallel size and the tokenizer's vocabulary, and derives
// num_micro_batches, ffn size and padded vocab size. Throws naming the flag(s).
// validate_training_args checks everything but the pretraining data (--data-path / --mock-data).
void validate_pretrain_args(PretrainArgs& args, int data_parallel_size, int64_t tokenizer_vocab);
void validate_training_args(PretrainArgs& args, int data_parallel_size, int64_t tokenizer_vocab);

// Every flag's value as --help shows it ({"--lr": "0.0001", ...}), recorded in checkpoints.
std::map<std::string, std::string> pretrain_args_values(const PretrainArgs& args, const ToolFlags& tool = {});

// "--flag VALUE  help (default: x)" for every flag, for --help and docs. `tool`'s extra flags show
// their values at the time of the call (call it on default-constructed tool args).
std::string pretrain_usage(const ToolFlags& tool = {});

// Flags accepted for Megatron compatibility that change nothing in this build, with the reason,
// for the one-time start-up notice.
std::vector<std::string> pretrain_inert_flag_notices(const PretrainArgs& args, bool nccl_in_use);

}  // namespace mfsdp
