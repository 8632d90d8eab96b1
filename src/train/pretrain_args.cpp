#include "train/pretrain_args.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <map>
#include <sstream>
#include <stdexcept>

#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/data/gpt_dataset.h"
#include "mfsdp/data/indexed_dataset.h"

namespace mfsdp {
namespace {

struct Flag {
  std::string name;
  std::string help;
  bool takes_value;
  std::vector<std::string> choices;  // empty: any value
  std::function<void(PretrainArgs&, const std::string&)> set;
  std::function<std::string(const PretrainArgs&)> show;
  bool many_values = false;  // ToolFlag::many_values
  Section section = Section::kModel;  // set from the table's grouping
};

int64_t to_int(const std::string& flag, const std::string& v) {
  try {
    size_t used = 0;
    long long x = std::stoll(v, &used);
    if (used == v.size()) return x;
  } catch (const std::exception&) {
  }
  flag_error(flag, "expected an integer, got '" + v + "'");
}

// Finite numbers only: "nan" and "inf" parse as doubles but are no value of any flag here.
double to_double(const std::string& flag, const std::string& v) {
  try {
    size_t used = 0;
    double x = std::stod(v, &used);
    if (used == v.size() && std::isfinite(x)) return x;
  } catch (const std::exception&) {
  }
  flag_error(flag, "expected a finite number, got '" + v + "'");
}

// The space-separated integers of a many-valued flag.
std::vector<int64_t> to_int_list(const std::string& flag, const std::string& v) {
  std::vector<int64_t> out;
  std::istringstream in(v);
  for (std::string word; in >> word;) out.push_back(to_int(flag, word));
  if (out.empty()) flag_error(flag, "needs at least one value");
  return out;
}

std::string join_ints(const std::vector<int64_t>& values) {
  std::string out;
  for (int64_t v : values) {
    if (!out.empty()) out += ' ';
    out += std::to_string(v);
  }
  return out;
}

#define INT_FLAG(flag, field, help) \
  {flag, help, true, {}, [](PretrainArgs& a, const std::string& v) { a.field = to_int(flag, v); }, \
   [](const PretrainArgs& a) { return std::to_string(a.field); }}
#define DOUBLE_FLAG(flag, field, help) \
  {flag, help, true, {}, [](PretrainArgs& a, const std::string& v) { a.field = to_double(flag, v); }, \
   [](const PretrainArgs& a) { std::ostringstream s; s << a.field; return s.str(); }}
#define STRING_FLAG(flag, field, help, ...) \
  {flag, help, true, {__VA_ARGS__}, [](PretrainArgs& a, const std::string& v) { a.field = v; }, \
   [](const PretrainArgs& a) { return a.field.empty() ? std::string("unset") : a.field; }}
// nargs='+' of integers: "--flag 0 1 3".
#define INT_LIST_FLAG(flag, field, help) \
  {flag, help, true, {}, [](PretrainArgs& a, const std::string& v) { a.field = to_int_list(flag, v); }, \
   [](const PretrainArgs& a) { return join_ints(a.field); }, true}
#define BOOL_FLAG(flag, field, help) \
  {flag, help, false, {}, [](PretrainArgs& a, const std::string&) { a.field = true; }, \
   [](const PretrainArgs& a) { return std::string(a.field ? "on" : "off"); }}

const std::vector<Flag>& flags() {
  static const std::vector<Flag> table = [] {
    const std::vector<std::pair<Section, std::vector<Flag>>> sections = {
        {Section::kModel,
         {
            INT_FLAG("--num-layers", num_layers, "decoder layers"),
            INT_FLAG("--hidden-size", hidden_size, "model width"),
            INT_FLAG("--ffn-hidden-size", ffn_hidden_size,
                     "MLP width (0: Megatron's default, 4 x hidden, or with --swiglu int(4 x hidden x 2/3 / 64) x 64)"),
            INT_FLAG("--num-attention-heads", num_attention_heads, "attention heads"),
            BOOL_FLAG("--group-query-attention", group_query_attention, "grouped-query attention"),
            INT_FLAG("--num-query-groups", num_query_groups, "key/value heads with --group-query-attention"),
            INT_FLAG("--max-position-embeddings", max_position_embeddings, "longest position (0: --seq-length)"),
            STRING_FLAG("--normalization", normalization, "normalization layer", "RMSNorm"),
            BOOL_FLAG("--swiglu", swiglu,
                      "SwiGLU MLP (gate_proj, up_proj, down_proj), as Llama and Qwen2 have; without it Megatron's GeLU "
                      "MLP (up_proj, down_proj), which has no Hugging Face export"),
            STRING_FLAG("--position-embedding-type", position_embedding_type, "position embedding", "rope"),
            DOUBLE_FLAG("--rotary-base", rotary_base, "RoPE base (theta)"),
            BOOL_FLAG("--untie-embeddings-and-output-weights", untie_embeddings_and_output_weights,
                      "separate output layer (lm_head) instead of the embedding"),
            DOUBLE_FLAG("--init-method-std", init_method_std, "std of the normal weight init"),
            DOUBLE_FLAG("--norm-epsilon", norm_epsilon, "RMSNorm epsilon"),
            INT_FLAG("--make-vocab-size-divisible-by", make_vocab_size_divisible_by,
                     "pad the embedding rows to a multiple of this"),
            BOOL_FLAG("--recompute-activations", recompute_activations, "full activation recompute per layer"),
            STRING_FLAG("--recompute-granularity", recompute_granularity, "recompute granularity", "full"),
            BOOL_FLAG("--qk-layernorm", qk_layernorm, "RMSNorm over each query and key head before RoPE (Qwen3)"),
            INT_FLAG("--kv-channels", kv_channels, "each attention head's width (0: --hidden-size / --num-attention-heads)"),
         }},
        {Section::kMoe,
         {
            INT_FLAG("--num-experts", num_experts, "experts per MoE layer (0: a dense model)"),
            INT_FLAG("--moe-router-topk", moe_router_topk, "experts each token is routed to"),
            INT_FLAG("--moe-ffn-hidden-size", moe_ffn_hidden_size, "each expert's MLP width (0: --ffn-hidden-size)"),
            INT_FLAG("--moe-shared-expert-intermediate-size", moe_shared_expert_intermediate_size,
                     "width of the shared expert every token also goes through (0: none)"),
            BOOL_FLAG("--moe-shared-expert-gate", moe_shared_expert_gate,
                      "scale the shared expert's output by sigmoid(x w) (Qwen2-MoE)"),
            STRING_FLAG("--moe-router-score-function", moe_router_score_function,
                        "router scores: softmax over the experts, or sigmoid (DeepSeek-V3)", "softmax", "sigmoid"),
            BOOL_FLAG("--moe-router-pre-softmax", moe_router_pre_softmax,
                      "softmax over every expert, then the top-k, not renormalised (default: renormalised top-k)"),
            DOUBLE_FLAG("--moe-router-topk-scaling-factor", moe_router_topk_scaling_factor,
                        "multiply the top-k weights by this (0: no scaling)"),
            STRING_FLAG("--moe-router-load-balancing-type", moe_router_load_balancing_type,
                        "balancing loss: over the micro-batch (aux_loss), per sequence (seq_aux_loss) or none",
                        "aux_loss", "seq_aux_loss", "none"),
            DOUBLE_FLAG("--moe-aux-loss-coeff", moe_aux_loss_coeff, "weight of the load-balancing loss (0: off)"),
            DOUBLE_FLAG("--moe-z-loss-coeff", moe_z_loss_coeff, "weight of the router z-loss (0: off)"),
            DOUBLE_FLAG("--moe-expert-capacity-factor", moe_expert_capacity_factor,
                        "each expert takes at most tokens x top-k / experts x this, dropping the least probable "
                        "(0: dropless)"),
            STRING_FLAG("--moe-token-dispatcher-type", moe_token_dispatcher_type,
                        "how tokens reach their experts' ranks: all-to-all", "alltoall"),
            BOOL_FLAG("--moe-grouped-gemm", moe_grouped_gemm,
                      "the experts as one grouped GEMM (at::_grouped_mm) instead of one GEMM per expert"),
            STRING_FLAG("--moe-layer-freq", moe_layer_freq,
                        "which layers are MoE layers: every N-th from layer 0, or a list such as [1,0,1,0]"),
            BOOL_FLAG("--moe-router-enable-expert-bias", moe_router_enable_expert_bias,
                      "aux-loss-free balancing: a per-expert bias on the routing scores, moved after each step "
                      "toward equal token counts (sigmoid scores)"),
            DOUBLE_FLAG("--moe-router-bias-update-rate", moe_router_bias_update_rate,
                        "how far the expert bias moves per step (with --moe-router-enable-expert-bias)"),
            BOOL_FLAG("--moe-per-layer-logging", moe_per_layer_logging,
                      "log each MoE layer's balancing loss and tokens per expert (metrics file, TensorBoard)"),
            INT_FLAG("--expert-model-parallel-size", expert_model_parallel_size,
                     "ranks the experts of a layer are split over (1: every rank holds every expert)"),
         }},
        {Section::kTokenizer,
         {
            STRING_FLAG("--tokenizer-type", tokenizer_type, "tokenizer", "ByteLevelTokenizer",
                        "SentencePieceTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer", "NullTokenizer"),
            STRING_FLAG("--tokenizer-model", tokenizer_model,
                        "SentencePiece model file; for HuggingFaceTokenizer a tokenizer.json or its folder"),
            STRING_FLAG("--vocab-file", vocab_file, "GPT-2 vocab.json"),
            STRING_FLAG("--merge-file", merge_file, "GPT-2 merges.txt"),
         }},
        {Section::kData,
         {
            INT_FLAG("--seq-length", seq_length, "tokens per sample"),
            INT_FLAG("--vocab-size", vocab_size, "vocabulary with --mock-data and no tokenizer"),
            STRING_FLAG("--data-path", data_path, "prefix of a Megatron .bin/.idx pair"),
            STRING_FLAG("--split", split, "train,valid,test weights"),
            BOOL_FLAG("--mock-data", mock_data, "synthetic tokens instead of --data-path"),
         }},
        {Section::kTraining,
         {
            INT_FLAG("--micro-batch-size", micro_batch_size, "samples per rank and micro-batch"),
            INT_FLAG("--global-batch-size", global_batch_size,
                     "samples per iteration (0: micro-batch x data-parallel size)"),
            INT_FLAG("--train-iters", train_iters, "iterations"),
            INT_FLAG("--seed", seed, "random seed (model init and data order)"),
            BOOL_FLAG("--bf16", bf16, "bf16 compute with fp32 main weights and grads"),
            BOOL_FLAG("--check-for-nan-in-loss-and-grad", check_for_nan_in_loss_and_grad,
                      "stop when a rank's loss or a reduced gradient is NaN or Inf, naming the iteration and the "
                      "parameters, before the optimizer step (on unless --no-check-for-nan-in-loss-and-grad)"),
            {"--no-check-for-nan-in-loss-and-grad", "train on through NaN and Inf losses and gradients", false, {},
             [](PretrainArgs& a, const std::string&) { a.check_for_nan_in_loss_and_grad = false; },
             [](const PretrainArgs& a) { return std::string(a.check_for_nan_in_loss_and_grad ? "off" : "on"); }},
         }},
        {Section::kOptimizer,
         {
            DOUBLE_FLAG("--lr", lr, "peak learning rate"),
            DOUBLE_FLAG("--min-lr", min_lr, "learning rate at the end of decay"),
            STRING_FLAG("--lr-decay-style", lr_decay_style, "decay after warmup", "constant", "linear", "cosine"),
            INT_FLAG("--lr-warmup-iters", lr_warmup_iters, "linear warmup iterations"),
            INT_FLAG("--lr-decay-iters", lr_decay_iters, "iteration where decay ends (0: --train-iters)"),
            DOUBLE_FLAG("--weight-decay", weight_decay, "decoupled weight decay (not on 1-D params)"),
            DOUBLE_FLAG("--adam-beta1", adam_beta1, "Adam beta1"),
            DOUBLE_FLAG("--adam-beta2", adam_beta2, "Adam beta2"),
            DOUBLE_FLAG("--adam-eps", adam_eps, "Adam epsilon"),
            DOUBLE_FLAG("--sgd-momentum", sgd_momentum, "SGD momentum"),
            DOUBLE_FLAG("--clip-grad", clip_grad, "global gradient-norm clip (0: off)"),
            STRING_FLAG("--optimizer", optimizer, "optimizer (adam is AdamW)", "adam", "sgd"),
            STRING_FLAG("--optimizer-implementation", optimizer_implementation,
                        "AdamW's kernels: unfused (op for op as torch::optim::AdamW, the bit-exact reference), fused "
                        "(at::_fused_adamw_, torch.optim.AdamW(fused=True)'s single pass) or auto (fused on CUDA, as "
                        "Megatron's fused Adam; unfused on the CPU)",
                        "auto", "unfused", "fused"),
         }},
        {Section::kCheckpoint,
         {
            STRING_FLAG("--export-hf", export_hf,
                        "(mfsdp) at the end, write the model as a Hugging Face folder (config.json, model.safetensors, "
                        "the tokenizer files of a HuggingFaceTokenizer) here"),
            STRING_FLAG("--save", save, "checkpoint folder to save into (in --ckpt-format)"),
            INT_FLAG("--save-interval", save_interval, "iterations between checkpoints (0: only at the end)"),
            STRING_FLAG("--load", load,
                        "checkpoint to start from: a save folder (its latest iteration) or an iteration folder "
                        "(iter_NNNNNNN, or any torch.distributed.checkpoint folder)"),
            INT_FLAG("--ckpt-step", ckpt_step, "with --load of a save folder: load this iteration, not the latest "
                                               "(-1: the latest)"),
            BOOL_FLAG("--finetune", finetune, "with --load: weights only, iteration and optimizer start afresh"),
            BOOL_FLAG("--no-load-optim", no_load_optim, "with --load: do not load the optimizer state"),
            BOOL_FLAG("--no-load-rng", no_load_rng, "with --load: do not restore the random generators"),
            BOOL_FLAG("--no-save-optim", no_save_optim, "save checkpoints without the optimizer state"),
            INT_FLAG("--exit-interval", exit_interval, "stop (after saving with --save) at a multiple of this iteration"),
            BOOL_FLAG("--override-opt_param-scheduler", override_opt_param_scheduler,
                      "with --load: use this run's LR schedule flags, not the checkpoint's"),
            BOOL_FLAG("--use-checkpoint-opt_param-scheduler", use_checkpoint_opt_param_scheduler,
                      "with --load: use the checkpoint's LR schedule, not this run's flags"),
            STRING_FLAG("--ckpt-format", ckpt_format,
                        "checkpoint format to save: fsdp_dtensor (PyTorch DCP with Megatron-FSDP's keys) or mfsdp (the "
                        "earlier metadata.json + safetensors); --load reads either",
                        "fsdp_dtensor", "mfsdp"),
            BOOL_FLAG("--async-save", async_save,
                      "with --save: copy the shards to CPU staging buffers and write them on a background thread "
                      "while training goes on; each save commits at the next save or at the end "
                      "(--ckpt-format fsdp_dtensor)"),
            STRING_FLAG("--dump-param-to-param-group-map", dump_param_to_param_group_map,
                        "write Megatron's {parameter: optimizer group} map into this folder (a DCP folder; "
                        "mfsdp-ckpt print-torch-dcp-in-json turns it into the JSON the torch_dist conversion takes)"),
         }},
        {Section::kFsdp,
         {
            BOOL_FLAG("--use-megatron-fsdp", use_megatron_fsdp, "shard with mfsdp (always on here)"),
            STRING_FLAG("--data-parallel-sharding-strategy", data_parallel_sharding_strategy,
                        "what is sharded", "no_shard", "optim", "optim_grads", "optim_grads_params"),
            BOOL_FLAG("--no-gradient-accumulation-fusion", no_gradient_accumulation_fusion,
                      "no fused weight-gradient accumulation"),
            BOOL_FLAG("--use-distributed-optimizer", use_distributed_optimizer,
                      "shard the optimizer (always on here)"),
            BOOL_FLAG("--init-model-with-meta-device", init_model_with_meta_device,
                      "materialise and shard one layer at a time (on by default in mfsdp: the values equal eager "
                      "init's, and no rank ever holds the whole model)"),
            {"--no-init-model-with-meta-device",
             "(mfsdp) build every rank's whole model first, then shard it (eager init: the same values, a whole "
             "model's memory per rank)",
             false, {}, [](PretrainArgs& a, const std::string&) { a.init_model_with_meta_device = false; },
             [](const PretrainArgs& a) { return std::string(a.init_model_with_meta_device ? "off" : "on"); }},
            BOOL_FLAG("--grad-reduce-in-bf16", grad_reduce_in_bf16, "reduce gradients in bf16"),
            BOOL_FLAG("--grad-reduce-rank-order-fp32", grad_reduce_rank_order_fp32,
                      "(mfsdp) with --grad-reduce-in-bf16: sum the bf16 gradients in fp32 in rank order, rounded "
                      "once (reproducible bits for any world size; point to point instead of NCCL's bf16 "
                      "reduction kernels)"),
            BOOL_FLAG("--no-fsdp-prefetch", no_fsdp_prefetch,
                      "(mfsdp) do not all-gather the next unit while the current one computes"),
            BOOL_FLAG("--no-fsdp-all-gather-in-start-param-sync", no_fsdp_all_gather_in_start_param_sync,
                      "do not start the first unit's all-gather at the end of the optimizer step"),
            BOOL_FLAG("--fsdp-double-buffer", fsdp_double_buffer,
                      "unsharded weights and gradients in two persistent buffers per size class"),
            BOOL_FLAG("--fsdp-trace-pool", fsdp_trace_pool,
                      "(mfsdp) unsharded buffers at offsets of one pool per dtype, planned from a traced step"),
            BOOL_FLAG("--use-nccl-ub", use_nccl_ub, "NCCL user buffers (GPU; refused on NCCL: not supported yet)"),
            INT_FLAG("--num-distributed-optimizer-instances", num_distributed_optimizer_instances,
                     "HSDP: split the data-parallel ranks into this many instances of consecutive ranks; "
                     "each shards the model as --data-parallel-sharding-strategy says, the instances "
                     "replicate it and all-reduce gradients across"),
            STRING_FLAG("--outer-dp-sharding-strategy", outer_dp_sharding_strategy,
                        "what is sharded across the instances of --num-distributed-optimizer-instances: "
                        "no_shard, nothing (HSDP); optim, main weights, gradients and optimizer state "
                        "(HFSDP; needs optim_grads_params)",
                        "no_shard", "optim"),
            INT_FLAG("--tensor-model-parallel-size", tensor_model_parallel_size,
                     "tensor parallelism: split each layer's heads and MLP and the vocabulary over this many "
                     "adjacent ranks (FSDP shards each rank's slices over the rest)"),
            BOOL_FLAG("--sequence-parallel", sequence_parallel,
                      "with tensor parallelism: norms and residuals on sequence slices between the "
                      "tensor-parallel regions"),
            INT_FLAG("--context-parallel-size", context_parallel_size,
                     "context parallelism: split every sequence over this many ranks (load-balanced chunks; "
                     "FSDP shards over data x context-parallel ranks)"),
            STRING_FLAG("--cp-comm-type", cp_comm_type,
                        "how context-parallel attention exchanges keys and values: all_gather (the default "
                        "here, measured faster) or p2p (a ring, less memory)",
                        "all_gather", "p2p"),
         }},
        {Section::kRuntime,
         {
            STRING_FLAG("--attention-backend", attention_backend,
                        "auto: at::scaled_dot_product_attention (the device's fused kernels); unfused: explicit "
                        "matmul, causal mask, fp32 softmax, matmul",
                        "auto", "unfused"),
            DOUBLE_FLAG("--distributed-timeout-minutes", distributed_timeout_minutes,
                        "timeout of every collective: a rank that stops answering is named in an error after "
                        "this long (fractions of a minute allowed)"),
            STRING_FLAG("--device", device,
                        "(mfsdp) where to train: auto (CUDA and NCCL when this rank sees a GPU: cuda:LOCAL_RANK "
                        "when it sees a GPU per local rank, cuda:0 when it sees just one, as under Slurm's "
                        "--gpus-per-task=1; an error with more than one but fewer than the local ranks; the CPU "
                        "without a GPU), cpu (the CPU communicator) or cuda (as auto, an error without a GPU)",
                        "auto", "cpu", "cuda"),
            STRING_FLAG("--cpu-comm-shared-memory", cpu_comm_shared_memory,
                        "(mfsdp) CPU backend: on, the collectives' bulk data through one /dev/shm segment when every "
                        "rank is on this host; off, over TCP (unset: on, unless MFSDP_SHM=0)",
                        "on", "off"),
            STRING_FLAG("--socket-ifname", socket_ifname,
                        "(mfsdp) CPU backend: the network interface ranks listen on, e.g. eth0 (unset: "
                        "MFSDP_SOCKET_IFNAME, else GLOO_SOCKET_IFNAME, else loopback on one node or the host name)"),
            STRING_FLAG("--keep-freed-cpu-memory", keep_freed_cpu_memory,
                        "(mfsdp) on: freed CPU blocks under 32 MiB stay in the process for the next step; off: glibc's "
                        "defaults (unset: on, unless MFSDP_KEEP_FREED_MEMORY=0)",
                        "on", "off"),
         }},
        {Section::kLogging,
         {
            INT_FLAG("--log-interval", log_interval, "iterations between log lines"),
            INT_FLAG("--eval-interval", eval_interval, "iterations between evaluations"),
            INT_FLAG("--eval-iters", eval_iters, "batches per evaluation"),
            BOOL_FLAG("--log-params-norm", log_params_norm,
                      "log the L2 norm of all parameters after the optimizer step (' params norm: ', metrics "
                      "params_norm)"),
            BOOL_FLAG("--log-num-zeros-in-grad", log_num_zeros_in_grad,
                      "log how many gradient elements are zero after reduction and clipping (' num zeros: ', "
                      "metrics num_zeros_in_grad)"),
            STRING_FLAG("--metrics-file", metrics_file, "JSON-lines metrics (and a .svg loss curve)"),
            STRING_FLAG("--tensorboard-dir", tensorboard_dir,
                        "write TensorBoard event files of the training scalars (lm loss, learning-rate, grad-norm, "
                        "throughput, tokens-per-sec, mem-bytes, ...) here"),
            INT_FLAG("--tensorboard-log-interval", tensorboard_log_interval, "iterations between TensorBoard scalars"),
         }},
        {Section::kProfiling,
         {
            BOOL_FLAG("--profile", profile,
                      "profile iterations --profile-step-start + 1 .. --profile-step-end on --profile-ranks: with "
                      "--use-pytorch-profiler a trace into --tensorboard-dir, else nsys's capture range "
                      "(cudaProfilerStart/Stop and NVTX ranges of every op; nsys profile --capture-range=cudaProfilerApi)"),
            BOOL_FLAG("--use-pytorch-profiler", use_pytorch_profiler,
                      "with --profile: PyTorch's profiler (Kineto), a <host>_<pid>.<ms>.pt.trace.json per profiled rank "
                      "in --tensorboard-dir (TensorBoard, Perfetto, chrome://tracing)"),
            INT_FLAG("--profile-step-start", profile_step_start, "with --profile: iterations done before profiling starts"),
            INT_FLAG("--profile-step-end", profile_step_end, "with --profile: the last iteration profiled"),
            INT_LIST_FLAG("--profile-ranks", profile_ranks, "with --profile: the global ranks profiled"),
         }},
        {Section::kPretraining,
         {
            BOOL_FLAG("--skip-train", skip_train, "evaluate only"),
            STRING_FLAG("--sample-prompt", sample_prompt, "(mfsdp) print a sample continuing this text after training"),
            INT_FLAG("--sample-tokens", sample_tokens, "(mfsdp) tokens of that sample"),
            BOOL_FLAG("--calculate-per-token-loss", calculate_per_token_loss,
                      "loss = sum over tokens / tokens in the global batch (no 1/dp gradient scaling)"),
            INT_FLAG("--simulate-world-size", simulate_world_size,
                     "(mfsdp) one process plays --simulate-rank of a job this size: real per-rank memory and "
                     "compute, collectives replaced by local copies, losses not meaningful (0: off)"),
            INT_FLAG("--simulate-rank", simulate_rank, "(mfsdp) the rank played with --simulate-world-size"),
            BOOL_FLAG("--memory-plan", memory_plan,
                      "(mfsdp) print each rank's planned buffer bytes per unit and exit before allocating them "
                      "(with --simulate-world-size N: for N ranks; needs no data or --train-iters)"),
         }},
    };
    std::vector<Flag> all;
    for (const auto& [section, declared] : sections)
      for (Flag f : declared) {
        f.section = section;
        all.push_back(std::move(f));
      }
    return all;
  }();
  return table;
}

}  // namespace

namespace {

bool takes_section(const ToolFlags& tool, Section section) {
  return std::find(tool.sections.begin(), tool.sections.end(), section) != tool.sections.end();
}

ToolFlag bound(const Flag& f, PretrainArgs& args) {
  return {f.name, f.help, f.takes_value, f.choices, [&args, set = f.set](const std::string& v) { set(args, v); },
          [&args, show = f.show] { return show(args); }, f.many_values};
}

// The flags `tool` takes: those of its sections (less the ones it replaces) bound to `args`, then
// its extras.
std::vector<ToolFlag> tool_flags(PretrainArgs& args, const ToolFlags& tool) {
  std::vector<ToolFlag> out;
  for (const Flag& f : flags())
    if (takes_section(tool, f.section) && !tool.replaced.count(f.name)) out.push_back(bound(f, args));
  out.insert(out.end(), tool.extra.begin(), tool.extra.end());
  return out;
}

// Flags mfsdp once had, with what replaces them, so an old command line says what to do instead
// of only "unknown flag". "" for any other name.
std::string retired_flag_hint(const std::string& name) {
  if (name == "--save-final-model")
    return "was removed with its pickled model.pt format; save a checkpoint with --save DIR or a Hugging Face "
           "folder with --export-hf DIR, then run mfsdp-generate --model DIR (it reads both)";
  return "";
}

}  // namespace

PretrainArgs parse_pretrain_args(const std::vector<std::string>& argv, const ToolFlags& tool) {
  PretrainArgs args;
  const std::vector<ToolFlag> all = tool_flags(args, tool);
  std::map<std::string, const ToolFlag*> by_name;
  for (const ToolFlag& f : all) by_name[f.name] = &f;
  for (size_t i = 1; i < argv.size(); ++i) {
    std::string token = argv[i], value;
    bool inline_value = false;
    if (auto eq = token.find('='); token.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = token.substr(eq + 1);
      token = token.substr(0, eq);
      inline_value = true;
    }
    auto it = by_name.find(token);
    if (it == by_name.end()) {
      if (auto retired = retired_flag_hint(token); !retired.empty()) flag_error(token, retired);
      if (auto r = tool.replaced.find(token); r != tool.replaced.end())
        flag_error(token, tool.program + " does not take it: " + r->second);
      flag_error(token, "unknown flag (" + tool.program + " --help lists them)");
    }
    const ToolFlag& f = *it->second;
    if (f.many_values && !inline_value) {
      while (i + 1 < argv.size() && argv[i + 1].rfind("--", 0) != 0) value += (value.empty() ? "" : " ") + argv[++i];
      if (value.empty()) flag_error(f.name, "needs a value");
    } else if (f.takes_value && !inline_value) {
      if (i + 1 >= argv.size()) flag_error(f.name, "needs a value");
      value = argv[++i];
    } else if (!f.takes_value && inline_value) {
      flag_error(f.name, "takes no value");
    }
    if (!f.choices.empty() &&
        std::find(f.choices.begin(), f.choices.end(), value) == f.choices.end()) {
      std::string list;
      for (const auto& c : f.choices) list += (list.empty() ? "" : ", ") + c;
      flag_error(f.name, "'" + value + "' is not one of: " + list);
    }
    f.set(value);
  }
  // Checked here, before trainer_main turns it into a rank count (an int).
  if (args.simulate_world_size > kMaxSimulatedWorldSize)
    flag_error("--simulate-world-size", "must be at most " + std::to_string(kMaxSimulatedWorldSize) + ", got " +
                                     std::to_string(args.simulate_world_size));
  return args;
}

namespace {

std::string number(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

// The parts of --profile that depend on other sections: where a trace goes, and whether this
// build and device have nsys's CUDA capture range.
void check_profile_target(const PretrainArgs& a, int dp) {
  if (!a.profile) return;
  for (int64_t r : a.profile_ranks)
    if (r >= dp)
      flag_error("--profile-ranks", "rank " + std::to_string(r) + " is not in this job of " + std::to_string(dp) +
                                        " ranks");
  if (a.use_pytorch_profiler && a.tensorboard_dir.empty())
    flag_error("--use-pytorch-profiler", "needs --tensorboard-dir, the folder the traces are written into");
  if (!a.use_pytorch_profiler) {
#ifndef MFSDP_WITH_CUDA
    flag_error("--profile", "without --use-pytorch-profiler is nsys's CUDA capture range, and this build has no "
                            "CUDA; add --use-pytorch-profiler --tensorboard-dir DIR for a trace");
#endif
    if (a.device == "cpu")
      flag_error("--profile", "without --use-pytorch-profiler is nsys's CUDA capture range, which --device cpu has "
                              "none of; add --use-pytorch-profiler --tensorboard-dir DIR for a trace");
  }
}

// --load through locate_checkpoint (every rank decides the same: the folder is shared). A path
// without a checkpoint is an error where something must be loaded (--finetune, mfsdp-sft,
// mfsdp-grpo); mfsdp-pretrain then starts afresh with a warning, as Megatron does.
void resolve_load(PretrainArgs& a) {
  a.load_dir.clear();
  if (a.load.empty()) return;
  CheckpointLocation at;
  try {
    at = locate_checkpoint(a.load, a.ckpt_step >= 0 ? std::optional<int64_t>(a.ckpt_step) : std::nullopt);
  } catch (const std::invalid_argument& e) {
    flag_error(a.ckpt_step >= 0 ? "--load / --ckpt-step" : "--load", e.what());
  }
  if (at.found()) {
    a.load_dir = at.dir;
    return;
  }
  const std::string expected = "expected a save folder with latest_checkpointed_iteration.txt or an iteration folder "
                               "(.metadata, or metadata.json of the earlier format)";
  if (a.finetune) flag_error("--finetune", "--load " + a.load + " " + at.reason + ": nothing to fine-tune from; " + expected);
  if (a.load_requires_checkpoint) flag_error("--load", a.load + " " + at.reason + "; " + expected);
}

}  // namespace

void validate_pretrain_args(PretrainArgs& a, int dp, int64_t tokenizer_vocab) {
  if (a.data_path.empty() && !a.mock_data && !a.memory_plan)
    flag_error("--data-path", "is required (or --mock-data for synthetic tokens)");
  if (!a.data_path.empty() && a.mock_data) flag_error("--mock-data", "conflicts with --data-path");
  if (!a.data_path.empty() && !a.memory_plan)
    for (const std::string& file : {index_file_path(a.data_path), data_file_path(a.data_path)})
      if (std::error_code ec; !std::filesystem::is_regular_file(file, ec))
        flag_error("--data-path", "'" + a.data_path + "': no file '" + file +
                               "' (the prefix of a .bin/.idx pair, as mfsdp-preprocess writes it)");
  parse_split(a.split);  // throws naming --split
  // mfsdp-pretrain's model is the flags' (SFT's and GRPO's may come from a checkpoint:
  // starting_point checks theirs).
  if (!a.export_hf.empty() && !a.swiglu)
    flag_error("--export-hf", "needs --swiglu: without it the model has Megatron's GeLU MLP, which no Hugging Face Llama "
                       "has (their MLP is SwiGLU)");
  validate_training_args(a, dp, tokenizer_vocab);
  // The samples the train, validation and test datasets index (trainer.cpp), as doubles: the
  // int64 products can overflow.
  const double gbs = static_cast<double>(a.global_batch_size);
  const double evals = a.skip_train ? 1.0 : static_cast<double>(a.train_iters / a.eval_interval + 1);
  const double train = static_cast<double>(a.train_iters) * gbs, eval = (evals + 1) * a.eval_iters * gbs;
  if (train + eval > kMaxDatasetSamples)
    flag_error(eval > train ? "--eval-iters" : "--train-iters",
        number(train) + " training and " + number(eval) + " validation and test samples (iterations x "
        "--global-batch-size " + std::to_string(a.global_batch_size) + ") exceed the " +
        number(kMaxDatasetSamples) + " the datasets can index");
}

namespace {

// The mesh's checks (Megatron's arguments.py and its layers' divide()): tensor- and
// context-parallel sizes that divide the world and what they split; returns the data-parallel
// size. What mfsdp does not combine with them yet is refused naming the flags.
int checked_data_parallel_size(const PretrainArgs& a, int world) {
  const int64_t tp = a.tensor_model_parallel_size, cp = a.context_parallel_size;
  if (tp == 1 && cp == 1) return world;
  const std::string tp_flag = "--tensor-model-parallel-size", cp_flag = "--context-parallel-size";
  const std::string which = tp > 1 ? tp_flag : cp_flag;
  if (world % (tp * cp) != 0)
    flag_error(which, std::to_string(tp) + " x " + cp_flag + " " + std::to_string(cp) +
                          " does not divide the world size " + std::to_string(world));
  if (tp > 1) {
    const int64_t groups = a.group_query_attention ? a.num_query_groups : a.num_attention_heads;
    for (const auto& [flag, value] : {std::pair<std::string, int64_t>{"--num-attention-heads", a.num_attention_heads},
                                      {a.group_query_attention ? "--num-query-groups" : "--num-attention-heads", groups},
                                      {"--ffn-hidden-size", a.ffn_hidden_size}})
      if (value > 0 && value % tp != 0)
        flag_error(tp_flag, std::to_string(tp) + " does not divide " + flag + " " + std::to_string(value));
    if (a.num_experts > 0)
      flag_error(tp_flag, "with --num-experts: mfsdp does not split experts over tensor-parallel ranks "
                          "(Megatron's --expert-tensor-parallel-size); use --expert-model-parallel-size");
    if (!a.save.empty() && a.ckpt_format == "mfsdp")
      flag_error("--ckpt-format", "mfsdp stores 1-D element ranges, which cannot hold a tensor-parallel slice; "
                                  "use fsdp_dtensor (the default) with " + tp_flag + " " + std::to_string(tp));
  }
  if (cp > 1 && a.seq_length % (2 * cp) != 0)
    flag_error(cp_flag, "--seq-length " + std::to_string(a.seq_length) + " does not divide by 2 x " +
                            std::to_string(cp) + " (the load-balanced chunks)");
  if (a.expert_model_parallel_size > 1)
    flag_error("--expert-model-parallel-size", "with " + which + " > 1 is not supported by mfsdp yet");
  if (a.simulate_world_size > 0 && !a.memory_plan)
    flag_error("--simulate-world-size", "with " + which + " > 1 needs --memory-plan");
  return static_cast<int>(world / (tp * cp));
}

}  // namespace

void validate_training_args(PretrainArgs& a, int world, int64_t tokenizer_vocab) {
  // Each section's own values first (config/sections.h), then what joins sections.
  static_cast<ModelSection&>(a).validate();
  static_cast<const MoeSection&>(a).validate(a.num_layers);
  static_cast<const FsdpSection&>(a).validate();
  const int dp = checked_data_parallel_size(a, world);
  if (a.expert_model_parallel_size > 1 && dp % a.expert_model_parallel_size != 0)
    flag_error("--expert-model-parallel-size", std::to_string(a.expert_model_parallel_size) +
                                                   " does not divide the data-parallel size " + std::to_string(dp));
  const int64_t instances = a.num_distributed_optimizer_instances;
  if (instances > 1 && dp % instances != 0)
    flag_error("--num-distributed-optimizer-instances", std::to_string(instances) +
                                                           " does not divide the data-parallel size " + std::to_string(dp));
  if (instances > 1 && a.expert_model_parallel_size > 1)
    flag_error("--num-distributed-optimizer-instances",
               "HSDP with --expert-model-parallel-size " + std::to_string(a.expert_model_parallel_size) +
                   " is not supported by mfsdp yet (the experts' own hybrid mesh); use one of the two");
  static_cast<const DataSection&>(a).validate();
  static_cast<const TrainingSection&>(a).validate();
  static_cast<const OptimizerSection&>(a).validate();
  static_cast<const CheckpointSection&>(a).validate();
  static_cast<const RuntimeSection&>(a).validate();
  static_cast<const LoggingSection&>(a).validate();
  static_cast<const ProfilingSection&>(a).validate();
  static_cast<const PretrainingSection&>(a).validate();

  check_profile_target(a, dp);
  if (a.max_position_embeddings == 0) a.max_position_embeddings = a.seq_length;
  if (a.max_position_embeddings < a.seq_length) flag_error("--max-position-embeddings", "is smaller than --seq-length");
  if (a.train_iters == 0 && !a.skip_train && !a.memory_plan) flag_error("--train-iters", "is required (or --skip-train)");
  if (a.micro_batch_size > kMaxMicroBatchTokens / a.seq_length)
    flag_error("--micro-batch-size", std::to_string(a.micro_batch_size) + " x --seq-length " +
                                         std::to_string(a.seq_length) + " tokens per micro-batch and rank is more than " +
                                         std::to_string(kMaxMicroBatchTokens));
  const int64_t per_micro = a.micro_batch_size * dp;
  if (a.global_batch_size == 0) a.global_batch_size = per_micro;
  if (a.global_batch_size % per_micro != 0)
    flag_error("--global-batch-size", std::to_string(a.global_batch_size) +
                                          " is not a multiple of --micro-batch-size x data-parallel size = " +
                                          std::to_string(a.micro_batch_size) + " x " + std::to_string(dp));
  a.num_micro_batches = a.global_batch_size / per_micro;
  if (a.lr_decay_iters == 0) a.lr_decay_iters = a.train_iters;
  if (a.lr_decay_iters > 0 && a.lr_warmup_iters > a.lr_decay_iters)
    flag_error("--lr-warmup-iters", "exceeds --lr-decay-iters");
  int64_t vocab = tokenizer_vocab > 0 ? tokenizer_vocab : a.vocab_size;
  if (tokenizer_vocab <= 0 && a.vocab_size == 1) flag_error("--vocab-size", "must be >= 2, got 1");
  if (vocab < 2)
    flag_error(a.tokenizer_type.empty() ? "--tokenizer-type" : "--vocab-size",
               "no vocabulary: give --tokenizer-type (and its files), or --vocab-size with --mock-data");
  // Megatron pads to a multiple of --make-vocab-size-divisible-by x tensor-parallel size.
  const int64_t m = a.make_vocab_size_divisible_by * a.tensor_model_parallel_size;
  a.real_vocab_size = vocab;
  a.padded_vocab_size = (vocab + m - 1) / m * m;
  if (a.padded_vocab_size > kMaxVocabSize)
    flag_error("--make-vocab-size-divisible-by", "pads the vocabulary of " + std::to_string(vocab) + " to " +
                                                     std::to_string(a.padded_vocab_size) + ", more than " +
                                                     std::to_string(kMaxVocabSize));
  if (a.grad_reduce_in_bf16 && !a.bf16) flag_error("--grad-reduce-in-bf16", "needs --bf16");
  if (a.grad_reduce_rank_order_fp32 && !a.grad_reduce_in_bf16)
    flag_error("--grad-reduce-rank-order-fp32", "needs --grad-reduce-in-bf16 (other gradients are reduced in fp32)");
  resolve_load(a);
  if (a.simulate_world_size > 0 && (!a.save.empty() || !a.load.empty() || !a.sample_prompt.empty() ||
                                    !a.export_hf.empty()))
    flag_error("--simulate-world-size", "cannot --save, --load, --export-hf or --sample-prompt: a simulated run "
                                        "holds one rank's shard only");
  // The sample is written after training: a prompt no tokenizer here can encode must stop the
  // run before it starts, not after it ends.
  if (!a.sample_prompt.empty() && a.tokenizer_type != "ByteLevelTokenizer" && a.tokenizer_type != "GPT2BPETokenizer" &&
      a.tokenizer_type != "HuggingFaceTokenizer")
    flag_error("--sample-prompt",
               "needs a tokenizer that encodes text in this process (--tokenizer-type ByteLevelTokenizer, "
               "GPT2BPETokenizer or HuggingFaceTokenizer), not " +
                   (a.tokenizer_type.empty() ? std::string("none (--vocab-size)") : a.tokenizer_type) +
                   "; or sample afterwards with mfsdp-generate --prompt-ids");
}

std::map<std::string, std::string> pretrain_args_values(const PretrainArgs& args, const ToolFlags& tool) {
  PretrainArgs copy = args;
  std::map<std::string, std::string> out;
  for (const ToolFlag& f : tool_flags(copy, tool)) out[f.name] = f.show();
  return out;
}

std::string pretrain_usage(const ToolFlags& tool) {
  std::ostringstream s;
  s << "usage: mfsdp-run --nproc-per-node N " << tool.program << " [flags]\n";
  auto line = [&s](const ToolFlag& f) {
    s << "  " << f.name << (f.many_values ? " VALUE [VALUE ...]" : f.takes_value ? " VALUE" : "") << "\n      " << f.help;
    if (!f.choices.empty()) {
      s << " {";
      for (size_t i = 0; i < f.choices.size(); ++i) s << (i ? "," : "") << f.choices[i];
      s << "}";
    }
    s << " (default: " << f.show() << ")\n";
  };
  PretrainArgs defaults;
  for (Section section : tool.sections) {
    s << "\n" << section_title(section) << ":\n";
    for (const Flag& f : flags())
      if (f.section == section && !tool.replaced.count(f.name)) line(bound(f, defaults));
  }
  if (!tool.extra.empty()) {
    s << "\n" << (tool.extra_title.empty() ? tool.program + "'s own" : tool.extra_title) << ":\n";
    for (const ToolFlag& f : tool.extra) line(f);
  }
  return s.str();
}

std::vector<std::string> pretrain_inert_flag_notices(const PretrainArgs& a, bool nccl_in_use) {
  std::vector<std::string> notes;
  if (a.use_nccl_ub && !nccl_in_use)
    notes.push_back("--use-nccl-ub has no effect: this run communicates on the CPU backend, not NCCL");
  if (a.use_nccl_ub && nccl_in_use)
    throw std::invalid_argument(
        "--use-nccl-ub: NCCL user-buffer registration (ncclMemAlloc + ncclCommRegister of the FSDP "
        "buffers) is not supported by mfsdp yet; run without --use-nccl-ub");
  // Megatron accepts the files of another tokenizer and ignores them; so does mfsdp, saying so.
  const std::string tokenizer = a.tokenizer_type.empty() ? "none (--vocab-size)" : a.tokenizer_type;
  for (auto [flag, value] : {std::pair{"--vocab-file", &a.vocab_file}, {"--merge-file", &a.merge_file}})
    if (!value->empty() && a.tokenizer_type != "GPT2BPETokenizer")
      notes.push_back(std::string(flag) + " has no effect: only GPT2BPETokenizer reads it (--tokenizer-type is " +
                      tokenizer + ")");
  if (!a.tokenizer_model.empty() && a.tokenizer_type != "SentencePieceTokenizer" &&
      a.tokenizer_type != "HuggingFaceTokenizer")
    notes.push_back("--tokenizer-model has no effect: only SentencePieceTokenizer and HuggingFaceTokenizer read it "
                    "(--tokenizer-type is " + tokenizer + ")");
  if (a.no_gradient_accumulation_fusion)
    notes.push_back("--no-gradient-accumulation-fusion has no effect: there is no fused weight-gradient kernel here");
  if (a.use_megatron_fsdp)
    notes.push_back("--use-megatron-fsdp is implied: mfsdp always shards with fully_shard");
  if (a.use_distributed_optimizer)
    notes.push_back("--use-distributed-optimizer is implied: the optimizer always runs on shards");
  return notes;
}

}  // namespace mfsdp
