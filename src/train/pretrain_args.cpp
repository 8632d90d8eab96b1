#include "mfsdp/train/pretrain_args.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <sstream>
#include <stdexcept>

#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/data/indexed_dataset.h"
#include "mfsdp/train/parallel_dims.h"
#include "mfsdp/train/pipeline_schedule.h"
#include "mfsdp/train/training_run.h"

namespace mfsdp {
namespace {

// Section `s` of `args`: its flags, bound to its fields.
std::vector<ToolFlag> section_flags(PretrainArgs& args, Section s) {
  switch (s) {
    case Section::kModel: return static_cast<ModelSection&>(args).flags();
    case Section::kMoe: return static_cast<MoeSection&>(args).flags();
    case Section::kTokenizer: return static_cast<TokenizerSection&>(args).flags();
    case Section::kData: return static_cast<DataSection&>(args).flags();
    case Section::kTraining: return static_cast<TrainingSection&>(args).flags();
    case Section::kOptimizer: return static_cast<OptimizerSection&>(args).flags();
    case Section::kCheckpoint: return static_cast<CheckpointSection&>(args).flags();
    case Section::kParallel: return static_cast<ParallelSection&>(args).flags();
    case Section::kFsdp: return static_cast<FsdpSection&>(args).flags();
    case Section::kRuntime: return static_cast<RuntimeSection&>(args).flags();
    case Section::kLogging: return static_cast<LoggingSection&>(args).flags();
    case Section::kProfiling: return static_cast<ProfilingSection&>(args).flags();
    case Section::kPretraining: return static_cast<PretrainingSection&>(args).flags();
  }
  return {};
}

// The flags `tool` takes: those of its sections (less the ones it replaces) bound to `args`, then
// its extras.
std::vector<ToolFlag> tool_flags(PretrainArgs& args, const ToolFlags& tool) {
  std::vector<ToolFlag> out;
  for (Section s : tool.sections)
    for (ToolFlag& f : section_flags(args, s))
      if (!tool.replaced.count(f.name)) out.push_back(std::move(f));
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
void check_profile_target(const PretrainArgs& a, int world) {
  if (!a.profile) return;
  for (int64_t r : a.profile_ranks)
    if (r >= world)
      flag_error("--profile-ranks", "rank " + std::to_string(r) + " is not in this job of " + std::to_string(world) +
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

// --load through locate_checkpoint (every rank decides the same: the folder is shared), before
// any work: a path that cannot be meant is an error, and so is one without a checkpoint where
// something must be loaded (--finetune, mfsdp-sft, mfsdp-grpo); mfsdp-pretrain then starts afresh
// with a warning, as Megatron does. A check only: the run opens the checkpoint once
// (open_training_checkpoint, include/mfsdp/train/trainer_checkpoint.h) and keeps its reader.
void resolve_load(const PretrainArgs& a) {
  if (a.load.empty()) return;
  CheckpointLocation at;
  try {
    at = locate_checkpoint(a.load, a.ckpt_step >= 0 ? std::optional<int64_t>(a.ckpt_step) : std::nullopt);
  } catch (const std::invalid_argument& e) {
    flag_error(a.ckpt_step >= 0 ? "--load / --ckpt-step" : "--load", e.what());
  }
  if (at.found()) return;
  const std::string expected = "expected a save folder with latest_checkpointed_iteration.txt or an iteration folder "
                               "(.metadata, or metadata.json of the earlier format)";
  if (a.finetune) flag_error("--finetune", "--load " + a.load + " " + at.reason + ": nothing to fine-tune from; " + expected);
  if (a.load_requires_checkpoint) flag_error("--load", a.load + " " + at.reason + "; " + expected);
}

}  // namespace

void validate_pretrain_args(PretrainArgs& a, int world, int64_t tokenizer_vocab) {
  if (a.data_path.empty() && !a.mock_data && !a.memory_plan)
    flag_error("--data-path", "is required (or --mock-data for synthetic tokens)");
  if (!a.data_path.empty() && a.mock_data) flag_error("--mock-data", "conflicts with --data-path");
  if (!a.data_path.empty() && !a.memory_plan)
    for (const std::string& file : {index_file_path(a.data_path), data_file_path(a.data_path)})
      if (std::error_code ec; !std::filesystem::is_regular_file(file, ec))
        flag_error("--data-path", "'" + a.data_path + "': no file '" + file +
                               "' (the prefix of a .bin/.idx pair, as mfsdp-preprocess writes it)");
  // mfsdp-pretrain's model is the flags' (SFT's and GRPO's may come from a checkpoint:
  // starting_point checks theirs).
  if (!a.export_hf.empty() && !a.swiglu)
    flag_error("--export-hf", "needs --swiglu: without it the model has Megatron's GeLU MLP, which no Hugging Face Llama "
                       "has (their MLP is SwiGLU)");
  validate_training_args(a, world, tokenizer_vocab);
  // mfsdp-pretrain's model is the flags': what the layout splits of it is checked before any
  // rank starts (the fine-tuning tools check theirs when the model is known, in TrainingRun).
  check_parallel_model(parallel_dims(a, a, world), model_config_from_args(a, a, a.seq_length, a.padded_vocab_size));
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

// What the layout needs beyond parallel_dims' checks: the sequence's chunks under context
// parallelism, a checkpoint format that can hold a tensor-parallel slice, a simulated run of one
// rank's plan. Returns the data-parallel size.
int checked_data_parallel_size(const PretrainArgs& a, int world) {
  const ParallelDims dims = parallel_dims(a, a, world);
  if (dims.tp > 1 && !a.save.empty() && a.ckpt_format == "mfsdp")
    flag_error("--ckpt-format", "mfsdp stores 1-D element ranges, which cannot hold a tensor-parallel slice; "
                                "use fsdp_dtensor (the default) with --tensor-model-parallel-size " + std::to_string(dims.tp));
  if (dims.cp > 1 && a.seq_length % (2 * dims.cp) != 0)
    flag_error("--context-parallel-size", "--seq-length " + std::to_string(a.seq_length) + " does not divide by 2 x " +
                                              std::to_string(dims.cp) + " (the load-balanced chunks)");
  if ((dims.tp > 1 || dims.cp > 1) && a.simulate_world_size > 0 && !a.memory_plan)
    flag_error("--simulate-world-size", std::string("with ") +
                                            (dims.tp > 1 ? "--tensor-model-parallel-size" : "--context-parallel-size") +
                                            " > 1 needs --memory-plan");
  return dims.dp();
}

}  // namespace

void validate_training_args(PretrainArgs& a, int world, int64_t tokenizer_vocab) {
  // Each section's own values first (config/sections.h), then what joins sections.
  static_cast<ModelSection&>(a).validate();
  static_cast<const MoeSection&>(a).validate(a);
  static_cast<const ModelSection&>(a).validate_recompute(a);
  static_cast<const FsdpSection&>(a).validate();
  static_cast<const ParallelSection&>(a).validate();
  const int dp = checked_data_parallel_size(a, world);
  static_cast<const DataSection&>(a).validate();
  static_cast<const TrainingSection&>(a).validate();
  static_cast<const OptimizerSection&>(a).validate();
  static_cast<const CheckpointSection&>(a).validate();
  static_cast<const RuntimeSection&>(a).validate();
  static_cast<const LoggingSection&>(a).validate();
  static_cast<const ProfilingSection&>(a).validate();
  static_cast<const PretrainingSection&>(a).validate();

  check_profile_target(a, world);
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
  // Megatron's checks of the interleaved schedule (micro-batches a multiple of the stages, ...),
  // before any rank starts: the schedule of stage 0 is made once here.
  if (a.pipeline_model_parallel_size > 1) {
    const ParallelDims dims = parallel_dims(a, a, world);
    const PipelineSplitOptions split = dims.pipeline_split_options(a.num_layers);
    if (split.virtual_stages > 1) interleaved_one_f_one_b(dims.pp, 0, split.virtual_stages, a.num_micro_batches);
  }
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
    for (const ToolFlag& f : section_flags(defaults, section))
      if (!tool.replaced.count(f.name)) line(f);
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
