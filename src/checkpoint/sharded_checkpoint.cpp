// save_checkpoint / load_checkpoint / write_checkpoint: every rank writes the element ranges it
// holds and reads the ones it owns now (include/mfsdp/checkpoint/checkpoint.h).
#include <ATen/ATen.h>
#include <ATen/core/Generator.h>

#include <algorithm>
#include <filesystem>
#include <optional>
#include <regex>
#include <set>
#include <stdexcept>

#include "checkpoint/checkpoint_files.h"
#include "checkpoint/dcp_checkpoint.h"
#include "checkpoint/rank_strings.h"
#include "checkpoint/save_steps.h"
#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/base/crc32c.h"
#include "mfsdp/base/directory_tree.h"

namespace fs = std::filesystem;

namespace mfsdp {
namespace {

using checkpoint::all_gather_strings;
using checkpoint::ChunkRecord;
using Piece = checkpoint::TensorPiece;


// Throws on every rank if any rank reported an error (an empty string is success).
void raise_first_error(const std::vector<std::string>& errors, int my_rank, const std::string& what) {
  if (!errors[static_cast<size_t>(my_rank)].empty()) throw std::runtime_error(errors[static_cast<size_t>(my_rank)]);
  for (size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty()) throw std::runtime_error(what + " failed on rank " + std::to_string(r) + ": " + errors[r]);
}

// Runs `fn`, returning its error message (empty on success), so ranks can agree before acting.
template <class Fn>
std::string capture_error(Fn&& fn) {
  try {
    fn();
    return "";
  } catch (const std::exception& e) {
    return e.what();
  }
}

std::string model_key(const std::string& fqn) { return "model." + fqn; }
std::string optimizer_key(const std::string& fqn, const std::string& state) {
  return "optimizer.state." + fqn + "." + state;
}

// This rank's share of a slice held by `replicas` ranks: an even split, so each element is
// written by exactly one of them.
std::pair<int64_t, int64_t> replica_share(int64_t numel, int replicas, int replica) {
  const int64_t begin = numel * replica / replicas, end = numel * (replica + 1) / replicas;
  return {begin, end - begin};
}

// The model's parameter slices, then its buffers as slices every rank of the job holds whole.
std::vector<LocalShard> model_shards(const FsdpHandle& model, int world_rank, int world_size) {
  std::vector<LocalShard> out = model.local_shards();
  for (const auto& [name, buffer] : model.buffers()) {
    LocalShard s;
    s.name = name;
    s.global_shape = buffer.sizes().vec();
    s.local = buffer.view({-1});
    s.requires_grad = false;
    s.replicas = world_size;
    s.replica = world_rank;
    out.push_back(std::move(s));
  }
  return out;
}

// Writes `pieces` as `file` and returns their chunk records (byte ranges from the written header).
std::vector<ChunkRecord> write_pieces(const std::string& file, const std::vector<Piece>& pieces) {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const Piece& p : pieces) {
    if (!p.slice_shape.empty())
      throw std::invalid_argument("checkpoint format mfsdp stores 1-D element ranges of whole tensors and cannot hold '" +
                                  p.tensor + "', a tensor-parallel slice: save as fsdp_dtensor");
    if (p.data.numel() > 0) tensors.emplace_back(checkpoint::chunk_key(p.tensor, p.offset), p.data);
  }
  write_safetensors(file, tensors, {{"format", "mfsdp.fsdp_dtensor.shard"}});
  SafetensorsFile written(file);
  std::vector<ChunkRecord> records;
  for (const Piece& p : pieces) {
    ChunkRecord c;
    c.tensor = p.tensor;
    c.dtype = safetensors_dtype_name(p.data.scalar_type());
    c.shape = p.shape;
    c.offset = p.offset;
    c.numel = p.data.numel();
    if (c.numel > 0) {
      std::tie(c.byte_begin, c.byte_end) = written.file_byte_range(checkpoint::chunk_key(p.tensor, p.offset));
      c.crc32c = crc32c_of_file_range(file, c.byte_begin, c.byte_end - c.byte_begin);  // just written: cached
    }
    records.push_back(c);
  }
  return records;
}

nlohmann::json records_to_json(const std::vector<ChunkRecord>& records) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& r : records) out.push_back(checkpoint::to_json(r));
  return out;
}

// What saves that never finished leave in SAVE: iter_N.tmp folders (a full disk, a kill) and
// the temporary files of `latest`'s atomic write (a kill between its write and its rename). Left
// there, the bytes of a save that failed for want of space would make the next one fail too.
bool unfinished_save_leftover(const std::string& name) {
  static const std::regex tmp_folder(R"(iter_\d+\.tmp)");
  return std::regex_match(name, tmp_folder) || name.rfind(std::string(checkpoint::kLatestFile) + ".tmp.", 0) == 0;
}

// Rank 0's preparation of SAVE/iter_N.tmp: the leftovers of unfinished saves go first.
std::string prepare_tmp_dir(const std::string& save_dir, int64_t iteration) {
  const std::string tmp = checkpoint_iteration_dir(save_dir, iteration) + ".tmp";
  fs::create_directories(save_dir);
  for (const std::string& name : list_directory(save_dir))
    if (unfinished_save_leftover(name)) remove_tree(save_dir + "/" + name);
  fs::create_directory(tmp);
  return tmp;
}

// A save that failed frees its disk space at once (best effort: the next save cleans up too).
void discard_unfinished(const std::string& tmp) {
  std::error_code ignored;
  remove_tree(tmp, ignored);
}

}  // namespace

namespace checkpoint {

std::vector<Piece> pieces_to_save(const FsdpHandle& model, const DistributedOptimizer* optimizer, int world_rank,
                                  int world_size, const TensorSlices& slices) {
  std::vector<std::pair<std::string, std::vector<at::Tensor>>> state;
  if (optimizer != nullptr) state = optimizer->state();
  std::vector<Piece> out;
  for (const LocalShard& s : model_shards(model, world_rank, world_size)) {
    const auto slice = slices.find(s.name);
    if (slice != slices.end() && !slice->second.writes) continue;  // another tensor-parallel rank writes it
    auto [begin, count] = replica_share(s.local.numel(), s.replicas, s.replica);
    auto add = [&](const std::string& tensor, const at::Tensor& flat) {
      if (slice == slices.end())
        out.push_back({tensor, s.global_shape, s.offset + begin, flat.narrow(0, begin, count)});
      else
        out.push_back({tensor, slice->second.whole_shape, s.offset + begin, flat.narrow(0, begin, count),
                       s.global_shape, slice->second.origin});
    };
    add(model_key(s.name), s.local);
    if (s.shard_index < 0) continue;
    // State kept in a narrower dtype than the main weights (bf16 moments) is written upcast, as
    // Megatron writes its precision-aware optimizer's (get_unscaled_state): a checkpoint holds the
    // same dtypes whichever way it was trained, and loading rounds back exactly.
    for (const auto& [key, tensors] : state) {
      at::Tensor piece = tensors.at(static_cast<size_t>(s.shard_index)).narrow(0, s.shard_offset, s.local.numel());
      if (at::isReducedFloatingType(piece.scalar_type()) && s.local.scalar_type() == at::kFloat) piece = piece.to(at::kFloat);
      add(optimizer_key(s.name, key), piece);
    }
  }
  // Generator states: this rank's own, as U8 tensors.
  auto add_generator = [&](const std::string& label, const at::Generator& gen) {
    at::Tensor st = gen.get_state();
    out.push_back({checkpoint::rng_tensor_name(world_rank, label), {st.numel()}, 0, st.view({-1})});
  };
  add_generator("cpu", at::detail::getDefaultCPUGenerator());
  for (const LocalShard& s : model.local_shards())
    if (s.local.is_cuda()) {
      add_generator("cuda", at::globalContext().defaultGenerator(s.local.device()));
      break;
    }
  return out;
}

nlohmann::json save_metadata(const CheckpointInfo& info, int world_size, const DistributedOptimizer* optimizer) {
  nlohmann::json optimizer_json = nullptr;
  if (optimizer != nullptr) {
    nlohmann::json keys = nlohmann::json::array();
    for (const auto& [key, tensors] : optimizer->state()) keys.push_back(key);
    optimizer_json = {{"name", optimizer->name()}, {"step", optimizer->steps()}, {"state", keys}};
  }
  return {{"format", kCheckpointFormatName},
          {"version", kCheckpointFormatVersion},
          {"iteration", info.iteration},
          {"consumed_samples", info.consumed_samples},
          {"world_size", world_size},
          {"args", info.args},
          {"model_config", info.model_config},
          {"scheduler", info.scheduler},
          {"optimizer", optimizer_json}};
}

std::string begin_save(const std::string& save_dir, Communicator& world, int64_t iteration) {
  const std::string tmp = checkpoint_iteration_dir(save_dir, iteration) + ".tmp";
  std::string error;
  if (world.rank() == 0) error = capture_error([&] { prepare_tmp_dir(save_dir, iteration); });
  raise_first_error(all_gather_strings(world, error), world.rank(), "save_checkpoint: creating '" + tmp + "'");
  return tmp;
}

nlohmann::json write_rank_report(const std::string& tmp, int rank, const std::vector<Piece>& pieces,
                                 const nlohmann::json& meta, CheckpointFormat format) {
  nlohmann::json report;
  const std::string error = capture_error([&] {
    if (format == CheckpointFormat::kFsdpDtensor) {
      report = checkpoint::write_dcp_rank_file(tmp, rank, pieces, meta);
    } else {
      const std::string file = tmp + "/" + checkpoint::rank_file_name(rank);
      report = {{"chunks", records_to_json(write_pieces(file, pieces))}};
    }
  });
  if (!error.empty()) report = {{"error", error}};
  return report;
}

void finish_save(const std::string& save_dir, Communicator& world, const std::string& tmp, int64_t iteration,
                 const nlohmann::json& report, const nlohmann::json& meta, CheckpointFormat format) {
  const int rank = world.rank(), size = world.size();
  std::vector<std::string> texts = all_gather_strings(world, report.dump());
  std::vector<nlohmann::json> reports;
  std::vector<std::string> errors;
  for (const auto& t : texts) {
    reports.push_back(nlohmann::json::parse(t));
    errors.push_back(reports.back().value("error", ""));
  }
  const bool failed = std::any_of(errors.begin(), errors.end(), [](const std::string& e) { return !e.empty(); });
  if (failed && rank == 0) discard_unfinished(tmp);
  raise_first_error(errors, rank, "save_checkpoint: writing shard files");

  std::string error;
  if (rank == 0) {
    error = capture_error([&] {
      if (format == CheckpointFormat::kFsdpDtensor) {
        checkpoint::write_dcp_metadata(tmp, reports);
      } else {
        std::vector<std::vector<ChunkRecord>> records;
        nlohmann::json legacy = meta;
        for (int r = 0; r < size; ++r) {
          legacy["files"].push_back(checkpoint::rank_file_name(r));
          records.emplace_back();
          for (const auto& c : reports[static_cast<size_t>(r)].at("chunks"))
            records.back().push_back(checkpoint::chunk_from_json(c));
        }
        legacy["tensors"] = checkpoint::merge_chunk_records(records);
        checkpoint::write_file_atomically(tmp + "/" + checkpoint::kMetadataFile, legacy.dump(1));
      }
      checkpoint::commit_checkpoint(save_dir, tmp, checkpoint_iteration_dir(save_dir, iteration), iteration);
    });
  }
  if (!error.empty() && fs::exists(tmp)) discard_unfinished(tmp);  // not yet committed: nothing reads it
  raise_first_error(all_gather_strings(world, error), rank, "save_checkpoint: committing '" + tmp + "'");
}

}  // namespace checkpoint

void save_checkpoint(const std::string& save_dir, const std::shared_ptr<Communicator>& world,
                     const FsdpHandle& model, const DistributedOptimizer* optimizer, const CheckpointInfo& info,
                     CheckpointFormat format, const TensorSlices& slices) {
  if (!world) throw std::invalid_argument("save_checkpoint: the communicator is null");
  if (info.iteration < 0) throw std::invalid_argument("save_checkpoint: negative iteration");
  at::NoGradGuard no_grad;
  const int rank = world->rank();
  const std::string tmp = checkpoint::begin_save(save_dir, *world, info.iteration);
  // Every rank: its own file. The outcome travels with the chunk list.
  const nlohmann::json meta = checkpoint::save_metadata(info, world->size(), optimizer);
  nlohmann::json report;
  try {
    report = checkpoint::write_rank_report(
        tmp, rank, checkpoint::pieces_to_save(model, optimizer, rank, world->size(), slices), meta, format);
  } catch (const std::exception& e) {
    report = {{"error", std::string(e.what())}};
  }
  checkpoint::finish_save(save_dir, *world, tmp, info.iteration, report, meta, format);
}

void write_checkpoint(const std::string& save_dir, const std::map<std::string, at::Tensor>& model_tensors,
                      const CheckpointInfo& info, CheckpointFormat format) {
  const std::string tmp = prepare_tmp_dir(save_dir, info.iteration);
  std::vector<Piece> pieces;
  for (const auto& [name, t] : model_tensors)
    pieces.push_back({model_key(name), t.sizes().vec(), 0, t.detach().reshape({-1})});
  const nlohmann::json meta = checkpoint::save_metadata(info, 1, nullptr);
  try {
    if (format == CheckpointFormat::kFsdpDtensor) {
      checkpoint::write_dcp_metadata(tmp, {checkpoint::write_dcp_rank_file(tmp, 0, pieces, meta)});
    } else {
      auto records = write_pieces(tmp + "/" + checkpoint::rank_file_name(0), pieces);
      nlohmann::json legacy = meta;
      legacy["files"] = {checkpoint::rank_file_name(0)};
      legacy["tensors"] = checkpoint::merge_chunk_records({records});
      checkpoint::write_file_atomically(tmp + "/" + checkpoint::kMetadataFile, legacy.dump(1));
    }
  } catch (...) {
    discard_unfinished(tmp);
    throw;
  }
  checkpoint::commit_checkpoint(save_dir, tmp, checkpoint_iteration_dir(save_dir, info.iteration), info.iteration);
}

void write_checkpoint(const std::string& save_dir, const std::map<std::string, std::vector<int64_t>>& shapes,
                      const std::function<at::Tensor(const std::string&)>& read, const CheckpointInfo& info) {
  const std::string tmp = prepare_tmp_dir(save_dir, info.iteration);
  std::vector<Piece> pieces;
  for (const auto& [name, shape] : shapes) {
    Piece p{model_key(name), shape, 0, at::Tensor()};
    p.read = [&read, &name = name, shape = shape] {
      at::Tensor t = read(name);
      if (t.sizes().vec() != shape)
        throw std::logic_error("write_checkpoint: '" + name + "' was read as " + c10::str(t.sizes()) + ", not " +
                               c10::str(at::IntArrayRef(shape)));
      return t.detach().reshape({-1});
    };
    pieces.push_back(std::move(p));
  }
  try {
    const nlohmann::json meta = checkpoint::save_metadata(info, 1, nullptr);
    checkpoint::write_dcp_metadata(tmp, {checkpoint::write_dcp_rank_file(tmp, 0, pieces, meta)});
  } catch (...) {
    discard_unfinished(tmp);
    throw;
  }
  checkpoint::commit_checkpoint(save_dir, tmp, checkpoint_iteration_dir(save_dir, info.iteration), info.iteration);
}

namespace {

// What one rank reads before anything is changed.
struct Staged {
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;  // (destination view, staged values)
  std::vector<std::pair<at::Generator, at::Tensor>> generators;
  std::optional<int64_t> optimizer_steps;
};

void check_shape(const CheckpointReader& reader, const std::string& tensor, const std::vector<int64_t>& expected) {
  const auto saved = reader.shape(tensor);
  if (saved != expected)
    throw std::invalid_argument("checkpoint '" + reader.dir() + "': tensor '" + tensor + "' has shape " +
                                c10::str(at::IntArrayRef(saved)) + ", the model expects " +
                                c10::str(at::IntArrayRef(expected)));
}

// Elements [offset, offset + dst.numel()) of the rank's tensor (its `slice` of the checkpoint's
// tensor under tensor parallelism) into a staged copy for `dst`.
void stage(const CheckpointReader& reader, const std::string& tensor, const LocalShard& s, const TensorSlice* slice,
           const at::Tensor& dst, Staged& staged, bool all_or_nothing) {
  const bool in_place = !all_or_nothing && dst.is_contiguous();
  at::Tensor values = in_place ? dst.view({-1}) : at::empty({dst.numel()}, dst.options());
  if (dst.numel() > 0 && slice == nullptr) reader.read_range(tensor, s.offset, values);
  if (dst.numel() > 0 && slice != nullptr) reader.read_slice_range(tensor, s.global_shape, slice->origin, s.offset, values);
  if (!in_place) staged.copies.emplace_back(dst, values);
}

// `anywhere`: the model tensors of every rank (under expert parallelism a rank holds only its
// experts; the checkpoint holds them all).
Staged stage_checkpoint(const CheckpointReader& reader, const FsdpHandle& model, DistributedOptimizer* optimizer,
                        const CheckpointLoadOptions& options, int world_rank, int world_size,
                        const std::set<std::string>& anywhere, LoadedCheckpoint& result) {
  Staged staged;
  const nlohmann::json& meta = reader.metadata();
  const std::vector<LocalShard> shards = model_shards(model, world_rank, world_size);
  std::set<std::string> model_tensors;
  for (const LocalShard& s : shards) model_tensors.insert(model_key(s.name));
  for (const std::string& name : reader.tensor_names())
    if (name.rfind("model.", 0) == 0 && !anywhere.count(name)) result.unexpected.push_back(name);
  for (const std::string& name : model_tensors)
    if (!reader.contains(name)) result.missing.push_back(name);
  if (options.strict && !result.missing.empty())
    throw std::invalid_argument("checkpoint '" + reader.dir() + "' has no tensor '" + result.missing.front() + "'" +
                                (result.missing.size() > 1 ? " (and " + std::to_string(result.missing.size() - 1) +
                                                                 " more model tensors)" : ""));
  if (options.strict && !result.unexpected.empty())
    throw std::invalid_argument("checkpoint '" + reader.dir() + "' has tensor '" + result.unexpected.front() +
                                "', which the model does not have" +
                                (result.unexpected.size() > 1 ? " (and " + std::to_string(result.unexpected.size() - 1) +
                                                                    " more)" : ""));

  const bool load_optimizer = options.load_optimizer && optimizer != nullptr;
  std::vector<std::pair<std::string, std::vector<at::Tensor>>> state;
  if (load_optimizer) {
    const nlohmann::json& o = meta.contains("optimizer") ? meta["optimizer"] : nlohmann::json();
    if (!o.is_object())
      throw std::invalid_argument("checkpoint '" + reader.dir() +
                                  "' holds no optimizer state (e.g. an imported model): load the weights only "
                                  "(--finetune or --no-load-optim)");
    if (o.value("name", "") != optimizer->name())
      throw std::invalid_argument("checkpoint '" + reader.dir() + "' holds " + o.value("name", "?") +
                                  " state, the run uses " + optimizer->name() + " (use --no-load-optim)");
    if (!o.contains("step") || !o["step"].is_number_integer() || o["step"].get<int64_t>() < 0)
      throw std::invalid_argument("checkpoint '" + reader.dir() + "': optimizer step is missing or negative");
    state = optimizer->state();
    staged.optimizer_steps = o["step"].get<int64_t>();
  }

  for (const LocalShard& s : shards) {
    const std::string key = model_key(s.name);
    if (!reader.contains(key)) continue;  // not strict: keeps its values
    const auto found = options.slices.find(s.name);
    const TensorSlice* slice = found == options.slices.end() ? nullptr : &found->second;
    const std::vector<int64_t>& whole_shape = slice ? slice->whole_shape : s.global_shape;
    check_shape(reader, key, whole_shape);
    stage(reader, key, s, slice, s.local, staged, options.all_or_nothing);
    if (s.shard_index < 0) continue;
    for (const auto& [state_key, tensors] : state) {
      const std::string okey = optimizer_key(s.name, state_key);
      if (!reader.contains(okey))
        throw std::invalid_argument("checkpoint '" + reader.dir() + "' has no optimizer tensor '" + okey +
                                    "' (use --no-load-optim to start the optimizer afresh)");
      check_shape(reader, okey, whole_shape);
      stage(reader, okey, s, slice, tensors.at(static_cast<size_t>(s.shard_index)).narrow(0, s.shard_offset, s.local.numel()),
            staged, options.all_or_nothing);
    }
  }

  // Generator states only mean something for the same rank of a job of the same size.
  if (options.load_rng && meta.value("world_size", -1) == world_size) {
    auto add_generator = [&](const std::string& label, at::Generator gen) {
      const std::string name = checkpoint::rng_tensor_name(world_rank, label);
      if (!reader.contains(name)) throw std::invalid_argument("checkpoint '" + reader.dir() + "' has no '" + name + "'");
      at::Tensor st = reader.read(name);
      if (st.scalar_type() != at::kByte) throw std::invalid_argument("checkpoint '" + reader.dir() + "': '" + name + "' is not U8");
      staged.generators.emplace_back(gen, st);
    };
    add_generator("cpu", at::detail::getDefaultCPUGenerator());
    for (const LocalShard& s : shards)
      if (s.local.is_cuda()) {
        add_generator("cuda", at::globalContext().defaultGenerator(s.local.device()));
        break;
      }
  }
  return staged;
}

// load_checkpoint from an open reader; `path` is what the errors of other ranks are reported under
// (what the caller named).
LoadedCheckpoint load_from(const CheckpointReader& reader, const std::string& path,
                           const std::shared_ptr<Communicator>& world, FsdpHandle& model,
                           DistributedOptimizer* optimizer, const CheckpointLoadOptions& options) {
  at::NoGradGuard no_grad;
  const int rank = world->rank();
  LoadedCheckpoint result;
  Staged staged;
  std::set<std::string> anywhere;
  {
    std::string mine;
    for (const LocalShard& s : model_shards(model, rank, world->size())) mine += model_key(s.name) + "\n";
    for (const std::string& text : all_gather_strings(*world, mine))
      for (size_t at = 0, end; (end = text.find('\n', at)) != std::string::npos; at = end + 1)
        anywhere.insert(text.substr(at, end - at));
  }
  std::string error = capture_error([&] {
    result.path = reader.dir();
    result.metadata = reader.metadata();
    result.iteration = reader.metadata()["iteration"].get<int64_t>();
    result.consumed_samples = reader.metadata()["consumed_samples"].get<int64_t>();
    staged = stage_checkpoint(reader, model, optimizer, options, rank, world->size(), anywhere, result);
  });
  // Nothing is changed unless every rank staged everything.
  raise_first_error(all_gather_strings(*world, error), rank, "load_checkpoint '" + path + "'");

  for (auto& [dst, values] : staged.copies) dst.copy_(values);
  if (staged.optimizer_steps) {
    optimizer->set_steps(*staged.optimizer_steps);
    result.optimizer_loaded = true;
  }
  for (auto& [gen, st] : staged.generators) {
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(st);
  }
  result.rng_loaded = !staged.generators.empty();
  model.refresh_model_weights();  // main weights -> model weights; starts no all-gather
  return result;
}

}  // namespace

LoadedCheckpoint load_checkpoint(const CheckpointReader& reader, const std::shared_ptr<Communicator>& world,
                                 FsdpHandle& model, DistributedOptimizer* optimizer,
                                 const CheckpointLoadOptions& options) {
  if (!world) throw std::invalid_argument("load_checkpoint: the communicator is null");
  if (options.iteration)
    throw std::invalid_argument("load_checkpoint '" + reader.dir() +
                                "': options.iteration is for a load from a path; the reader is open on one iteration");
  return load_from(reader, reader.dir(), world, model, optimizer, options);
}

LoadedCheckpoint load_checkpoint(const std::string& load_dir, const std::shared_ptr<Communicator>& world,
                                 FsdpHandle& model, DistributedOptimizer* optimizer,
                                 const CheckpointLoadOptions& options) {
  if (!world) throw std::invalid_argument("load_checkpoint: the communicator is null");
  std::optional<CheckpointReader> reader;
  // The ranks agree on the open before the load's collectives, so a rank that cannot open it
  // does not leave the others waiting.
  const std::string error =
      capture_error([&] { reader.emplace(resolve_checkpoint_dir(load_dir, options.iteration)); });
  raise_first_error(all_gather_strings(*world, error), world->rank(), "load_checkpoint '" + load_dir + "'");
  return load_from(*reader, load_dir, world, model, optimizer, options);
}

}  // namespace mfsdp
