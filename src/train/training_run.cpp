#include "mfsdp/train/training_run.h"

#include <ATen/record_function.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <set>
#include <sstream>
#include <iostream>
#include <mutex>
#include <unistd.h>

#include "mfsdp/base/host_name.h"
#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/checkpoint/checkpoint_inspector.h"
#include "mfsdp/checkpoint/load_model.h"
#include "mfsdp/checkpoint/safetensors.h"
#include "mfsdp/checkpoint/tensor_source.h"
#include "mfsdp/comm/rendezvous.h"
#include "mfsdp/comm/simulated_comm.h"
#include "mfsdp/models/chunked_output.h"
#include "mfsdp/models/tensor_parallel_training.h"
#include "mfsdp/optim/muon.h"
#include "mfsdp/train/exit_signals.h"
#include "mfsdp/train/train_loop.h"

namespace mfsdp {

nlohmann::json megatron_model_args(const ModelSection& a, const MoeSection& moe, int64_t seq_length,
                                   int64_t padded_vocab_size) {
  return {{"num_layers", a.num_layers},
          {"hidden_size", a.hidden_size},
          {"ffn_hidden_size", a.ffn_hidden_size},
          {"num_attention_heads", a.num_attention_heads},
          {"group_query_attention", a.group_query_attention},
          {"num_query_groups", a.num_query_groups},
          {"padded_vocab_size", padded_vocab_size},
          {"max_position_embeddings", a.max_position_embeddings},
          {"seq_length", seq_length},
          {"rotary_base", a.rotary_base},
          {"norm_epsilon", a.norm_epsilon},
          {"init_method_std", a.init_method_std},
          {"untie_embeddings_and_output_weights", a.untie_embeddings_and_output_weights},
          {"swiglu", a.swiglu},
          {"normalization", a.normalization},
          {"position_embedding_type", a.position_embedding_type},
          {"add_bias_linear", false},
          {"qk_layernorm", a.qk_layernorm},
          {"kv_channels", a.kv_channels > 0 ? nlohmann::json(a.kv_channels) : nlohmann::json()},
          {"num_experts", moe.num_experts},
          {"moe_router_topk", moe.moe_router_topk},
          {"moe_ffn_hidden_size", moe.moe_ffn_hidden_size},
          {"moe_shared_expert_intermediate_size", moe.moe_shared_expert_intermediate_size},
          {"moe_shared_expert_gate", moe.moe_shared_expert_gate},
          {"moe_router_score_function", moe.moe_router_score_function},
          {"moe_router_pre_softmax", moe.moe_router_pre_softmax},
          {"moe_router_enable_expert_bias", moe.moe_router_enable_expert_bias},
          {"moe_router_topk_scaling_factor",
           moe.moe_router_topk_scaling_factor > 0 ? nlohmann::json(moe.moe_router_topk_scaling_factor) : nlohmann::json()},
          {"moe_layer_freq", moe.moe_layer_freq_is_list()
                                 ? nlohmann::json(moe.moe_layer_pattern())
                                 : nlohmann::json(moe.moe_layer_pattern().front())},
          {"moe_router_num_groups", moe.moe_router_num_groups > 0 ? nlohmann::json(moe.moe_router_num_groups) : nlohmann::json()},
          {"moe_router_group_topk", moe.moe_router_group_topk > 0 ? nlohmann::json(moe.moe_router_group_topk) : nlohmann::json()},
          {"multi_latent_attention", a.multi_latent_attention},
          {"q_lora_rank", a.q_lora_rank > 0 ? nlohmann::json(a.q_lora_rank) : nlohmann::json()},
          {"kv_lora_rank", a.kv_lora_rank},
          {"qk_head_dim", a.qk_head_dim},
          {"qk_pos_emb_head_dim", a.qk_pos_emb_head_dim},
          {"v_head_dim", a.v_head_dim},
          {"rotary_scaling_factor", a.rotary_scaling_factor},
          {"mscale", a.mscale},
          {"mscale_all_dim", a.mscale_all_dim}};
}

MoeTraining moe_training_from_args(const MoeSection& a) {
  MoeTraining t;
  t.balancing = a.moe_router_load_balancing_type == "seq_aux_loss" ? MoeTraining::Balancing::kSeqAuxLoss
                : a.moe_router_load_balancing_type == "none"       ? MoeTraining::Balancing::kNone
                                                                   : MoeTraining::Balancing::kAuxLoss;
  t.aux_loss_coeff = a.moe_aux_loss_coeff;
  t.z_loss_coeff = a.moe_z_loss_coeff;
  t.capacity_factor = a.moe_expert_capacity_factor;
  t.grouped_gemm = a.moe_grouped_gemm;
  t.bias_update_rate = a.moe_router_bias_update_rate;
  return t;
}

ModelConfig model_config_from_args(const ModelSection& model, const MoeSection& moe, int64_t seq_length,
                                   int64_t padded_vocab_size) {
  return model_config_from_megatron(megatron_model_args(model, moe, seq_length, padded_vocab_size));
}

FullyShardOptions shard_options_from_args(const FsdpSection& a, const ParallelSection& parallel,
                                          const TrainingSection& training, bool per_token_loss) {
  FullyShardOptions o;
  o.strategy = parse_sharding_strategy(a.data_parallel_sharding_strategy);
  o.outer_strategy = parse_sharding_strategy(parallel.outer_dp_sharding_strategy);
  o.prefetch = !a.no_fsdp_prefetch;
  o.all_gather_in_start_param_sync = !a.no_fsdp_all_gather_in_start_param_sync;
  if (a.fsdp_double_buffer) o.buffer_allocator = BufferAllocatorKind::kDoubleBuffer;
  if (a.fsdp_trace_pool) o.buffer_allocator = BufferAllocatorKind::kTracePool;
  if (training.bf16) o.mixed_precision.param_dtype = at::kBFloat16;
  if (a.grad_reduce_in_bf16) o.mixed_precision.grad_comm_dtype = at::kBFloat16;
  if (a.grad_reduce_rank_order_fp32) o.mixed_precision.grad_reduce_sum = LowPrecisionSum::kRankOrderFp32;
  o.gradient_scaling = per_token_loss ? GradientScaling::kNone : GradientScaling::kDivideByWorld;
  return o;
}

namespace {
// --optimizer adam's options (and Muon's for the parameters it leaves to AdamW).
AdamWOptions adamw_options(const OptimizerSection& args, const at::Device& device) {
  AdamWOptions o;
  o.beta1 = args.adam_beta1;
  o.beta2 = args.adam_beta2;
  o.eps = args.adam_eps;
  o.weight_decay = args.weight_decay;
  o.fused = args.optimizer_implementation == "fused" || (args.optimizer_implementation == "auto" && device.is_cuda());
  if (args.exp_avg_dtype == "bf16") o.exp_avg_dtype = at::kBFloat16;
  if (args.exp_avg_sq_dtype == "bf16") o.exp_avg_sq_dtype = at::kBFloat16;
  return o;
}
}  // namespace

ModelBuildOptions model_build_options(const ModelSection& model, const MoeSection& moe, const TrainingSection& training,
                                      const FsdpSection& fsdp, const ParallelSection& parallel, bool values_loaded) {
  ModelBuildOptions options;
  options.deferred_init = fsdp.init_model_with_meta_device || values_loaded;
  // The flags as ModelSection::validate left them (Megatron's rules; --recompute-activations is
  // selective there).
  model.validate_recompute(moe);
  if (model.recompute_granularity == "selective") {
    options.recompute = RecomputeOptions::selective(model.recompute_modules);
  } else if (model.recompute_granularity == "full") {
    options.recompute = RecomputeOptions::full_layers(
        model.recompute_method == "block" ? RecomputeOptions::Method::kBlock : RecomputeOptions::Method::kUniform,
        model.recompute_num_layers);
  }
  options.init_seed = static_cast<uint64_t>(training.seed);
  options.moe = moe_training_from_args(moe);
  options.sequence_parallel = parallel.sequence_parallel;
  options.context_parallel_algorithm = parallel.cp_comm_type == "p2p" ? context_parallel::CpAlgorithm::kRing
                                                                  : context_parallel::CpAlgorithm::kAllGather;
  return options;
}

ShardedModel build_sharded_model(const ModelConfig& config, ModelBuildOptions options, bool use_sdpa,
                                 const FullyShardOptions& shard, const ParallelMesh* mesh) {
  FullyShardOptions dense = shard, experts = shard;
  if (mesh != nullptr) {
    check_parallel_model(mesh->dims(), config);
    options.tensor_parallel = mesh->split("tp");
    options.context_parallel = mesh->split("cp");
    options.expert_parallel = mesh->split("ep");
    options.expert_tensor_parallel = mesh->split("etp");
    if (options.sequence_parallel && mesh->dims().tp > 1 && mesh->dims().cp > 1)
      options.tensor_context_parallel = mesh->get("tp_cp");
    if (mesh->dims().pp > 1)
      options.pipeline = stage_chunks(mesh->dims().pipeline_split_options(config.num_layers()), mesh->coordinate("pp"));
    dense = mesh->dense_shard_options(shard);
    experts = mesh->expert_shard_options(shard);
  } else {
    options.sequence_parallel = false;  // it splits over the tensor-parallel group
  }
  std::shared_ptr<CausalLM> model = config.spec->build(config, options);
  model->set_use_sdpa(use_sdpa);
  // With --init-model-with-meta-device each layer is materialised as it is sharded.
  FsdpHandle root = shard_model(*model, dense, mesh != nullptr && mesh->dims().experts_apart() ? &experts : nullptr);
  return {model, root, options.expert_parallel};
}

StartingPoint starting_point(const OpenedCheckpoint& load, const std::string& hf_load, const ModelConfig& from_flags,
                             int64_t seed, const std::string& export_hf, int64_t tokenizer_vocab) {
  StartingPoint p;
  if (load.reader) {
    const CheckpointReader& reader = *load.reader;
    const nlohmann::json saved = reader.metadata().value("model_config", nlohmann::json::object());
    // A checkpoint that records no model (PyTorch's dcp.save) holds the model the flags describe;
    // loading checks every tensor's shape against it.
    p.config = saved.empty() ? from_flags : model_config_from_hf(saved);
    p.description = "checkpoint " + reader.dir() + " (iteration " + reader.metadata()["iteration"].dump() +
                    (saved.empty() ? "; no model_config recorded: the model from the flags)" : ")");
  } else if (!hf_load.empty()) {
    if (!is_hf_folder(hf_load))
      throw std::invalid_argument("--hf-load " + hf_load +
                                  ": not a Hugging Face model folder (config.json and model.safetensors)");
    // Headers and config.json only: each rank reads its own ranges in TrainingRun::start.
    p.config = describe_hf_model(TensorSource(hf_load)).config;
    p.hf_folder = hf_load;
    p.description = "Hugging Face folder " + hf_load;
  } else {
    p.config = from_flags;
    p.description = "new model from the flags (seed " + std::to_string(seed) + ")";
    return p;
  }
  if (!export_hf.empty())
    if (const std::string refusal = p.config.spec->hf_export_refusal(p.config); !refusal.empty())
      throw std::invalid_argument("--export-hf (" + p.description + "): " + refusal);
  if (tokenizer_vocab > p.config.vocab_size())
    throw std::invalid_argument("--tokenizer-type: the tokenizer has " + std::to_string(tokenizer_vocab) +
                                " ids but the model (" + p.description + ") only " +
                                std::to_string(p.config.vocab_size()));
  return p;
}

std::string sibling_path(const std::string& metrics_file, const std::string& extension) {
  std::string path = metrics_file;
  const auto dot = path.rfind('.'), slash = path.rfind('/');
  if (dot != std::string::npos && (slash == std::string::npos || dot > slash)) path.resize(dot);
  return path + extension;
}

TrainingRun::TrainingRun(const PretrainArgs& args, const ModelConfig& config, std::shared_ptr<Communicator> comm,
                         std::ostream& log, bool per_token_loss, ToolFlags tool, std::string hf_folder,
                         OpenedCheckpoint load)
    : args_(args),
      config_(config),
      comm_(std::move(comm)),
      log_(log),
      tool_(std::move(tool)),
      hf_folder_(std::move(hf_folder)),
      load_(std::move(load)),
      per_token_loss_(per_token_loss),
      print_(comm_->rank() == 0 || is_simulated(*comm_)),
      mesh_(parallel_dims(args, args, comm_->size()), comm_),
      sharded_(build_sharded_model(
          config, model_build_options(args, args, args, args, args, /*values_loaded=*/load_.reader || !hf_folder_.empty()),
          args.attention_backend != "unfused", shard_options_from_args(args, args, args, per_token_loss), &mesh_)),
      // A restart of the same job (torchrun's or mfsdp-run's --max-restarts) adds to its metrics.
      metrics_(print_ ? args.metrics_file : "", restart_count_from_env() > 0),
      tensorboard_(print_ ? args.tensorboard_dir : ""),
      profiler_(args, args, comm_->rank(), comm_->device(), log),
      progress_(comm_->rank() == 0) {
  // Only mfsdp-pretrain validates results: SFT's and GRPO's micro-batch functions add up their
  // metrics as they run, so a rerun would count them twice (they take none of these flags).
  if (tool_.program == "mfsdp-pretrain") {
    rerun_mode_ = rerun_mode_from_name(args.rerun_mode);
    for (int r = 0; r < comm_->size(); ++r) {
      spikes_.emplace_back();
      injectors_.emplace_back(args.error_injection_rate, injected_result_from_name(args.error_injection_type), r,
                              static_cast<uint64_t>(args.seed));
    }
  }
  if (args.exit_signal_handler) install_exit_signal_handler();
  if (args.optimizer == "adam") {
    optimizer_ = make_adamw(sharded_.root, adamw_options(args, comm_->device()));
  } else if (args.optimizer == "muon") {
    optimizer_ = make_muon_optimizer(args);
  } else {
    SGDOptions o;
    o.momentum = args.sgd_momentum;
    o.weight_decay = args.weight_decay;
    optimizer_ = make_sgd(sharded_.root, o);
  }
  // Tensor parallelism: the gradient norm also sums over the TP group (replicated parameters
  // counted once).
  set_up_pipeline();
  set_model_parallel_norm(*sharded_.model, sharded_.root, *optimizer_, mesh_.split("pp"));
  if (!args.dump_param_to_param_group_map.empty()) write_param_group_map();
  const ParallelDims& d = mesh_.dims();
  if (print_ && d.world() > d.dp())
    log_ << " parallelism: " << d.describe() << " (Megatron's order: tensor-parallel ranks adjacent, then "
         << "context-parallel, then data-parallel); FSDP (" << args.data_parallel_sharding_strategy << ") shards over "
         << d.dp_cp() / d.dp_replicate << " ranks"
         << (d.tp > 1 ? std::string(args.sequence_parallel ? ", sequence parallel" : "") +
                            "; each tensor-parallel rank holds 1/" + std::to_string(d.tp) +
                            " of the heads, MLP and vocabulary"
                      : std::string())
         << (d.cp > 1 ? "; each context-parallel rank 2 of the " + std::to_string(2 * d.cp) +
                            " chunks of every sequence (attention by " +
                            (args.cp_comm_type == "p2p" ? "ring" : "all-gather") + ")"
                      : std::string())
         << "\n";
  if (print_) print_expert_buffers();
  if (print_)
    log_ << " loss: "
         << (args.cross_entropy_loss_fusion
                 ? "the output layer fused with it in chunks of " +
                       std::to_string(args.cross_entropy_chunk_elements > 0 ? args.cross_entropy_chunk_elements
                                                                            : kDefaultChunkElements) +
                       " logits elements (--cross-entropy-loss-fusion): no full logits"
                 : std::string("from the full logits (--no-cross-entropy-loss-fusion)"))
         << "\n";
  if (print_ && d.dp_replicate > 1) {
    log_ << " HSDP: " << d.dp_replicate << " instances of " << d.dp_cp() / d.dp_replicate << " consecutive "
         << (d.cp > 1 ? "data- x context-parallel" : "data-parallel")
         << (d.tp > 1 ? " ranks (of one tensor-parallel coordinate)" : " ranks")
         << "; each instance shards the model ("
         << args.data_parallel_sharding_strategy << "), "
         << (args.outer_dp_sharding_strategy == "optim"
                 ? "the instances split each shard's main weights, gradients and optimizer state (HFSDP)"
                 : "the instances replicate it and all-reduce its gradients")
         << (d.ep > 1 ? "; the experts likewise: " + std::to_string(d.dp_replicate) + " instances of " +
                            std::to_string(d.edp_shard()) + " expert-data-parallel ranks"
                      : std::string())
         << "\n";
  }
  schedule_.max_lr = args.lr;
  schedule_.min_lr = args.min_lr;
  schedule_.warmup_steps = args.lr_warmup_iters;
  schedule_.decay_steps = args.lr_decay_iters;
  schedule_.style = args.lr_decay_style;
}

namespace {

// The replica of a local checkpoint goes to the rank this far above: the ranks per node when the
// job spans nodes (a rank of the next node), else the next rank.
int local_checkpoint_replica_jump(int world_size) {
  const char* local = std::getenv("LOCAL_WORLD_SIZE");
  const int per_node = local != nullptr ? std::atoi(local) : 0;
  return per_node > 0 && per_node < world_size ? per_node : 1;
}

}  // namespace

bool TrainingRun::load_local_checkpoint(ResumePoint& resume) {
  if (args_.non_persistent_ckpt_type != "local" || args_.load.empty() || args_.ckpt_step >= 0 || args_.finetune ||
      args_.no_load_optim || args_.no_load_rng)
    return false;
  LocalCheckpointer from({args_.non_persistent_local_ckpt_dir, args_.load, local_checkpoint_replica_jump(comm_->size())},
                         comm_);
  std::string skipped;
  const std::optional<int64_t> newest = from.newest_valid(sharded_.root, *optimizer_, &skipped);
  if (print_ && !skipped.empty()) log_ << " local checkpoints not taken: " << skipped << "\n";
  const int64_t persistent = load_.reader ? load_.reader->metadata().value("iteration", int64_t{-1}) : -1;
  if (!newest || *newest <= persistent) {
    if (print_ && newest)
      log_ << " the local checkpoint of iteration " << *newest << " in " << from.job_dir()
           << " is not newer than --load's (iteration " << persistent << "): not taken\n";
    return false;
  }
  const auto begin = std::chrono::steady_clock::now();
  LocalCheckpointProgress got;
  try {
    got = from.load(*newest, sharded_.root, *optimizer_);
  } catch (const std::exception& e) {
    // What the failed load wrote, --load's checkpoint overwrites whole (model, optimizer,
    // generators); without one there is nothing to fall back to.
    if (!load_.reader) throw;
    if (print_)
      log_ << " WARNING: the local checkpoint of iteration " << *newest << " did not load (" << e.what()
           << "); loading --load's\n";
    return false;
  }
  reconcile_schedule(args_, got.extra.empty() ? nlohmann::json::object() : nlohmann::json::parse(got.extra), schedule_,
                     checkpoint_iteration_dir(from.job_dir(), got.iteration));
  if (got.consumed_samples != got.iteration * args_.global_batch_size)
    throw std::invalid_argument("local checkpoint of iteration " + std::to_string(got.iteration) + " in " +
                                from.job_dir() + ": " + std::to_string(got.consumed_samples) +
                                " samples consumed; resuming needs the same --global-batch-size");
  resume = {got.iteration, got.consumed_samples};
  if (print_)
    log_ << " loaded the non-persistent local checkpoint of iteration " << got.iteration << " from "
         << from.job_dir() << " (each rank's own file, or the replica a peer kept) in "
         << std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count()
         << " s; newer than --load's " << (persistent >= 0 ? "iteration " + std::to_string(persistent) : "(none)")
         << "; resuming after iteration " << got.iteration << "\n";
  load_ = {};
  return true;
}

void TrainingRun::report_restart(const ResumePoint& resume) {
  const int restart = restart_count_from_env();
  progress_.started(restart, resume.iteration);
  if (restart == 0) return;
  restart_cost_ = restart_cost(restart, resume.iteration, progress_);
  if (print_) log_ << restart_cost_->text() << "\n";
}

ResumePoint TrainingRun::start() {
  ResumePoint resume;
  if (load_local_checkpoint(resume)) {
  } else if (load_.reader || (!args_.load.empty() && hf_folder_.empty())) {
    resume = load_training_checkpoint(load_, args_, args_, config_, comm_, sharded_.root, *optimizer_, schedule_, log_,
                                      model_parallel_checkpoint_slices(*sharded_.model, sharded_.root));
    load_ = {};  // the reader keeps the checkpoint's files open
  } else if (!hf_folder_.empty()) {
    load_hf_shards(hf_folder_, sharded_.root, *comm_, model_parallel_checkpoint_slices(*sharded_.model, sharded_.root));
  }
  last_saved_ = resume.iteration;
  report_restart(resume);
  return resume;
}

namespace {

// Elements converted to fp64 at a time for a sum of squares (as the gradient norm does,
// src/optim/grad_clip.cpp): fp64 accuracy without a second copy of a whole shard.
constexpr int64_t kNormChunk = int64_t{1} << 20;

void add_squares(at::Tensor& acc, const at::Tensor& x) {
  for (int64_t start = 0; start < x.numel(); start += kNormChunk) {
    at::Tensor chunk = x.narrow(0, start, std::min(kNormChunk, x.numel() - start)).to(at::kDouble);
    acc.add_(at::dot(chunk, chunk));
  }
}

// The slice of `shards`' main gradients that holds parameter slice `s` (undefined for frozen
// parameters and empty slices).
at::Tensor grad_of(const LocalShard& s, const std::vector<OptimizerShard>& shards) {
  if (s.shard_index < 0 || s.local.numel() == 0) return {};
  return shards[static_cast<size_t>(s.shard_index)].main_grad.narrow(0, s.shard_offset, s.local.numel());
}

}  // namespace

at::Tensor to_device(const at::Tensor& host, const at::Device& device) {
  if (!device.is_cuda() || !host.device().is_cpu()) return host.to(device);
  // The pinned block is not reused before the copy has run (the host allocator records it).
  return host.pin_memory().to(device, /*non_blocking=*/true);
}

double TrainingRun::StepStats::loss_value() const {
  return loss_on_host ? *loss_on_host : read_on_host({loss})[0];
}

double TrainingRun::StepStats::grad_norm_value() const {
  return grad_norm_on_host ? *grad_norm_on_host : read_on_host({grad_norm})[0];
}

std::unique_ptr<DistributedOptimizer> TrainingRun::make_muon_optimizer(const PretrainArgs& args) const {
  MuonOptions o;
  o.momentum = args.muon_momentum;
  o.nesterov = args.muon_nesterov;
  o.ns_steps = static_cast<int>(args.muon_num_ns_steps);
  o.coefficient_type = args.muon_coefficient_type;
  o.scale_mode = args.muon_scale_mode;
  o.extra_scale_factor = args.muon_extra_scale_factor;
  o.ns_dtype = args.muon_fp32_matmul_prec == "high" ? at::kFloat : at::kBFloat16;
  o.weight_decay = args.weight_decay;  // Megatron's: --weight-decay on the matrices too
  o.adamw = adamw_options(args, comm_->device());
  if (const std::shared_ptr<Communicator> tp = sharded_.model->tensor_parallel()) {
    // Each rank's slices of the split matrices, put together whole over the group (or not, blockwise).
    o.tensor_parallel = tp;
    o.tp_mode = args.muon_tp_mode;
    for (const LocalShard& shard : sharded_.root.local_shards()) {
      const TensorParallelSplit split = sharded_.model->tensor_parallel_split(shard.name);
      if (split == TensorParallelSplit::kRows) o.tensor_parallel_split[shard.name] = 0;
      if (split == TensorParallelSplit::kColumns) o.tensor_parallel_split[shard.name] = 1;
    }
  }
  return make_muon(sharded_.root.optimizer_shards(), sharded_.root.optimizer_comm(), o,
                   sharded_.root.optimizer_step_hook());
}

void TrainingRun::set_up_pipeline() {
  const ParallelDims& d = mesh_.dims();
  if (d.pp == 1) return;
  pipeline_.forward = mesh_.get("pp");
  std::vector<int> stages(static_cast<size_t>(d.pp));
  for (int r = 0; r < d.pp; ++r) stages[static_cast<size_t>(r)] = r;
  pipeline_.backward = pipeline_.forward->new_group(stages, "pp_gradients");
  pipeline_.stages = d.pp;
  pipeline_.stage = mesh_.coordinate("pp");
  pipeline_.virtual_stages = static_cast<int>(sharded_.model->pipeline_chunks().size());
  // Each chunk's units, whose gradient sync follows that chunk's backwards: the layers of its
  // range (with their experts), and the units outside the layers (the embedding, lm_head, a tied
  // embedding's copy) in the chunk that runs them: the embedding's on the first stage, the
  // output layer's on the last (no stage holds both). The root runs in every backward and
  // reduces at the step's last.
  chunk_units_.assign(static_cast<size_t>(pipeline_.virtual_stages), {});
  const auto& chunks = sharded_.model->pipeline_chunks();
  int ends = -1;  // the chunk running the units outside the layers
  for (size_t c = 0; c < chunks.size(); ++c)
    if (chunks[c].embedding || chunks[c].output) ends = static_cast<int>(c);
  std::map<std::string, std::shared_ptr<torch::nn::Module>> modules;
  for (const auto& item : sharded_.model->named_modules("", /*include_self=*/false)) modules[item.key()] = item.value();
  for (const FsdpUnit& u : sharded_.model->parallel_plan().fsdp_units) {
    if (u.module.empty()) continue;
    int owner = u.layer < 0 ? ends : -1;
    for (size_t c = 0; c < chunks.size() && u.layer >= 0; ++c)
      if (u.layer >= chunks[c].first_layer && u.layer < chunks[c].first_layer + chunks[c].num_layers)
        owner = static_cast<int>(c);
    if (owner < 0)
      throw std::logic_error("TrainingRun: no pipeline chunk of stage " + std::to_string(pipeline_.stage) +
                             " runs the FSDP unit '" + u.module + "'");
    chunk_units_[static_cast<size_t>(owner)].push_back(handle_of(*modules.at(u.module)));
  }
  // Megatron's tensor_shape: [micro-batch, sequence / CP (/ TP with sequence parallelism), hidden]
  // in this repository's [B, T, H] order, in the dtype the model computes in.
  const int64_t tokens = args_.seq_length / d.cp / (d.sequence_parallel ? d.tp : 1);
  pipeline_.activation_shape = {args_.micro_batch_size, tokens, config_.hidden_size()};
  at::ScalarType dtype = at::kFloat;
  for (const at::Tensor& p : sharded_.model->parameters()) {
    dtype = p.scalar_type();
    break;
  }
  pipeline_.activation_options = at::TensorOptions().dtype(dtype).device(comm_->device());
  pipeline_.variable_shapes = args_.variable_seq_lengths;
  // Megatron's embedding group: the first and last stages of each pipeline, where the two copies
  // of a tied embedding live. new_group is collective over the world: the stages between take a
  // group of their own.
  if (!sharded_.model->tied_embedding().empty()) {
    const std::vector<int> pipeline = mesh_.group_ranks("pp");
    const bool end = pipeline_.stage == 0 || pipeline_.stage == d.pp - 1;
    embedding_group_ = comm_->new_group(end ? std::vector<int>{pipeline.front(), pipeline.back()}
                                            : std::vector<int>{comm_->rank()},
                                        "embedding");
    if (!end) embedding_group_ = nullptr;
  }
}

void TrainingRun::sum_tied_embedding_gradients() {
  if (!embedding_group_) return;
  at::NoGradGuard no_grad;
  const std::string name = sharded_.model->tied_embedding();
  const std::vector<OptimizerShard> shards = sharded_.root.optimizer_shards();
  // Each end's embedding weight is a unit of its own, so both hold the same elements of it.
  for (const LocalShard& p : sharded_.root.local_shards())
    if (p.name == name && p.shard_index >= 0) {
      at::Tensor g = shards[static_cast<size_t>(p.shard_index)].main_grad.narrow(0, p.shard_offset, p.local.numel());
      embedding_group_->all_reduce(g);
    }
}

void TrainingRun::begin_step(int64_t iteration, int64_t micro_batches) {
  profiler_.before_step(iteration);
  // The balancing losses are averaged over the micro-batches (and, with per-token losses, whose
  // gradients are summed over the data- and context-parallel ranks, over those too; the
  // tensor-parallel ranks hold parts of the same losses), as the language-model loss is.
  sharded_.model->set_aux_loss_scale(
      1.0 / static_cast<double>(micro_batches * (per_token_loss_ ? mesh_.dims().dp_cp() : 1)));
  sharded_.model->take_router_stats();  // drop what evaluation or generation routed
  step_generators_.clear();
  if (validates_results()) {
    // A rerun draws what this step drew (dropout): the generators' states now.
    at::Generator cpu = at::detail::getDefaultCPUGenerator();
    step_generators_.emplace_back(cpu, cpu.get_state());
    if (comm_->device().is_cuda()) {
      at::Generator cuda = at::globalContext().defaultGenerator(comm_->device());
      step_generators_.emplace_back(cuda, cuda.get_state());
    }
  }
}

TrainingRun::StepStats TrainingRun::step(int64_t iteration, int64_t micro_batches,
                                         const std::function<at::Tensor(int64_t)>& micro_batch) {
  if (pipeline_.forward)
    throw std::logic_error("TrainingRun::step: under pipeline parallelism the trainer runs pipeline_step");
  begin_step(iteration, micro_batches);
  // The reported losses summed on the device: reading each one would hold the host until the
  // device has run its forward, every micro-batch. A NaN or Inf in any makes the sum non-finite.
  const auto run = [&] {
    at::Tensor loss = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(comm_->device()));
    for (int64_t m = 0; m < micro_batches; ++m) {
      sharded_.root.set_requires_gradient_sync(m == micro_batches - 1);
      loss.add_(micro_batch(m).detach().to(loss.device(), at::kDouble));
    }
    return loss;
  };
  return finish_step(iteration, run(), run);
}

TrainingRun::StepStats TrainingRun::pipeline_step(int64_t iteration, int64_t micro_batches,
                                                  const ChunkForward& forward) {
  if (!pipeline_.forward) throw std::logic_error("TrainingRun::pipeline_step: no pipeline parallelism");
  begin_step(iteration, micro_batches);
  PipelineTimes times;
  // Gradient sync per unit (not recursive): a chunk's units reduce after its last backward, the
  // root (with its own parameters) after the step's.
  const auto before_backward = [&](int chunk, bool last_of_chunk, bool last_of_step) {
    sharded_.root.set_requires_gradient_sync(last_of_step, /*recurse=*/false);
    for (FsdpHandle& u : chunk_units_[static_cast<size_t>(chunk)]) u.set_requires_gradient_sync(last_of_chunk, false);
  };
  const auto run = [&] {
    at::Tensor loss =
        run_pipeline(pipeline_, pipeline_schedule(pipeline_, micro_batches), before_backward, forward, &times);
    sum_tied_embedding_gradients();
    return loss;
  };
  StepStats s = finish_step(iteration, run(), run);
  s.pipeline = times;
  return s;
}

TrainingRun::StepStats TrainingRun::finish_step(int64_t iteration, at::Tensor loss,
                                                const std::function<at::Tensor()>& rerun) {
  // Megatron's finalize_model_grads: gradients each tensor-parallel rank holds only part of.
  sum_partial_gradients(*sharded_.model, sharded_.root);
  StepStats s;
  collect_router_stats(s);
  {
    RECORD_USER_SCOPE("mfsdp::clip_grad_norm");
    s.grad_norm = optimizer_->clip_grad_norm_on_device(args_.clip_grad);  // a non-finite norm leaves the grads as they are
  }
  s.loss = loss;
  // The step's only host read, and only with the NaN check (or result validation): the loss and
  // the norm with their flags.
  if (validates_results())
    validate_step(iteration, s, rerun);
  else if (args_.check_for_nan_in_loss_and_grad)
    check_finite(iteration, s);
  // Megatron's finalize_model_grads: the aux-loss-free biases move by this step's global counts
  // (after validation, which may run the step again from the biases as they were).
  for (const StepStats::MoeLayer& m : s.moe_layers) sharded_.model->update_expert_bias(m.layer, m.tokens_per_expert);
  // Megatron's diagnostics, summed over the ranks in one all-reduce, each element counted once
  // (on its replica 0 under no_shard): zero gradient elements after clipping, before the step;
  // the sum of squares of the parameters (main weights) after it.
  const bool norms = args_.log_params_norm || args_.log_num_zeros_in_grad;
  // Each element once over the ranks: on its replica 0, and a parameter every tensor-parallel
  // rank holds the same on TP rank 0 only.
  // The last pipeline stage's copy of a tied embedding is counted on the first stage.
  const bool tp_duplicates_here = mesh_.dims().tp > 1 && mesh_.coordinate("tp") != 0;
  const std::string embedding_copy = sharded_.model->embedding_copy();
  auto counted = [&](const LocalShard& p) {
    return p.replica == 0 && p.name != embedding_copy &&
           !(tp_duplicates_here && tensor_parallel_duplicate(*sharded_.model, p.name));
  };
  at::Tensor sums;
  if (norms) {
    at::NoGradGuard no_grad;
    sums = at::zeros({2}, at::TensorOptions().dtype(at::kDouble).device(comm_->device()));
    if (args_.log_num_zeros_in_grad) {
      const std::vector<OptimizerShard> shards = sharded_.root.optimizer_shards();
      for (const LocalShard& p : sharded_.root.local_shards())
        if (at::Tensor g = grad_of(p, shards); g.defined() && counted(p))
          sums[0].add_(g.numel() - at::count_nonzero(g));
    }
  }
  s.lr = schedule_.lr_at(iteration);
  {
    RECORD_USER_SCOPE("mfsdp::optimizer_step");
    optimizer_->step(s.lr);
  }
  sharded_.root.zero_grad();
  if (norms) {
    at::NoGradGuard no_grad;
    if (args_.log_params_norm) {
      at::Tensor squares = sums.narrow(0, 1, 1);
      for (const LocalShard& p : sharded_.root.local_shards())
        if (counted(p)) add_squares(squares, p.local);
    }
    comm_->all_reduce(sums, {ReduceOp::kSum});
    const at::Tensor host = sums.cpu();
    s.num_zeros_in_grad = static_cast<int64_t>(std::llround(host[0].item<double>()));
    s.params_norm = std::sqrt(host[1].item<double>());
  }
  profiler_.after_step(iteration);
  return s;
}

namespace {

using TensorShapes = std::vector<std::pair<std::string, std::vector<int64_t>>>;

// The NaN and Inf counts of `slice(param)` of this rank's `params` into counts[2i] and
// counts[2i + 1], i being the parameter's place in `all` (every tensor of the model, the same list
// on every rank: under expert parallelism ranks hold different experts); each element is counted
// once over the ranks (on its replica 0).
void count_non_finite(const std::vector<LocalShard>& params, const TensorShapes& all,
                      const std::function<at::Tensor(const LocalShard&)>& slice, at::Tensor counts) {
  std::map<std::string, int64_t> index;
  for (size_t i = 0; i < all.size(); ++i) index[all[i].first] = static_cast<int64_t>(i);
  for (const LocalShard& p : params) {
    if (p.replica != 0) continue;
    const at::Tensor t = slice(p);
    if (!t.defined() || t.numel() == 0) continue;
    const auto it = index.find(p.name);
    if (it == index.end()) throw std::logic_error("count_non_finite: the model has no tensor '" + p.name + "'");
    const int64_t i = it->second;
    counts[2 * i] += static_cast<double>(t.isnan().sum().item<int64_t>());
    counts[2 * i + 1] += static_cast<double>(t.isinf().sum().item<int64_t>());
  }
}

// "N parameters: name (a NaN, b Inf of n), ..." of the tensors of `params` with non-zero counts
// (the first 20 named); empty when there are none.
std::string list_non_finite(const TensorShapes& params, const double* counts) {
  constexpr int kMaxListed = 20;
  std::ostringstream names;
  int found = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const double nans = counts[2 * i], infs = counts[2 * i + 1];
    if (nans + infs == 0) continue;
    if (++found > kMaxListed) continue;
    int64_t numel = 1;
    for (int64_t d : params[i].second) numel *= d;
    names << (found > 1 ? ", " : "") << params[i].first << " (" << static_cast<int64_t>(nans) << " NaN, "
          << static_cast<int64_t>(infs) << " Inf of " << numel << ")";
  }
  if (found == 0) return "";
  if (found > kMaxListed) names << ", and " << found - kMaxListed << " more";
  return std::to_string(found) + (found > 1 ? " parameters: " : " parameter: ") + names.str();
}

const char* const kNanCheckEnd =
    " (--check-for-nan-in-loss-and-grad; --no-check-for-nan-in-loss-and-grad trains on)";

}  // namespace

void TrainingRun::check_finite(int64_t iteration, StepStats& s) {
  at::NoGradGuard no_grad;
  const int world = comm_->size();
  // One all-reduce of a flag per rank for its loss, read in one copy with this rank's loss and
  // the norm (all-reduced already, so every rank then takes the same branch). Only when the norm
  // is not finite, a second one: the NaN and Inf counts of every parameter's gradient, to name
  // them (a failing step, so its extra read costs nothing that matters).
  at::Tensor flags = at::isfinite(s.loss).logical_not().to(at::kDouble).reshape({1});
  at::Tensor counts = at::zeros({world}, flags.options());
  counts.narrow(0, comm_->rank(), 1).copy_(flags);
  comm_->all_reduce(counts, {ReduceOp::kSum});
  const std::vector<double> read = read_on_host({s.loss, s.grad_norm, counts});
  s.loss_on_host = read[0];
  s.grad_norm_on_host = read[1];
  const double grad_norm = read[1];
  const bool grads_finite = std::isfinite(grad_norm);
  const at::Tensor host_counts = at::tensor(std::vector<double>(read.begin() + 2, read.end()), at::kDouble);
  TensorShapes all;
  if (!grads_finite) all = model_tensor_shapes(config_);
  const int64_t params = 2 * static_cast<int64_t>(all.size());
  at::Tensor param_counts = at::zeros({params}, counts.options());
  if (!grads_finite) {
    const std::vector<OptimizerShard> shards = sharded_.root.optimizer_shards();
    count_non_finite(sharded_.root.local_shards(), all, [&](const LocalShard& p) { return grad_of(p, shards); },
                     param_counts);
    comm_->all_reduce(param_counts, {ReduceOp::kSum});
  }
  const at::Tensor host = at::cat({host_counts, param_counts.cpu()});
  const double* c = host.data_ptr<double>();

  std::string ranks;
  for (int r = 0; r < world; ++r)
    if (c[r] > 0) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  if (ranks.empty() && grads_finite) return;
  std::ostringstream why;
  why << "iteration " << iteration << ": ";
  if (!ranks.empty()) why << "the loss is NaN or Inf on rank " << ranks << " of " << world;
  if (!grads_finite) {
    why << (ranks.empty() ? "" : "; ") << "the gradients are not finite (grad norm " << grad_norm << ")";
    if (const std::string list = list_non_finite(all, c + world); !list.empty())
      why << " in the shards of " << list;
  }
  why << ". Stopped before the optimizer step; nothing of this iteration was saved" << kNanCheckEnd;
  throw NonFiniteError(why.str());
}

bool TrainingRun::validates_results() const {
  if (spikes_.empty()) return false;  // not mfsdp-pretrain
  return args_.check_for_spiky_loss || (rerun_mode_ != RerunMode::kDisabled && args_.check_for_nan_in_loss_and_grad);
}

std::vector<double> TrainingRun::read_rank_losses(StepStats& s) {
  at::NoGradGuard no_grad;
  // Each rank's loss at its own element of a sum: a NaN stays where it was.
  at::Tensor all = at::zeros({comm_->size()}, at::TensorOptions().dtype(at::kDouble).device(comm_->device()));
  all.narrow(0, comm_->rank(), 1).copy_(s.loss.reshape({1}));
  comm_->all_reduce(all, {ReduceOp::kSum});
  const std::vector<double> read = read_on_host({s.loss, s.grad_norm, all});
  s.loss_on_host = read[0];
  s.grad_norm_on_host = read[1];
  return std::vector<double>(read.begin() + 2, read.end());
}

namespace {

std::string number_text(double v) {
  char text[40];
  std::snprintf(text, sizeof text, "%.17g", v);  // every bit: two results may differ in the last
  return text;
}

}  // namespace

void TrainingRun::validate_step(int64_t iteration, StepStats& s, const std::function<at::Tensor()>& rerun) {
  const bool nan_check = args_.check_for_nan_in_loss_and_grad;
  const std::vector<double> losses = read_rank_losses(s);
  std::vector<double> final_losses = losses;  // the rerun's, when there is one: the step's results
  // Megatron's checks on each rank's loss, in its order: the NaN check (where an injected failure
  // lands when it is on), then the spike rule. Every rank evaluates every rank's, alike.
  struct Failed {
    int rank;
    std::string what;
    bool fatal;
    double value;
  };
  std::vector<Failed> failed;
  const bool validating = rerun_mode_ == RerunMode::kValidateResults && first_step_validated_;
  for (int r = 0; r < comm_->size(); ++r) {
    const double v = losses[static_cast<size_t>(r)];
    ErrorInjector& injector = injectors_[static_cast<size_t>(r)];
    const bool injected = validating && injector.maybe_inject();
    const bool non_finite = nan_check && !std::isfinite(v);
    // Megatron's order: nothing is checked on a run's first step, and an injected failure stands
    // for the check (the loss is then not sampled). A zero is no loss (a pipeline stage without
    // the output layer).
    const bool spike = args_.check_for_spiky_loss && first_step_validated_ && !injected && v != 0 &&
                       spikes_[static_cast<size_t>(r)].is_spike(v);
    if (injected || non_finite)
      failed.push_back({r, injected ? injector.description() : "the loss is NaN or Inf", injected ? nan_check : true, v});
    else if (spike)
      failed.push_back({r, "Spiky loss (at least 10x the largest of its first 100, " +
                               number_text(spikes_[static_cast<size_t>(r)].reference()) + ")", false, v});
  }
  const bool report = rerun_mode_ == RerunMode::kReportStats && first_step_validated_;
  first_step_validated_ = true;
  if ((validating && !failed.empty()) || report) {
    // The step again, from the same weights (the optimizer has not stepped), data and generators.
    sharded_.root.zero_grad();
    for (auto& [gen, state] : step_generators_) {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(state);
    }
    sharded_.model->take_router_stats();
    StepStats again;
    at::Tensor loss = rerun();
    sum_partial_gradients(*sharded_.model, sharded_.root);
    collect_router_stats(again);
    again.grad_norm = optimizer_->clip_grad_norm_on_device(args_.clip_grad);
    again.loss = loss;
    again.pipeline = s.pipeline;
    const std::vector<double> second = read_rank_losses(again);
    s = again;
    final_losses = second;
    if (report) {
      double largest = 0;
      for (size_t r = 0; r < losses.size(); ++r) largest = std::max(largest, compare_results(losses[r], second[r]));
      determinism_.record(largest);
      if (print_ && iteration % args_.log_interval == 0)
        log_ << " result validation (--rerun-mode report_stats): " << determinism_.summary() << "\n";
    }
    for (const Failed& f : validating ? failed : std::vector<Failed>{}) {
      const double rerun_value = second[static_cast<size_t>(f.rank)];
      const double comparison =
          injectors_[static_cast<size_t>(f.rank)].rerun_comparison(compare_results(f.value, rerun_value));
      const std::string where = "iteration " + std::to_string(iteration) + ": the loss of rank " +
                                std::to_string(f.rank) + " failed validation (" + f.what + "; loss " +
                                number_text(f.value) + ") and its rerun gave " + number_text(rerun_value);
      if (comparison > 0) {
        // Megatron's "First rerun: unexpected result is not reproducible": the device is suspect.
        if (comm_->rank() == f.rank)
          std::cerr << "Rank " << f.rank << ", node " << host_name() << ", device " << comm_->device().str()
                    << ", iteration #" << iteration << ": unexpected result is not reproducible ("
                    << number_text(rerun_value) << " != " << number_text(f.value) << "). Possible transient error!"
                    << std::endl;
        if (f.fatal)
          throw ResultValidationExit(
              kExitFailedOnResultValidation,
              where + ": not reproducible, a possible transient error of rank " + std::to_string(f.rank) +
                  "'s device (a suspected faulty device: exit " + std::to_string(kExitFailedOnResultValidation) +
                  ", Megatron's EXIT_CODE_FAILED_ON_RESULT_VALIDATION). Stopped before the optimizer step; "
                  "the job can resume from its last checkpoint on other hardware");
        if (print_) log_ << " WARNING: " << where << ": not reproducible, a possible transient error of rank " << f.rank
                         << "'s device; training goes on with the rerun's result\n";
      } else if (f.fatal) {
        throw NonFiniteError(where + ", the same: a real divergence, not a device fault (--rerun-mode "
                             "validate_results). Stopped before the optimizer step; nothing of this iteration was saved" +
                             std::string(kNanCheckEnd));
      } else if (print_) {
        log_ << " WARNING: " << where << ", the same: the spike is the data's or the model's, not the device's\n";
      }
    }
  } else if (print_) {
    for (const Failed& f : failed)
      if (!f.fatal)  // Megatron's spike check is not fatal: a warning where nothing reruns it
        log_ << " WARNING: rank " << f.rank << ", iteration " << iteration << ": " << f.what << ": "
             << number_text(f.value) << "\n";
  }
  if (!nan_check) return;
  bool finite = std::isfinite(*s.grad_norm_on_host);
  for (double v : final_losses) finite = finite && std::isfinite(v);
  if (!finite) check_finite(iteration, s);  // names the ranks and parameters, and throws
}

void TrainingRun::check_finite_weights(int64_t iteration) {
  at::NoGradGuard no_grad;
  const TensorShapes all = model_tensor_shapes(config_);
  at::Tensor counts = at::zeros({2 * static_cast<int64_t>(all.size())}, at::kDouble);
  count_non_finite(sharded_.root.local_shards(), all, [](const LocalShard& p) { return p.local; }, counts);
  at::Tensor reduced = counts.to(comm_->device());
  comm_->all_reduce(reduced, {ReduceOp::kSum});
  reduced = reduced.cpu();
  const std::string list = list_non_finite(all, reduced.data_ptr<double>());
  if (list.empty()) return;
  throw NonFiniteError("iteration " + std::to_string(iteration) +
                       ": the weights are not finite after the optimizer step in the shards of " + list +
                       ". The checkpoint of this iteration was not saved" + kNanCheckEnd);
}

void TrainingRun::print_expert_buffers() const {
  // This rank's main-weight bytes.
  int64_t experts = 0, dense = 0;
  for (const LocalShard& p : sharded_.root.local_shards())
    (p.name.find(".experts.") != std::string::npos ? experts : dense) += p.local.numel() * p.local.element_size();
  if (experts == 0) return;
  const int dp = mesh_.dims().dp_cp() / mesh_.dims().dp_replicate, ep = mesh_.dims().ep;
  const int edp = mesh_.dims().edp_shard();
  char line[400];
  std::snprintf(line, sizeof line,
                " MoE buffers of rank 0: expert main weights %.3f MiB (experts split over %d expert-parallel "
                "rank(s), sharded over %d expert-data-parallel rank(s)), dense main weights %.3f MiB (sharded over %d "
                "rank(s)); gradients and optimizer state in proportion (--data-parallel-sharding-strategy %s)\n",
                experts / 1048576.0, ep, edp, dense / 1048576.0, dp,
                args_.data_parallel_sharding_strategy.c_str());
  log_ << line;
}

void TrainingRun::collect_router_stats(StepStats& s) {
  const std::vector<std::pair<int64_t, RouterStats>> local = sharded_.model->take_router_stats();
  if (local.empty()) return;
  // One all-reduce: per layer [balancing sum, z sum, forwards, tokens per expert...].
  std::vector<double> packed;
  for (const auto& [layer, r] : local) {
    packed.insert(packed.end(), {r.load_balancing_loss, r.z_loss, static_cast<double>(r.forwards)});
    packed.insert(packed.end(), r.tokens_per_expert.begin(), r.tokens_per_expert.end());
  }
  at::Tensor t = at::tensor(packed, at::kDouble).to(comm_->device());
  comm_->all_reduce(t);
  t = t.cpu();
  const double* v = t.data_ptr<double>();
  size_t at = 0;
  double forwards_total = 0;
  for (const auto& [layer, r] : local) {
    StepStats::MoeLayer m;
    m.layer = layer;
    const double forwards = std::max(1.0, v[at + 2]);
    m.load_balancing_loss = v[at] / forwards;
    m.z_loss = v[at + 1] / forwards;
    for (size_t j = 0; j < r.tokens_per_expert.size(); ++j) m.tokens_per_expert.push_back(std::llround(v[at + 3 + j]));
    at += 3 + r.tokens_per_expert.size();
    s.load_balancing_loss += v[at - 3 - r.tokens_per_expert.size()];
    s.z_loss += v[at - 2 - r.tokens_per_expert.size()];
    forwards_total += forwards;
    s.moe_layers.push_back(std::move(m));
  }
  s.load_balancing_loss /= forwards_total;
  s.z_loss /= forwards_total;
}

std::string TrainingRun::norms_log_text(const StepStats& stats) const {
  std::string text;
  char buf[96];
  if (!stats.moe_layers.empty()) {
    std::snprintf(buf, sizeof buf, " | load_balancing_loss: %.6E | z_loss: %.6E", stats.load_balancing_loss,
                  stats.z_loss);
    text += buf;
  }
  if (args_.log_num_zeros_in_grad) {
    std::snprintf(buf, sizeof buf, " | num zeros: %lld", static_cast<long long>(stats.num_zeros_in_grad));
    text += buf;
  }
  if (args_.log_params_norm) {
    std::snprintf(buf, sizeof buf, " | params norm: %.3f", stats.params_norm);
    text += buf;
  }
  return text;
}

void TrainingRun::add_norms(IterationRecord& r, const StepStats& stats) const {
  if (args_.log_num_zeros_in_grad)
    r.extra.emplace_back("num_zeros_in_grad", static_cast<double>(stats.num_zeros_in_grad));
  if (args_.log_params_norm) r.extra.emplace_back("params_norm", stats.params_norm);
  if (stats.moe_layers.empty()) return;
  r.extra.emplace_back("load_balancing_loss", stats.load_balancing_loss);
  r.extra.emplace_back("z_loss", stats.z_loss);
  if (!args_.moe_per_layer_logging) return;
  for (const StepStats::MoeLayer& m : stats.moe_layers) {
    const std::string layer = "layer_" + std::to_string(m.layer);
    r.extra.emplace_back("load_balancing_loss/" + layer, m.load_balancing_loss);
    r.extra.emplace_back("z_loss/" + layer, m.z_loss);
    for (size_t j = 0; j < m.tokens_per_expert.size(); ++j)
      r.extra.emplace_back("tokens_per_expert/" + layer + "/expert_" + std::to_string(j),
                           static_cast<double>(m.tokens_per_expert[j]));
  }
}

void TrainingRun::record(const IterationRecord& given) {
  IterationRecord r = given;
  if (restart_cost_ && !r.eval) {
    // The first record after a restart says what the failure cost.
    r.extra.emplace_back("restart", restart_cost_->restart);
    if (restart_cost_->lost_iterations)
      r.extra.emplace_back("lost_iterations", static_cast<double>(*restart_cost_->lost_iterations));
    if (restart_cost_->seconds_since_failure) r.extra.emplace_back("restart_seconds", *restart_cost_->seconds_since_failure);
    restart_cost_.reset();
  }
  metrics_.write(r);
  tensorboard_.write(r, args_.tensorboard_log_interval);
  history_.push_back(r);
}

// Megatron's two groups: weight decay (matrices) and none (biases, norms: 1-D), the policy of
// the optimizers (include/mfsdp/optim/optim.h). Rank 0 writes; every rank waits for it.
void TrainingRun::write_param_group_map() {
  if (comm_->rank() == 0) {
    // Every parameter of the model (under expert parallelism rank 0 holds only its experts);
    // buffers are in no optimizer group.
    std::set<std::string> buffers;
    for (const auto& [name, b] : sharded_.root.buffers()) buffers.insert(name);
    std::map<std::string, int> groups;
    for (const auto& [name, shape] : model_tensor_shapes(config_))
      if (!buffers.count(name)) groups[name] = shape.size() >= 2 ? 0 : 1;
    write_param_to_param_group_map(args_.dump_param_to_param_group_map, groups);
    if (print_)
      log_ << " wrote the parameter -> optimizer group map of " << groups.size() << " parameters to "
           << args_.dump_param_to_param_group_map << "\n";
  }
  comm_->barrier();
}

void TrainingRun::save(int64_t iteration) {
  if (args_.check_for_nan_in_loss_and_grad) check_finite_weights(iteration);
  save_training_checkpoint(args_, config_, comm_, sharded_.root, *optimizer_, schedule_, iteration, log_, tool_,
                           model_parallel_checkpoint_slices(*sharded_.model, sharded_.root));
  last_saved_ = iteration;
}

void TrainingRun::save_non_persistent(int64_t iteration) {
  if (args_.check_for_nan_in_loss_and_grad) check_finite_weights(iteration);
  if (args_.non_persistent_ckpt_type == "global") {
    save_non_persistent_global_checkpoint(args_, config_, comm_, sharded_.root, *optimizer_, schedule_, iteration, log_,
                                          tool_, model_parallel_checkpoint_slices(*sharded_.model, sharded_.root));
    return;
  }
  if (!local_)
    local_ = std::make_unique<LocalCheckpointer>(
        LocalCheckpointOptions{args_.non_persistent_local_ckpt_dir, args_.save,
                               local_checkpoint_replica_jump(comm_->size())},
        comm_);
  const auto begin = std::chrono::steady_clock::now();
  local_->save({iteration, iteration * args_.global_batch_size, lr_schedule_json(schedule_).dump()}, sharded_.root,
               *optimizer_);
  if (print_) {
    char line[256];
    std::snprintf(line, sizeof line, " local checkpoint of iteration %lld staged in %.3f s (%.2f MiB per rank)",
                  static_cast<long long>(iteration),
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count(),
                  local_->staged_bytes() / 1048576.0);
    log_ << line << ", being written to " << local_->job_dir() << " in the background, with a peer's replica\n";
  }
}

namespace {
// When this process started (its static objects are made before main), which
// --exit-duration-in-mins counts from, as Megatron counts from its program's start.
const std::chrono::steady_clock::time_point kProcessStart = std::chrono::steady_clock::now();
}  // namespace

std::string TrainingRun::stop_reason() {
  if (!args_.exit_signal_handler && args_.exit_duration_in_mins <= 0) return "";
  // Megatron's: the signal flag and the minutes run, the maximum over the ranks, in one all-reduce.
  const double minutes = std::chrono::duration<double>(std::chrono::steady_clock::now() - kProcessStart).count() / 60;
  at::Tensor t = at::tensor({static_cast<double>(received_exit_signal()), minutes}, at::kDouble).to(comm_->device());
  comm_->all_reduce(t, {ReduceOp::kMax});
  t = t.cpu();
  const int signal = static_cast<int>(t[0].item<double>());
  if (args_.exit_signal_handler && signal != 0)
    return std::string("after receiving ") + (signal == SIGINT ? "SIGINT" : "SIGTERM") + " (--exit-signal-handler)";
  if (args_.exit_duration_in_mins > 0 && t[1].item<double>() > args_.exit_duration_in_mins) {
    char why[128];
    std::snprintf(why, sizeof why, "after %.2f minutes (--exit-duration-in-mins %g)", t[1].item<double>(),
                  args_.exit_duration_in_mins);
    return why;
  }
  return "";
}

bool TrainingRun::after_iteration(int64_t it) {
  poll_training_checkpoints(comm_, log_);  // --async-save: commits a save whose writers are done (collective)
  if (!args_.save.empty() && args_.save_interval > 0 && it % args_.save_interval == 0)
    save(it);
  else if (args_.non_persistent_save_interval > 0 && it % args_.non_persistent_save_interval == 0)
    save_non_persistent(it);  // Megatron's: where a persistent save is not due
  progress_.finished(it);
  std::string why = stop_reason();
  if (why.empty() && args_.exit_interval > 0 && it % args_.exit_interval == 0)
    why = "(--exit-interval " + std::to_string(args_.exit_interval) + ")";
  // The last iteration ends the run anyway, with its own save.
  if (why.empty() || it == args_.train_iters) return false;
  if (!args_.save.empty() && last_saved_ != it) save(it);
  if (local_) local_->wait();
  finish_training_checkpoints(comm_, log_);  // --async-save: the exit waits for the last save
  if (print_) log_ << " exiting at iteration " << it << " " << why << "\n";
  return true;
}

double TrainingRun::all_reduce_mean(double value) const {
  at::Tensor t = at::full({1}, value, at::TensorOptions().dtype(at::kDouble).device(comm_->device()));
  comm_->all_reduce(t, {ReduceOp::kAvg});
  return t.item<double>();
}

double TrainingRun::all_reduce_sum(double value) const {
  at::Tensor t = at::full({1}, value, at::TensorOptions().dtype(at::kDouble).device(comm_->device()));
  comm_->all_reduce(t, {ReduceOp::kSum});
  return t.item<double>();
}

double TrainingRun::all_reduce_max(double value) const {
  at::Tensor t = at::full({1}, value, at::TensorOptions().dtype(at::kDouble).device(comm_->device()));
  comm_->all_reduce(t, {ReduceOp::kMax});
  return t.item<double>();
}

RolloutModel& TrainingRun::rollout_model() {
  if (!rollout_)
    rollout_ = std::make_unique<RolloutModel>(config_, comm_->device(), args_.attention_backend != "unfused",
                                              moe_training_from_args(args_));
  return *rollout_;
}

RolloutModel& TrainingRun::load_rollout_model() {
  RolloutModel& copy = rollout_model();
  if (!mesh_.split("tp") && !sharded_.expert_parallel && !pipeline_.forward)
    copy.load_from(sharded_.root);
  else
    copy.load_from(gather_full_weights(/*all_ranks=*/true, /*cpu_offload=*/true));
  return copy;
}

namespace {

// Gives every rank of `group` each tensor of the model some of its ranks lack (experts under
// expert parallelism, layers under pipeline parallelism): the holder with the highest rank
// broadcasts it, in the model's parameter order. Collective over the group.
void fill_from_holders(Communicator& group, const ModelConfig& config, std::map<std::string, at::Tensor>& full) {
  const auto shapes = model_tensor_shapes(config);
  const auto device = group.device();
  const at::Device home = full.empty() ? at::Device(at::kCPU) : full.begin()->second.device();
  at::Tensor owner = at::zeros({static_cast<int64_t>(shapes.size())}, at::TensorOptions().dtype(at::kLong));
  for (size_t i = 0; i < shapes.size(); ++i)
    if (full.count(shapes[i].first)) owner[static_cast<int64_t>(i)] = group.rank() + 1;
  at::Tensor highest = owner.to(device, /*non_blocking=*/false, /*copy=*/true), lowest = owner.to(device, false, true);
  group.all_reduce(highest, {ReduceOp::kMax});
  lowest.neg_();
  group.all_reduce(lowest, {ReduceOp::kMax});  // -min
  highest = highest.cpu();
  lowest = lowest.cpu();
  for (size_t i = 0; i < shapes.size(); ++i) {
    const auto& [name, shape] = shapes[i];
    if (-lowest[static_cast<int64_t>(i)].item<int64_t>() > 0) continue;  // every rank has it
    const int from = static_cast<int>(highest[static_cast<int64_t>(i)].item<int64_t>()) - 1;
    if (from < 0) throw std::logic_error("gather_full_weights: no rank holds '" + name + "'");
    at::Tensor t = group.rank() == from ? full.at(name).to(device).contiguous()
                                        : at::empty(shape, at::TensorOptions().dtype(at::kFloat).device(device));
    group.broadcast(t, {from});
    full[name] = t.to(home);
  }
}

}  // namespace

std::map<std::string, at::Tensor> TrainingRun::gather_full_weights(bool all_ranks, bool cpu_offload) const {
  // Without expert or pipeline parallelism rank 0 alone may gather; with either every rank takes
  // part. Tensor parallelism: every rank its whole slices, then the slices of each TP group
  // gathered (each tensor sent to the device and back to the map's device: one at a time there).
  const bool every_rank = all_ranks || sharded_.expert_parallel != nullptr || pipeline_.forward != nullptr;
  std::map<std::string, at::Tensor> full =
      mesh_.split("tp")
          ? gather_tensor_parallel(*sharded_.model, sharded_.root.full_state_dict(FullStateDictOptions{true, cpu_offload}))
          : sharded_.root.full_state_dict(FullStateDictOptions{every_rank, cpu_offload});
  // Each expert is on one rank of the expert-parallel group, each layer on one pipeline stage.
  if (sharded_.expert_parallel) fill_from_holders(*sharded_.expert_parallel, config_, full);
  if (pipeline_.forward) fill_from_holders(*pipeline_.forward, config_, full);
  return full;
}

namespace {

// --export-hf: config.json + model.safetensors (fp32, or bf16 with --bf16) and, for a
// HuggingFaceTokenizer, its tokenizer files, so transformers loads the folder as it is.
void export_hf_folder(const CheckpointSection& a, const TokenizerSection& tokenizer, bool bf16,
                      const ModelConfig& config, const std::map<std::string, at::Tensor>& state, std::ostream& log) {
  namespace fs = std::filesystem;
  if (const std::string refusal = config.spec->hf_export_refusal(config); !refusal.empty())
    throw std::invalid_argument("--export-hf: " + refusal);
  const at::ScalarType dtype = bf16 ? at::kBFloat16 : at::kFloat;
  fs::create_directories(a.export_hf);
  {
    std::ofstream out(a.export_hf + "/config.json", std::ios::trunc);
    if (!out) throw std::runtime_error("--export-hf: cannot write '" + a.export_hf + "/config.json'");
    out << config.spec->hf_config(config, dtype).dump(2) << "\n";
  }
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& [name, t] : state) tensors.emplace_back(name, t.to(dtype));
  write_safetensors(a.export_hf + "/model.safetensors", tensors, {{"format", "pt"}});
  if (tokenizer.tokenizer_type == "HuggingFaceTokenizer") {
    const fs::path from = fs::is_directory(tokenizer.tokenizer_model) ? fs::path(tokenizer.tokenizer_model)
                                                                      : fs::path(tokenizer.tokenizer_model).parent_path();
    // transformers 5 keeps the chat template in chat_template.jinja, older ones in
    // chat_template.json or tokenizer_config.json.
    for (const char* file : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                             "chat_template.jinja", "chat_template.json"})
      if (fs::exists(from / file))
        fs::copy_file(from / file, fs::path(a.export_hf) / file, fs::copy_options::overwrite_existing);
  }
  log << " Hugging Face export: " << a.export_hf << " (config.json, model.safetensors)\n";
}

}  // namespace

void TrainingRun::finish_checkpoint(int64_t last) {
  if (!args_.save.empty() && last_saved_ != last) save(last);
  if (local_) local_->wait();  // the last local checkpoint is whole before the process ends
  finish_training_checkpoints(comm_, log_);  // --async-save: the exit waits for the last save
}

void TrainingRun::finish(int64_t last, const std::string& curve_title) {
  profiler_.finish(last);
  finish_checkpoint(last);
  if (print_ && !args_.metrics_file.empty() && !curve_title.empty()) {
    const std::string svg = sibling_path(args_.metrics_file, ".svg");
    write_loss_curve_svg(svg, history_, curve_title);
    log_ << " loss curve: " << svg << "\n";
  }
  if (!args_.export_hf.empty()) {
    auto state = gather_full_weights(/*all_ranks=*/false, /*cpu_offload=*/true);
    if (comm_->rank() == 0) export_hf_folder(args_, args_, args_.bf16, config_, state, log_);
  }
  if (print_) {
    MemoryReport m = sharded_.root.memory();
    int64_t state = 0;
    for (auto& [name, tensors] : optimizer_->state())
      for (auto& t : tensors) state += t.nbytes();
    log_ << (is_simulated(*comm_) ? " SIMULATED" : "") << " memory per rank (MiB): model weights "
         << m.model_weights / 1048576.0 << ", main weights " << m.main_weights / 1048576.0 << ", main grads "
         << m.main_grads / 1048576.0 << ", optimizer state " << state / 1048576.0 << ", transient peak "
         << m.transient_peak / 1048576.0 << ", buffer pool " << m.buffer_pool / 1048576.0
         << ", process peak RSS " << peak_rss_bytes() / 1048576.0;
    if (comm_->device().is_cuda())
      log_ << ", " << comm_->device().str() << " peak allocated " << peak_memory_bytes(comm_->device()) / 1048576.0;
    log_ << "\n";
  }
}

}  // namespace mfsdp
