#include "mfsdp/train/trainer_checkpoint.h"

#include <chrono>
#include <cmath>
#include <filesystem>
#include <optional>
#include <sstream>
#include <stdexcept>

#include "mfsdp/base/directory_tree.h"
#include "mfsdp/checkpoint/async_save.h"
#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/models/tensor_parallel_training.h"

namespace mfsdp {
nlohmann::json lr_schedule_json(const LRSchedule& s) {
  return {{"max_lr", s.max_lr},
          {"min_lr", s.min_lr},
          {"warmup_steps", s.warmup_steps},
          {"decay_steps", s.decay_steps},
          {"style", s.style}};
}

namespace {

// The model-config fields that change the model, with the flag that sets each.
void check_model_config(const nlohmann::json& saved, const ModelConfig& run, const std::string& where) {
  if (!saved.is_object() || saved.empty()) return;  // written by a tool that records none
  const nlohmann::json& mine = run.hf;
  const std::pair<const char*, const char*> fields[] = {
      {"vocab_size", "--vocab-size / tokenizer (padded)"},
      {"hidden_size", "--hidden-size"},
      {"intermediate_size", "--ffn-hidden-size"},
      {"hidden_act", "--swiglu (silu: SwiGLU; gelu: Megatron's MLP without --swiglu)"},
      {"num_hidden_layers", "--num-layers"},
      {"num_attention_heads", "--num-attention-heads"},
      {"num_key_value_heads", "--num-query-groups"},
      {"tie_word_embeddings", "--untie-embeddings-and-output-weights"},
      {"rope_theta", "--rotary-base"},
      {"rms_norm_eps", "--norm-epsilon"},
      {"attention_bias", "the model (Qwen2's q/k/v biases)"}};
  for (const auto& [field, flag] : fields) {
    if (!saved.contains(field) || !mine.contains(field)) continue;
    const nlohmann::json& a = saved[field];
    const nlohmann::json& b = mine[field];
    const bool same = a.is_number() && b.is_number() ? a.get<double>() == b.get<double>() : a == b;
    if (!same)
      throw std::invalid_argument("checkpoint '" + where + "': model_config." + field + " is " + a.dump() +
                                  ", this run has " + b.dump() + " (" + flag + ")");
  }
}

}  // namespace

void reconcile_schedule(const CheckpointSection& a, const nlohmann::json& saved, LRSchedule& schedule,
                        const std::string& where) {
  if (!saved.is_object() || saved.empty() || a.override_opt_param_scheduler) return;
  LRSchedule from_ckpt;
  try {
    from_ckpt.max_lr = saved.at("max_lr").get<double>();
    from_ckpt.min_lr = saved.at("min_lr").get<double>();
    from_ckpt.warmup_steps = saved.at("warmup_steps").get<int64_t>();
    from_ckpt.decay_steps = saved.at("decay_steps").get<int64_t>();
    from_ckpt.style = saved.at("style").get<std::string>();
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument("checkpoint '" + where + "': scheduler is malformed: " + e.what());
  }
  if (a.use_checkpoint_opt_param_scheduler) {
    schedule = from_ckpt;
    return;
  }
  const nlohmann::json mine = lr_schedule_json(schedule);
  for (const auto& [key, value] : mine.items())
    if (saved[key] != value)
      throw std::invalid_argument("checkpoint '" + where + "': scheduler." + key + " is " + saved[key].dump() +
                                  ", this run has " + value.dump() +
                                  " (pass --override-opt_param-scheduler to use this run's, or "
                                  "--use-checkpoint-opt_param-scheduler to use the checkpoint's)");
}

namespace {

// The saves of --async-save in flight: one per process, as there is one training run.
AsyncCheckpointSaver& async_saver() {
  // The file system the writers use is made first, so that it is destroyed after the saver, whose
  // destructor waits for a writer still running when the process exits on an error.
  checkpoint_file_system();
  static AsyncCheckpointSaver saver;
  return saver;
}

void log_committed(const std::optional<int64_t>& iteration, const std::shared_ptr<Communicator>& world,
                   const std::string& how, std::ostream& log) {
  if (!iteration || world->rank() != 0) return;
  log << " committed checkpoint of iteration " << *iteration << " (written in the background; " << how << ")\n";
  log.flush();
}

// Who wrote the checkpoint and which iteration it records, for the start-up line.
std::string checkpoint_origin(const LoadedCheckpoint& got) {
  const nlohmann::json& m = got.metadata;
  const std::string iteration = "iteration " + std::to_string(got.iteration);
  if (m.value("format", "") == kCheckpointFormatName) {
    const bool earlier = std::filesystem::exists(got.path + "/metadata.json");
    return std::string(earlier ? "mfsdp's earlier format" : "fsdp_dtensor") + " saved by mfsdp on " +
           std::to_string(m.value("world_size", 0)) + " ranks, " + iteration;
  }
  return "a PyTorch Distributed Checkpoint not written by mfsdp, " +
         (m.value("iteration_recorded", false) ? iteration : "no iteration recorded (taken as 0)");
}

}  // namespace

TensorSlices model_parallel_checkpoint_slices(const CausalLM& model, const FsdpHandle& root) {
  TensorSlices slices;
  const std::string embedding_copy = model.embedding_copy();
  for (const LocalShard& s : root.local_shards())
    if (s.name == embedding_copy) {
      TensorSlice& slice = slices[s.name];
      slice.whole_shape = s.global_shape;
      slice.origin.assign(s.global_shape.size(), 0);
      slice.writes = false;  // the first stage writes it
    }
  const std::shared_ptr<Communicator> tp = model.tensor_parallel();
  if (!tp || tp->size() == 1) return slices;
  for (const LocalShard& s : root.local_shards()) {
    TensorSlice& slice = slices[s.name];
    slice.whole_shape = s.global_shape;  // fully_shard's "global" tensor is the rank's slice
    slice.origin.assign(s.global_shape.size(), 0);
    const TensorParallelSplit split = model.tensor_parallel_split(s.name);
    if (split == TensorParallelSplit::kReplicated) {
      slice.writes = tp->rank() == 0 || !tensor_parallel_duplicate(model, s.name);
      continue;
    }
    if (s.name == embedding_copy) slice.writes = false;
    const size_t dim = split == TensorParallelSplit::kColumns ? 1 : 0;
    slice.origin[dim] = tp->rank() * s.global_shape[dim];
    slice.whole_shape[dim] *= tp->size();
  }
  return slices;
}

std::string non_persistent_global_dir(const CheckpointSection& a, const std::string& base) {
  if (!a.non_persistent_global_ckpt_dir.empty()) return a.non_persistent_global_ckpt_dir;
  return (std::filesystem::path(base) / "non_persistent").string();
}

OpenedCheckpoint open_training_checkpoint(const CheckpointSection& a) {
  OpenedCheckpoint opened;
  if (a.load.empty()) return opened;
  CheckpointLocation at;
  try {
    at = locate_checkpoint(a.load, a.ckpt_step >= 0 ? std::optional<int64_t>(a.ckpt_step) : std::nullopt);
  } catch (const std::invalid_argument& e) {
    flag_error(a.ckpt_step >= 0 ? "--load / --ckpt-step" : "--load", e.what());
  }
  if (at.found())
    opened.reader = std::make_shared<const CheckpointReader>(at.dir);
  else
    opened.missing = at.reason;
  // Megatron's rule: the non-persistent checkpoint when it is newer than the persistent one. Only
  // for a save folder's latest (an iteration folder or --ckpt-step names one checkpoint).
  namespace fs = std::filesystem;
  std::error_code ec;
  const bool save_folder = !at.found() || fs::weakly_canonical(at.dir, ec) != fs::weakly_canonical(a.load, ec);
  if (a.non_persistent_ckpt_type != "global" || a.ckpt_step >= 0 || !save_folder) return opened;
  const std::string np_dir = non_persistent_global_dir(a, a.load);
  std::optional<int64_t> np;
  try {
    np = latest_checkpoint_iteration(np_dir);
  } catch (const std::exception& e) {
    opened.origin = std::string("the non-persistent folder is not readable (") + e.what() + "): not taken";
    return opened;
  }
  if (!np) return opened;
  const int64_t persistent = opened.reader ? opened.reader->metadata().value("iteration", int64_t{-1}) : -1;
  if (*np <= persistent) {
    opened.origin = "the non-persistent checkpoint in " + np_dir + " (iteration " + std::to_string(*np) +
                    ") is not newer: not taken";
    return opened;
  }
  std::shared_ptr<const CheckpointReader> newer;
  try {
    newer = std::make_shared<const CheckpointReader>(np_dir);
  } catch (const std::exception& e) {
    opened.origin = "the non-persistent checkpoint in " + np_dir + " (iteration " + std::to_string(*np) +
                    ") is not readable (" + e.what() + "): not taken";
    return opened;
  }
  opened.fallback = opened.reader;
  opened.reader = newer;
  opened.missing.clear();
  opened.origin = "taking the non-persistent (global) checkpoint in " + np_dir + " (iteration " + std::to_string(*np) +
                  "), newer than --load's " +
                  (persistent >= 0 ? "iteration " + std::to_string(persistent) : std::string("(none)"));
  return opened;
}

ResumePoint load_training_checkpoint(const OpenedCheckpoint& opened, const CheckpointSection& a,
                                     const TrainingSection& training, const ModelConfig& config,
                                     const std::shared_ptr<Communicator>& world, FsdpHandle& model,
                                     DistributedOptimizer& optimizer, LRSchedule& schedule, std::ostream& log,
                                     const TensorSlices& slices) {
  const bool print = world->rank() == 0;
  if (!opened.reader) {  // validation refused this unless starting afresh is allowed
    if (print && !a.load.empty())
      log << " WARNING: --load " << a.load << " " << opened.missing << "; training starts from scratch\n";
    return {};
  }
  if (opened.fallback) {
    // A non-persistent checkpoint that fails to load gives way to the persistent one: both are
    // loaded whole (model, optimizer, generators), so what the failed load left is overwritten.
    try {
      OpenedCheckpoint newest = opened;
      newest.fallback = nullptr;
      return load_training_checkpoint(newest, a, training, config, world, model, optimizer, schedule, log, slices);
    } catch (const std::exception& e) {
      if (print)
        log << " WARNING: the non-persistent checkpoint " << opened.reader->dir() << " did not load (" << e.what()
            << "); loading --load's " << opened.fallback->dir() << "\n";
      OpenedCheckpoint older;
      older.reader = opened.fallback;
      return load_training_checkpoint(older, a, training, config, world, model, optimizer, schedule, log, slices);
    }
  }
  if (print && !opened.origin.empty() && !opened.fallback) log << " " << opened.origin << "\n";
  const CheckpointReader& reader = *opened.reader;
  CheckpointLoadOptions options;
  options.load_optimizer = !a.finetune && !a.no_load_optim;
  options.load_rng = !a.finetune && !a.no_load_rng;
  options.slices = slices;
  options.all_or_nothing = false;  // the process exits on a failed load: read straight into the shards
  // The config is checked before any tensor is read, so a mismatch names the flag, not a shape.
  check_model_config(reader.metadata().value("model_config", nlohmann::json::object()), config, reader.dir());
  const auto start = std::chrono::steady_clock::now();
  LoadedCheckpoint got = load_checkpoint(reader, world, model, &optimizer, options);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ResumePoint resume;
  if (!a.finetune) {
    reconcile_schedule(a, got.metadata.value("scheduler", nlohmann::json::object()), schedule, got.path);
    resume = {got.iteration, got.consumed_samples};
    if (resume.consumed_samples != resume.iteration * training.global_batch_size)
      throw std::invalid_argument("checkpoint '" + got.path + "': " + std::to_string(resume.consumed_samples) +
                                  " samples consumed in " + std::to_string(resume.iteration) +
                                  " iterations; resuming needs the same --global-batch-size (this run: " +
                                  std::to_string(training.global_batch_size) + ")");
  }
  if (print) {
    log << " loaded checkpoint " << got.path << " (" << checkpoint_origin(got)
        << ") in " << seconds
        << " s: model weights" << (got.optimizer_loaded ? ", optimizer state" : "")
        << (got.rng_loaded ? ", random generators" : "")
        << (a.finetune ? "; weights only (--finetune), iteration starts at 0"
                       : "; resuming after iteration " + std::to_string(resume.iteration))
        << (!a.finetune && !got.optimizer_loaded ? "; optimizer not loaded (--no-load-optim)" : "")
        << (!options.load_rng || got.rng_loaded ? ""
            : got.metadata.value("world_size", -1) > 0 ? "; random generators NOT restored (other world size)"
                                                        : "; it holds no random generator states")
        << (got.metadata.value("model_config", nlohmann::json::object()).empty()
                ? "; it records no model_config: the model is the one the flags describe"
                : "")
        << "\n";
    log.flush();
  }
  return resume;
}

void save_training_checkpoint(const PretrainArgs& a, const ModelConfig& config,
                              const std::shared_ptr<Communicator>& world, const FsdpHandle& model,
                              const DistributedOptimizer& optimizer, const LRSchedule& schedule,
                              int64_t iteration, std::ostream& log, const ToolFlags& tool,
                              const TensorSlices& slices) {
  CheckpointInfo info;
  info.iteration = iteration;
  info.consumed_samples = iteration * a.global_batch_size;
  for (const auto& [flag, value] : pretrain_args_values(a, tool)) info.args[flag] = value;
  info.model_config = config.spec->hf_config(config, a.bf16 ? at::kBFloat16 : at::kFloat);
  info.scheduler = lr_schedule_json(schedule);
  const auto start = std::chrono::steady_clock::now();
  if (a.async_save) {
    AsyncCheckpointSaver& saver = async_saver();
    const int64_t previous = saver.iteration_in_flight();
    saver.save(a.save, world, model, a.no_save_optim ? nullptr : &optimizer, info, slices);
    if (previous >= 0) log_committed(previous, world, "at the next save", log);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (world->rank() == 0) {
      log << " checkpoint of iteration " << iteration << " staged in " << seconds << " s ("
          << saver.staging_bytes() / 1048576.0 << " MiB of staging buffers per rank), being written to "
          << checkpoint_iteration_dir(a.save, iteration) << " in the background (--async-save)\n";
      log.flush();
    }
    const bool last = iteration >= a.train_iters || (a.exit_interval > 0 && iteration % a.exit_interval == 0);
    if (last) finish_training_checkpoints(world, log);  // the process ends next: wait for it
    return;
  }
  save_checkpoint(a.save, world, model, a.no_save_optim ? nullptr : &optimizer, info,
                  checkpoint_format_from_name(a.ckpt_format), slices);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (world->rank() == 0) {
    log << " saved checkpoint at iteration " << iteration << " to " << checkpoint_iteration_dir(a.save, iteration)
        << " in " << seconds << " s\n";
    log.flush();
  }
}

void save_non_persistent_global_checkpoint(const PretrainArgs& a, const ModelConfig& config,
                                           const std::shared_ptr<Communicator>& world, const FsdpHandle& model,
                                           const DistributedOptimizer& optimizer, const LRSchedule& schedule,
                                           int64_t iteration, std::ostream& log, const ToolFlags& tool,
                                           const TensorSlices& slices) {
  PretrainArgs into = a;
  into.save = non_persistent_global_dir(a, a.save);
  save_training_checkpoint(into, config, world, model, optimizer, schedule, iteration, log, tool, slices);
  if (world->rank() != 0) return;
  // Only the newest committed one stays (a save in flight is an iter_N.tmp, which this keeps).
  namespace fs = std::filesystem;
  const std::optional<int64_t> latest = latest_checkpoint_iteration(into.save);
  if (!latest) return;
  std::error_code ec;  // a folder that cannot be removed is left
  for (const std::string& name : list_directory(into.save)) {
    if (name.size() != 12 || name.rfind("iter_", 0) != 0 ||
        name.find_first_not_of("0123456789", 5) != std::string::npos)
      continue;
    if (std::stoll(name.substr(5)) != *latest) remove_tree((fs::path(into.save) / name).string(), ec);
  }
}

void finish_training_checkpoints(const std::shared_ptr<Communicator>& world, std::ostream& log) {
  AsyncCheckpointSaver& saver = async_saver();
  if (!saver.in_flight()) return;
  const auto start = std::chrono::steady_clock::now();
  const std::optional<int64_t> done = saver.finish(world);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  log_committed(done, world, "waited " + std::to_string(seconds) + " s for the writers", log);
}

void poll_training_checkpoints(const std::shared_ptr<Communicator>& world, std::ostream& log) {
  AsyncCheckpointSaver& saver = async_saver();
  if (!saver.in_flight()) return;
  log_committed(saver.try_finish(world), world, "found done after an iteration", log);
}

}  // namespace mfsdp
