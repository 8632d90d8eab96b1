// The trainers' configuration in sections, as TorchTitan's JobConfig has them: one struct per
// concern, each declaring its own flags (Megatron-LM's names, defaults and help text) and the
// checks that need only its values (and, for the MoE section, the model's). The sections know
// nothing of one another or of the tools: include/mfsdp/train/pretrain_args.h joins them, each
// tool says which it takes, and --help lists the flags section by section, in the order
// flags() gives them.
//
// validate() throws std::invalid_argument("<flag>: <what>") for the first bad value and fills
// the defaults that depend only on the section (e.g. the MLP width from the hidden size). Checks
// that join sections (batch sizes against the data-parallel size, the vocabulary against the
// tokenizer, --load against the file system) are validate_training_args' (pretrain_args.h).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace mfsdp {

// Throws std::invalid_argument("<flag>: <what>"), the form every flag error takes.
[[noreturn]] void flag_error(const std::string& flag, const std::string& what);

// Upper bounds where a larger value would allocate or loop without end, not train: ranks a
// simulated run can play, a vocabulary (the largest of real models are ~256K ids), and the
// samples the datasets index (train plus validation plus test; 2^32 covers any real run, ~4e12
// tokens at 1K tokens per sample, and keeps the index arrays' sizes from overflowing).
inline constexpr int64_t kMaxSimulatedWorldSize = int64_t{1} << 20;
inline constexpr int64_t kMaxVocabSize = int64_t{1} << 24;
inline constexpr double kMaxDatasetSamples = 4294967296.0;
// The model's sizes, each far past the largest real model (Llama-3-405B: 126 layers, hidden
// 16384, MLP 53248; million-token contexts), so that a typo is refused before the model is
// built instead of ending in an allocator error or the kernel's OOM killer; and the tokens of
// one micro-batch on a rank (64M; real runs hold at most a few hundred thousand).
inline constexpr int64_t kMaxLayers = 1024;
inline constexpr int64_t kMaxHiddenSize = int64_t{1} << 17;
inline constexpr int64_t kMaxFfnHiddenSize = int64_t{1} << 20;
inline constexpr int64_t kMaxSequenceLength = int64_t{1} << 22;
inline constexpr int64_t kMaxMicroBatchTokens = int64_t{1} << 26;
// Experts per MoE layer (DeepSeek-V3 has 256): the bound of the model's config.json reader
// (src/models/llama/llama_hf_config.cpp), which the MoE flags become.
inline constexpr int64_t kMaxExperts = 4096;

// One command-line flag, bound to the field it writes (the owner must outlive it). Each section's
// flags() gives its flags in --help order, bound to its own fields; the tools add their own
// (train/tool_flags.h builds both).
struct ToolFlag {
  std::string name;
  std::string help;
  bool takes_value = true;
  std::vector<std::string> choices;  // empty: any value
  std::function<void(const std::string&)> set;  // parses the value into the field
  std::function<std::string()> show;            // the current value, as --help shows it
  // argparse's nargs='+': every following token up to the next --flag, joined by spaces.
  bool many_values = false;
};

// The sections in --help order. kPretraining holds what only mfsdp-pretrain does (its corpus,
// a sample after training, simulated scale).
enum class Section { kModel, kMoe, kTokenizer, kData, kTraining, kOptimizer, kCheckpoint, kParallel, kFsdp,
                     kRuntime, kLogging, kProfiling, kPretraining };
const char* section_title(Section s);  // "model: the transformer (Megatron's network size arguments)", ...
const std::vector<Section>& all_sections();

struct MoeSection;

struct ModelSection {
  int64_t num_layers = 2;
  int64_t hidden_size = 64;
  int64_t ffn_hidden_size = 0;  // 0: Megatron's default, megatron_default_ffn_hidden_size (model_spec.h)
  int64_t num_attention_heads = 4;
  bool group_query_attention = false;
  int64_t num_query_groups = 1;         // without --group-query-attention: num_attention_heads
  int64_t max_position_embeddings = 0;  // 0: --seq-length
  std::string normalization = "RMSNorm";
  bool swiglu = false;  // as in Megatron: off builds the GeLU MLP (ModelSpec::config_from_megatron)
  std::string position_embedding_type = "rope";
  double rotary_base = 10000;
  bool untie_embeddings_and_output_weights = false;
  double init_method_std = 0.02;
  double norm_epsilon = 1e-5;
  int64_t make_vocab_size_divisible_by = 128;
  // Activation recompute, Megatron's flags and rules (its transformer_config.py __post_init__
  // and arguments.py): --recompute-activations is --recompute-granularity selective;
  // "full" needs --recompute-method and --recompute-num-layers; "selective" takes
  // --recompute-modules (default core_attn) and neither of those. RecomputeOptions (recompute.h)
  // is what the model gets (model_build_options, training_run.cpp).
  bool recompute_activations = false;
  std::string recompute_granularity;  // "", "full" or "selective"
  std::string recompute_method;       // "", "uniform" or "block" (full only)
  int64_t recompute_num_layers = -1;  // -1: unset (Megatron's None)
  std::vector<std::string> recompute_modules;  // empty: unset, ["core_attn"] under selective
  // The output layer fused with the loss in chunks of the vocabulary (chunked_output.h), never
  // the full logits: Megatron's --cross-entropy-loss-fusion, on by default here (exact to
  // rounding); --no-cross-entropy-loss-fusion computes the logits whole.
  bool cross_entropy_loss_fusion = true;
  std::string cross_entropy_fusion_impl = "native";
  int64_t cross_entropy_chunk_elements = 0;  // 0: kDefaultChunkElements
  bool qk_layernorm = false;  // per-head q/k RMSNorm (Qwen3)
  int64_t kv_channels = 0;    // each head's width; 0: hidden_size / num_attention_heads
  // Multi-head latent attention (DeepSeek-V3; docs/model.md), Megatron's MLA arguments and defaults.
  bool multi_latent_attention = false;
  int64_t q_lora_rank = 0;  // 0: Megatron's None, a plain query projection
  int64_t kv_lora_rank = 32;
  int64_t qk_head_dim = 128;          // each head's query/key part without RoPE (HF qk_nope_head_dim)
  int64_t qk_pos_emb_head_dim = 64;   // the RoPE part (HF qk_rope_head_dim)
  int64_t v_head_dim = 128;
  double rotary_scaling_factor = 1.0;  // YaRN's factor (1: plain RoPE)
  double mscale = 1.0;
  double mscale_all_dim = 0.0;
  void validate();
  // The recompute rules that need the MoE section (Megatron's: moe_act only with
  // --moe-grouped-gemm). Throws as validate().
  void validate_recompute(const MoeSection& moe) const;
  std::vector<ToolFlag> flags();

 private:
  void validate_recompute_flags();  // the recompute rules of validate()
};

// Mixture of experts (Megatron's --moe-* arguments, docs/moe.md). Inert without --num-experts.
struct MoeSection {
  int64_t num_experts = 0;
  int64_t moe_router_topk = 2;
  int64_t moe_ffn_hidden_size = 0;  // 0: --ffn-hidden-size, as Megatron
  int64_t moe_shared_expert_intermediate_size = 0;
  bool moe_shared_expert_gate = false;
  std::string moe_router_score_function = "softmax";
  bool moe_router_pre_softmax = false;
  double moe_router_topk_scaling_factor = 0;  // 0: unset (Megatron's None: no scaling)
  std::string moe_router_load_balancing_type = "aux_loss";
  double moe_aux_loss_coeff = 0;
  double moe_z_loss_coeff = 0;            // 0: Megatron's None, no z-loss
  double moe_expert_capacity_factor = 0;  // 0: Megatron's None, dropless
  std::string moe_token_dispatcher_type = "alltoall";
  bool moe_grouped_gemm = false;
  // An integer N (every N-th layer from 0) or a list "[1,0,1,1]", also as Megatron's Python
  // expression of lists ("([0]*3+[1]*58)": lists, a list times a count, sums, parentheses).
  std::string moe_layer_freq = "1";
  bool moe_router_enable_expert_bias = false;
  double moe_router_bias_update_rate = 1e-3;
  bool moe_per_layer_logging = false;
  int64_t moe_router_num_groups = 0;  // 0: Megatron's None, no group-limited routing
  int64_t moe_router_group_topk = 0;
  // The layers' pattern from moe_layer_freq: one 0/1 per layer, or {N} for an integer N.
  std::vector<int64_t> moe_layer_pattern() const;
  bool moe_layer_freq_is_list() const;
  // Reads the model's layers, MLP kind and width: the experts are SwiGLU MLPs of the model.
  void validate(const ModelSection& model) const;
  std::vector<ToolFlag> flags();
};

struct TokenizerSection {
  std::string tokenizer_type;
  std::string tokenizer_model;
  std::string vocab_file;
  std::string merge_file;
  std::vector<ToolFlag> flags();
};

// The pretraining corpus (Megatron's data arguments); mfsdp-sft and mfsdp-grpo read JSONL
// instead and set seq_length from their own --max-length flags.
struct DataSection {
  std::string data_path;
  std::string split = "969,30,1";  // train, valid, test weights: up to three, comma-separated
  bool mock_data = false;
  int64_t seq_length = 64;
  int64_t vocab_size = 0;  // with --mock-data and no tokenizer
  void validate() const;
  std::vector<ToolFlag> flags();
};

struct TrainingSection {
  int64_t micro_batch_size = 1;
  int64_t global_batch_size = 0;  // 0: micro_batch_size x data-parallel size
  int64_t train_iters = 0;
  int64_t seed = 1234;
  bool bf16 = false;
  // Megatron's --check-for-nan-in-loss-and-grad (on; --no-check-for-nan-in-loss-and-grad turns
  // it off): a NaN or Inf loss or gradient stops training before the optimizer step.
  bool check_for_nan_in_loss_and_grad = true;
  void validate() const;
  std::vector<ToolFlag> flags();
};

struct OptimizerSection {
  std::string optimizer = "adam";
  // AdamWOptions::fused when "fused", or "auto" on CUDA (Megatron trains with a fused Adam there).
  std::string optimizer_implementation = "auto";
  double lr = 1e-4;
  double min_lr = 0.0;
  std::string lr_decay_style = "linear";
  int64_t lr_warmup_iters = 0;
  int64_t lr_decay_iters = 0;  // 0: --train-iters
  double weight_decay = 0.01;
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.999;
  double adam_eps = 1e-8;
  double sgd_momentum = 0.9;
  double clip_grad = 1.0;
  // --optimizer muon (include/mfsdp/optim/muon.h), Megatron's --muon-* flags and defaults.
  double muon_momentum = 0.9;
  bool muon_split_qkv = true;  // --muon-no-split-qkv clears it (refused: q, k and v are apart here)
  bool muon_nesterov = false;
  std::string muon_scale_mode = "spectral";
  std::string muon_fp32_matmul_prec = "medium";
  std::string muon_coefficient_type = "quintic";
  int64_t muon_num_ns_steps = 5;
  std::string muon_tp_mode = "duplicated";
  bool muon_use_syrk = false;
  double muon_extra_scale_factor = 1.0;
  std::string muon_scalar_optimizer = "adam";
  // Megatron's precision-aware optimizer (AdamWOptions::exp_avg_dtype): the moments in bf16.
  bool use_precision_aware_optimizer = false;
  std::string main_grads_dtype = "fp32", main_params_dtype = "fp32", exp_avg_dtype = "fp32", exp_avg_sq_dtype = "fp32";
  void validate() const;
  std::vector<ToolFlag> flags();
};

struct CheckpointSection {
  std::string save;           // folder to save into
  int64_t save_interval = 0;  // iterations between saves (0: only at the end)
  std::string load;           // a save folder (its latest iteration) or an iteration folder
  int64_t ckpt_step = -1;     // --ckpt-step: the save folder's iteration to load (-1: the latest)
  bool finetune = false;      // --load reads model weights only; iteration restarts at 0
  bool no_load_optim = false;
  bool no_load_rng = false;
  bool no_save_optim = false;
  int64_t exit_interval = 0;  // stop (after saving) once the iteration is a multiple of this
  // Megatron's: on SIGTERM (or SIGINT) every rank saves at the end of the iteration and exits 0;
  // stop (after saving) once the job has run this long (0: no limit), the longest rank's time.
  bool exit_signal_handler = false;
  double exit_duration_in_mins = 0;
  bool override_opt_param_scheduler = false;        // resume with this run's LR schedule
  bool use_checkpoint_opt_param_scheduler = false;  // resume with the checkpoint's LR schedule
  std::string ckpt_format = "fsdp_dtensor";         // or "mfsdp" (the earlier format)
  bool async_save = false;  // --async-save: stage shards, write them on a thread, commit at the next save
  // Megatron's non-persistent checkpoints: every K iterations (between --save-interval's), only
  // the newest kept; "global" (the checkpoint format, into its own folder: default
  // <save>/non_persistent) or "local" (each rank's state on its node, replicated to a peer).
  int64_t non_persistent_save_interval = 0;
  std::string non_persistent_ckpt_type;  // "", "global" or "local"
  std::string non_persistent_global_ckpt_dir;
  std::string non_persistent_local_ckpt_dir = "/dev/shm/mfsdp_local_ckpt";
  std::string export_hf;                            // ours: write a Hugging Face folder at the end
  std::string dump_param_to_param_group_map;        // folder for Megatron's parameter -> group map
  void validate() const;
  std::vector<ToolFlag> flags();
};

// The parallel layout (Megatron's distributed arguments): the sizes of every dimension, which
// train/parallel_dims.h validates against the world and turns into the job's meshes.
struct ParallelSection {
  int64_t tensor_model_parallel_size = 1;
  bool sequence_parallel = false;
  int64_t context_parallel_size = 1;
  // How context-parallel attention exchanges keys and values: p2p (a ring) or all_gather. The
  // default is all_gather, not Megatron's p2p: it measured 8x faster here (docs/PERFORMANCE.md).
  std::string cp_comm_type = "all_gather";
  int64_t expert_model_parallel_size = 1;
  int64_t expert_tensor_parallel_size = 0;  // 0: Megatron's None, the tensor-parallel size
  int64_t pipeline_model_parallel_size = 1;
  // Megatron's uneven layer split: the first / last stage's decoder layers (-1: the even split),
  // and the embedding / the loss counted as one layer each in the split.
  int64_t decoder_first_pipeline_num_layers = -1;
  int64_t decoder_last_pipeline_num_layers = -1;
  bool account_for_embedding_in_pipeline_split = false;
  bool account_for_loss_in_pipeline_split = false;
  // Interleaving: model chunks per stage (Megatron's --num-virtual-stages-per-pipeline-rank, which
  // older Megatron-LM calls --virtual-pipeline-model-parallel-size; 0: none), or the decoder
  // layers of each chunk (--num-layers-per-virtual-pipeline-stage; 0: unset).
  int64_t num_virtual_stages_per_pipeline_rank = 0;
  int64_t num_layers_per_virtual_pipeline_stage = 0;
  // Megatron's --variable-seq-lengths: each activation's shape travels between pipeline stages
  // before it (a message per send) instead of being the fixed [micro-batch, --seq-length, hidden].
  bool variable_seq_lengths = false;
  // HSDP (Megatron's hierarchical data parallelism): the data-parallel ranks as instances of
  // consecutive ranks; each instance shards the model, the instances replicate it.
  int64_t num_distributed_optimizer_instances = 1;
  std::string outer_dp_sharding_strategy = "no_shard";  // across instances: no_shard (HSDP) or optim
  // The sizes' own bounds (>= 1); everything against the world is parallel_dims'.
  void validate() const;
  std::vector<ToolFlag> flags();
};

// Megatron-FSDP and the distributed optimizer.
struct FsdpSection {
  bool use_megatron_fsdp = false;
  std::string data_parallel_sharding_strategy = "optim_grads_params";
  bool no_gradient_accumulation_fusion = false;
  bool use_distributed_optimizer = false;
  bool init_model_with_meta_device = true;  // mfsdp's default (Megatron's is off): no rank holds the model
  bool grad_reduce_in_bf16 = false;
  bool grad_reduce_rank_order_fp32 = false;  // ours: bf16 gradients summed in fp32 in rank order
  bool no_fsdp_prefetch = false;                        // ours: no all-gather prefetch
  bool no_fsdp_all_gather_in_start_param_sync = false;  // ours: nothing in flight between steps
  bool fsdp_double_buffer = false;
  bool fsdp_trace_pool = false;  // ours: trace-then-plan pool for unsharded buffers
  bool use_nccl_ub = false;
  void validate() const;
  std::vector<ToolFlag> flags();
};

// Where and how the job runs: device, collectives, host memory, attention kernels.
struct RuntimeSection {
  std::string device = "auto";  // auto, cpu or cuda: where the model trains
  // Timeout of every collective (Megatron's --distributed-timeout-minutes): how long a silent
  // peer may keep a rank waiting; fractions of a minute are allowed here.
  double distributed_timeout_minutes = 10;
  // "on", "off" or "" (unset: the environment variable decides, docs/comm.md).
  std::string cpu_comm_shared_memory;  // CommOptions::shared_memory (MFSDP_SHM)
  std::string socket_ifname;           // CommOptions::socket_ifname (MFSDP_SOCKET_IFNAME, GLOO_SOCKET_IFNAME)
  std::string keep_freed_cpu_memory;   // keep_freed_cpu_memory() (MFSDP_KEEP_FREED_MEMORY)
  std::string attention_backend = "auto";  // auto: SDPA; unfused: the explicit math path
  void validate() const;
  std::vector<ToolFlag> flags();
};

struct LoggingSection {
  int64_t log_interval = 100;
  int64_t eval_interval = 1000;
  int64_t eval_iters = 100;
  std::string metrics_file;
  std::string tensorboard_dir;  // TensorBoard event files (include/mfsdp/train/tensorboard_writer.h)
  int64_t tensorboard_log_interval = 1;
  bool log_params_norm = false;        // " params norm: " (after the step, all parameters)
  bool log_num_zeros_in_grad = false;  // " num zeros: " (gradient elements == 0, after clipping)
  void validate() const;
  std::vector<ToolFlag> flags();
};

// Megatron's profiling (include/mfsdp/train/step_profiler.h): iterations profile_step_start + 1 ..
// profile_step_end (1-based, as logged) on the ranks in profile_ranks; with
// use_pytorch_profiler a Kineto trace into --tensorboard-dir, else nsys's capture range.
struct ProfilingSection {
  bool profile = false;
  bool use_pytorch_profiler = false;
  int64_t profile_step_start = 10;
  int64_t profile_step_end = 12;
  std::vector<int64_t> profile_ranks{0};
  void validate() const;
  std::vector<ToolFlag> flags();
};

// What only mfsdp-pretrain does.
struct PretrainingSection {
  bool calculate_per_token_loss = false;
  bool skip_train = false;
  std::string sample_prompt;  // ours: print a generated sample after training
  int64_t sample_tokens = 64;
  // Simulated scale (ours): this single process plays one rank of a larger job.
  int64_t simulate_world_size = 0;  // 0: off
  int64_t simulate_rank = 0;
  bool memory_plan = false;  // ours: print the per-rank memory plan and exit
  // Megatron's result validation (include/mfsdp/train/rerun_validation.h).
  std::string rerun_mode = "validate_results";
  bool check_for_spiky_loss = false;
  int64_t error_injection_rate = 0;
  std::string error_injection_type = "transient_error";
  void validate() const;
  std::vector<ToolFlag> flags();
};

}  // namespace mfsdp
