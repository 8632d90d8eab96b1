// Sharded checkpoints (docs/checkpoints.md). The default format, fsdp_dtensor, is a PyTorch
// Distributed Checkpoint with Megatron-FSDP's keys, which torch.distributed.checkpoint loads:
//
//   SAVE/latest_checkpointed_iteration.txt      "100"
//   SAVE/iter_0000100/.metadata                 DCP's pickled Metadata: every entry's global
//                                               shape, dtype and chunks (boxes), and where each
//                                               chunk lies
//   SAVE/iter_0000100/__0_0.distcp              what rank 0 wrote (its chunks, and the bytes
//                                               entry "mfsdp_metadata": progress, args,
//                                               model_config), __1_0.distcp rank 1's, ...
//   SAVE/iter_0000100/.checksums.json           mfsdp's CRC-32C of .metadata and every entry
//
// --ckpt-format mfsdp writes the earlier format instead (metadata.json with the same
// information, and rank_NNNNN.safetensors of 1-D element ranges named "<tensor>@<offset>");
// every reader takes both. Tensors, by their canonical names: "model.<fqn>" (main weights, or
// model weights for frozen parameters), "optimizer.state.<fqn>.<key>" (exp_avg, exp_avg_sq /
// momentum_buffer) and "rng_state.rank<r>.cpu" (that rank's generator state); dcp_checkpoint.cpp
// maps them to Megatron-FSDP's DCP keys and back. Each rank writes only what it holds, each
// element once (replicas split the writing); loading reads, on every rank, just the element
// ranges it owns now, so a checkpoint loads at another world size or with another strategy.
//
//   mfsdp::CheckpointInfo info{iteration, consumed_samples, args_json, config_json, sched_json};
//   mfsdp::save_checkpoint("ckpt", world, root, optimizer.get(), info);
//   mfsdp::LoadedCheckpoint got = mfsdp::load_checkpoint("ckpt", world, root, optimizer.get());
// Implemented in src/checkpoint/: sharded_checkpoint.cpp (save and load), checkpoint_reader.cpp
// (CheckpointReader), checkpoint_location.cpp (locate_checkpoint), dcp_checkpoint.cpp (the DCP files).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "mfsdp/checkpoint/safetensors.h"
#include "mfsdp/comm/comm.h"
#include "mfsdp/fsdp/fully_shard.h"
#include "mfsdp/optim/optim.h"

namespace mfsdp {

namespace checkpoint {
struct OpenedDcp;
}

// How a checkpoint is stored (docs/checkpoints.md). Loading reads either, whatever was asked.
enum class CheckpointFormat {
  kFsdpDtensor,  // Megatron-FSDP's fsdp_dtensor: a PyTorch Distributed Checkpoint (dcp.h) with
                 // Megatron's key names, which torch.distributed.checkpoint loads
  kMfsdp,        // mfsdp's earlier format: metadata.json + rank_NNNNN.safetensors (kept one release)
};

// "fsdp_dtensor" or "mfsdp" (--ckpt-format); anything else is std::invalid_argument.
CheckpointFormat checkpoint_format_from_name(const std::string& name);

// The file-system steps that commit a save (docs/checkpoints.md, "Atomic saves"), one call per
// step. The default does the real thing; tests substitute a subclass that dies at a chosen step,
// as LevelDB's fault-injecting Env does, to check that a save dying between any two steps leaves
// a checkpoint that loads.
class CheckpointFileSystem {
 public:
  virtual ~CheckpointFileSystem() = default;
  // `path` gets `bytes` through a temporary file, fsync and rename (.metadata, metadata.json,
  // latest_checkpointed_iteration.txt).
  virtual void write_file_atomically(const std::string& path, const std::string& bytes);
  // Renames `from` to `to`, which does not exist.
  virtual void rename(const std::string& from, const std::string& to);
  // Swaps two existing folders in one atomic step (Linux renameat2 RENAME_EXCHANGE). Returns
  // false, changing nothing, where the file system cannot (the commit then moves the old folder
  // aside first; readers fall back to it, see readable_iteration_dir in src/checkpoint).
  virtual bool exchange(const std::string& a, const std::string& b);
  virtual void remove_all(const std::string& path);
  // fsync of a folder, so the renames inside it are on disk.
  virtual void sync_directory(const std::string& dir);
  // Appends `length` bytes to a rank's open shard file `fd` (`path` names it in errors): every
  // byte of a .distcp file goes through here, on the writer thread of an asynchronous save
  // (AsyncCheckpointSaver) or on the caller's. Throws std::runtime_error naming `path`.
  virtual void append_to_shard(int fd, const std::string& path, const char* data, size_t length);
};

// The file system saves commit through (one per process). Passing nullptr restores the default.
// Set it before saving, not while a save runs.
CheckpointFileSystem& checkpoint_file_system();
void set_checkpoint_file_system(std::shared_ptr<CheckpointFileSystem> file_system);

// The format this build writes; it reads this and older versions.
constexpr int kCheckpointFormatVersion = 1;
constexpr const char* kCheckpointFormatName = "mfsdp.fsdp_dtensor";

// What a checkpoint records besides tensors. The JSON fields are stored as given.
struct CheckpointInfo {
  int64_t iteration = 0;
  int64_t consumed_samples = 0;
  nlohmann::json args = nlohmann::json::object();          // the run's arguments
  nlohmann::json model_config = nlohmann::json::object();  // the model's config.json (ModelConfig::hf)
  nlohmann::json scheduler = nlohmann::json::object();     // LR schedule fields
};

// Under tensor parallelism a rank's parameter is a slice of the whole tensor the checkpoint holds:
// Megatron-FSDP saves TP slices as DTensor shards of the whole tensor, so a checkpoint of TP 2
// loads at TP 1 or 4 and in PyTorch's dcp.load into a whole model. A rank writes its FSDP shard
// of the slice as boxes of the whole tensor and reads back the boxes its shard covers now.
struct TensorSlice {
  std::vector<int64_t> whole_shape;  // the tensor in the checkpoint
  std::vector<int64_t> origin;       // where the rank's slice starts in it, per dimension
  bool writes = true;                // false on the ranks whose copy of a replicated tensor
                                     // another tensor-parallel rank writes (each element once)
};
using TensorSlices = std::map<std::string, TensorSlice>;  // by parameter name; absent: held whole

// Saves SAVE/iter_<iteration>/ and then points latest_checkpointed_iteration.txt at it.
// Collective over `world` (every rank of the job; the model's communicators are subgroups of
// it). Atomic: written under SAVE/iter_<iteration>.tmp, renamed when every rank's shard file is
// on disk, `latest` rewritten last, so a crash leaves the previous checkpoint as latest. A
// failure on any rank throws on every rank (naming the rank and file) and commits nothing.
// `optimizer` may be null (model only). Replaces an existing checkpoint of the same iteration.
// `slices`: the rank's tensor-parallel slices (fsdp_dtensor only; the mfsdp format cannot hold
// them: std::invalid_argument).
void save_checkpoint(const std::string& save_dir, const std::shared_ptr<Communicator>& world,
                     const FsdpHandle& model, const DistributedOptimizer* optimizer,
                     const CheckpointInfo& info, CheckpointFormat format = CheckpointFormat::kFsdpDtensor,
                     const TensorSlices& slices = {});

struct CheckpointLoadOptions {
  std::optional<int64_t> iteration;  // unset: latest_checkpointed_iteration.txt
  bool load_optimizer = true;        // optimizer state and step (error if the checkpoint has none)
  bool load_rng = true;              // this rank's generator state (skipped when the world size
                                     // differs: reported in LoadedCheckpoint::rng_loaded)
  // Strict: every model tensor must be in the checkpoint and every "model." tensor of the
  // checkpoint in the model. Not strict: missing tensors keep their values and are listed.
  bool strict = true;
  TensorSlices slices;  // the rank's tensor-parallel slices (see TensorSlice)
  // true: every rank stages what it reads and checks it, and only when every rank succeeded is
  // anything copied in, so an error leaves the model and optimizer unchanged. false: each rank
  // reads straight into its shards, as torch's dcp.load does (no staging copy: loads ran 2x
  // faster, docs/PERFORMANCE.md), and an error leaves them partly loaded; for a model that is
  // dropped on error, as the trainers' at start-up.
  bool all_or_nothing = true;
};

struct LoadedCheckpoint {
  std::string path;  // the iter_NNNNNNN folder
  int64_t iteration = 0;
  int64_t consumed_samples = 0;
  nlohmann::json metadata;  // the whole metadata.json
  bool optimizer_loaded = false;
  bool rng_loaded = false;
  std::vector<std::string> missing;     // model tensors not in the checkpoint (not strict)
  std::vector<std::string> unexpected;  // checkpoint model tensors not in the model (not strict)
};

// The iteration latest_checkpointed_iteration.txt names, or nullopt when `dir` has no such file
// (nothing saved yet). Throws naming the file when its content is not an iteration number or
// its folder is missing.
std::optional<int64_t> latest_checkpoint_iteration(const std::string& dir);
// What a checkpoint path names: the one rule every tool applies to --load, --ref-load,
// `mfsdp-generate --model` and mfsdp-ckpt's CKPT arguments (docs/checkpoints.md, "What --load
// takes"). A path names, in this order:
//   - an iteration folder, when it holds .metadata (fsdp_dtensor, or any PyTorch Distributed
//     Checkpoint: a bare `dcp.save` folder from FSDP2 has no latest file) or metadata.json (the
//     earlier format); `step`, if given, must then be that folder's iteration;
//   - a save folder's iteration: iter_<step> when `step` is given, else the one
//     latest_checkpointed_iteration.txt names;
//   - nothing: a path that does not exist, or a folder with neither (an empty save folder, which
//     is how a resumable job starts). `reason` says which, for the caller's message.
// Throws std::invalid_argument naming the path for what cannot be meant: a file, a latest file
// that is not a number or names a missing folder, a `step` with no folder.
struct CheckpointLocation {
  std::string dir;     // the iteration folder; empty when the path holds no checkpoint
  std::string reason;  // when `dir` is empty: "does not exist" / "holds no checkpoint (...)"
  bool found() const { return !dir.empty(); }
};
CheckpointLocation locate_checkpoint(const std::string& path, std::optional<int64_t> step = std::nullopt);
// locate_checkpoint's iteration folder, or std::invalid_argument naming `path`, why it holds
// none, and what a checkpoint path is.
std::string resolve_checkpoint_dir(const std::string& path, std::optional<int64_t> step = std::nullopt);
// True when `path` holds a checkpoint by locate_checkpoint's rule (without a `step`); false for a
// missing path, a file (a torch.save file, say) or an empty folder. Whether the checkpoint's
// content can be read is CheckpointReader's to say. Throws for a folder's broken latest file.
bool is_checkpoint(const std::string& path);
// "<dir>/iter_0000100".
std::string checkpoint_iteration_dir(const std::string& dir, int64_t iteration);

class CheckpointReader;

// Loads into `model` (and `optimizer` unless null or options.load_optimizer is false), resharding
// to the current layout. Every rank stages what it reads and checks it; only when every rank
// succeeded is anything copied in, so an error (naming the file and tensor) leaves the model and
// optimizer unchanged on every rank (unless options.all_or_nothing is false). Collective over
// `world`; an error on any rank throws on every rank.
// This form reads from `reader`, opened by the caller on every rank on the same checkpoint, so
// one open serves the load and whatever else the caller reads (the trainer's model-config check,
// GRPO's reference policy): the metadata is parsed once. options.iteration must be unset (the
// reader already names its iteration folder): std::invalid_argument otherwise.
LoadedCheckpoint load_checkpoint(const CheckpointReader& reader, const std::shared_ptr<Communicator>& world,
                                 FsdpHandle& model, DistributedOptimizer* optimizer,
                                 const CheckpointLoadOptions& options = {});
// The same from a path (locate_checkpoint's rule, at options.iteration if set): opens one
// CheckpointReader per rank (a rank that cannot open it fails every rank, naming `load_dir`)
// and loads from it.
LoadedCheckpoint load_checkpoint(const std::string& load_dir,
                                 const std::shared_ptr<Communicator>& world, FsdpHandle& model,
                                 DistributedOptimizer* optimizer,
                                 const CheckpointLoadOptions& options = {});

// Whole-tensor access to a checkpoint from one process (mfsdp-ckpt, tests).
class CheckpointReader {
 public:
  // `path`: a SAVE folder (its latest iteration) or an iter_NNNNNNN folder, in either format.
  // Tensors have canonical names in both ("model.<fqn>", "optimizer.state.<fqn>.<key>",
  // "rng_state.rank<r>.cpu"; a DCP checkpoint's Megatron keys are mapped, see docs/checkpoints.md),
  // and metadata() is metadata.json's content (for DCP: the "mfsdp_metadata" entry, or what
  // Megatron's or PyTorch's entries say, plus "tensors" with each tensor's "key" on disk).
  // Validates the metadata (format, version, chunks inside every tensor); a shard file is
  // validated against the metadata when it is first read. Errors are std::invalid_argument
  // naming the file and, where one is at fault, the tensor. Construction is the one place the
  // metadata (.metadata and its pickled "mfsdp_metadata", or metadata.json) is parsed, so open
  // a checkpoint once and pass the reader on (load_checkpoint takes it).
  explicit CheckpointReader(const std::string& path);

  const std::string& dir() const { return dir_; }  // the iter_NNNNNNN folder
  CheckpointFormat format() const { return dcp_ ? CheckpointFormat::kFsdpDtensor : CheckpointFormat::kMfsdp; }
  const nlohmann::json& metadata() const { return metadata_; }
  std::vector<std::string> tensor_names() const;  // sorted
  bool contains(const std::string& name) const;
  std::vector<int64_t> shape(const std::string& name) const;
  at::ScalarType dtype(const std::string& name) const;
  // The whole tensor (assembled from its chunks), on CPU.
  at::Tensor read(const std::string& name) const;
  // Elements [offset, offset + dst.numel()) of the flattened tensor into the 1-D `dst`
  // (converted to dst's dtype and device).
  void read_range(const std::string& name, int64_t offset, const at::Tensor& dst) const;
  // Elements [offset, offset + dst.numel()) of the flattened slice of `slice_shape` at `origin`
  // of the tensor (a tensor-parallel rank's share, TensorSlice) into the 1-D `dst`.
  void read_slice_range(const std::string& name, const std::vector<int64_t>& slice_shape,
                        const std::vector<int64_t>& origin, int64_t offset, const at::Tensor& dst) const;
  // Every stored byte against the checksums the save recorded (docs/checkpoints.md, "Checksums"),
  // without loading tensors: throws std::invalid_argument naming the first file, tensor and byte
  // range that differ, or a checkpoint saved without checksums. Returns {entries, bytes} checked.
  std::pair<int64_t, uint64_t> verify_checksums() const;

 private:
  const SafetensorsFile& file(int index) const;  // opened and checked on first use
  const nlohmann::json& entry(const std::string& name) const;
  // Throws unless the chunk's bytes match the CRC-32C metadata.json gives them (if it does).
  void verify_chunk(const std::string& name, const nlohmann::json& chunk) const;

  std::string dir_;
  nlohmann::json metadata_;
  std::vector<std::string> files_;
  mutable std::map<int, SafetensorsFile> open_files_;
  mutable std::set<std::string> verified_chunks_;  // chunk keys
  // A DCP checkpoint: its reader, and where each canonical tensor's elements are on disk.
  std::shared_ptr<const checkpoint::OpenedDcp> dcp_;
};

// Test seam: how many times this process has parsed a checkpoint's metadata (counted as a
// CheckpointReader starts parsing it, so a parse that fails counts too), so a test can check that a load opens its checkpoint once
// per rank (tests/dist/checkpoint_reader_once_test.cpp). Thread-safe; never reset.
int64_t checkpoint_metadata_parse_count();

// Writes a complete checkpoint from whole tensors in one process (converters, HF import):
// "model.<name>" for every entry of `model_tensors`, no optimizer state or RNG, as one shard file.
// Atomic like save_checkpoint.
void write_checkpoint(const std::string& save_dir, const std::map<std::string, at::Tensor>& model_tensors,
                      const CheckpointInfo& info, CheckpointFormat format = CheckpointFormat::kFsdpDtensor);
// The same (fsdp_dtensor) with each tensor read only when it is written: `read(name)` gives the
// tensor of `shapes`' shape, so one tensor is in memory at a time (mfsdp-ckpt import-hf of a model
// larger than the machine's memory).
void write_checkpoint(const std::string& save_dir, const std::map<std::string, std::vector<int64_t>>& shapes,
                      const std::function<at::Tensor(const std::string&)>& read, const CheckpointInfo& info);

}  // namespace mfsdp
