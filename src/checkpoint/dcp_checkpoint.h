// Internal to src/checkpoint: the fsdp_dtensor format as Megatron-FSDP writes it, a PyTorch
// Distributed Checkpoint (include/mfsdp/checkpoint/dcp.h) with Megatron's key names (docs/checkpoints.md).
//
// Inside mfsdp a checkpoint's tensors have *canonical* names, whatever the file format
// ("model.<fqn>", "optimizer.state.<fqn>.<key>", "rng_state.rank<r>.cpu"; checkpoint.h). On disk
// they are Megatron-FSDP's keys:
//
//   model.<fqn>                   <->  model.module.<fqn>
//   optimizer.state.<fqn>.<key>   <->  optimizer.state.module.module.module.<fqn>.<key>
//   rng_state.rank<r>.cpu / .cuda <->  rng_state.(0, 0).<r>.torch_rng_state / .cuda_rng_state
//
// Reading also accepts PyTorch's plain names ("model.<fqn>" of dcp.save({"model":
// model.state_dict()}), "optimizer.state.<fqn>.<key>" of get_optimizer_state_dict).
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "mfsdp/checkpoint/dcp.h"

namespace mfsdp::checkpoint {

std::string to_dcp_key(const std::string& canonical);
std::string from_dcp_key(const std::string& key);
// The key's path in the nested state dict Megatron builds ({"model": {"module.<fqn>": ...}}).
std::vector<std::string> dcp_path(const std::string& key);

// One tensor's piece a rank writes: elements [offset, offset + data.numel()) of the flattened
// tensor `tensor` (a canonical name) of global `shape`.
// Under tensor parallelism (TensorSlice, checkpoint.h) the elements are those of the rank's slice
// of `slice_shape` at `origin` in the tensor; empty: the whole tensor.
struct TensorPiece {
  std::string tensor;
  std::vector<int64_t> shape;
  int64_t offset = 0;
  at::Tensor data;  // 1-D
  std::vector<int64_t> slice_shape = {}, origin = {};
  // When `data` is undefined: gives it when the piece is written, so a writer holds one piece at a
  // time (write_checkpoint of a model larger than memory).
  std::function<at::Tensor()> read = {};
};

// The boxes of `shape` holding elements [begin, end) of the flattened slice of `slice_shape` at
// `origin` (dcp::flat_range_boxes of the slice, moved to where the slice lies).
std::vector<dcp::Box> slice_range_boxes(const std::vector<int64_t>& slice_shape, const std::vector<int64_t>& origin,
                                        int64_t begin, int64_t end);
// The same elements as runs of the flattened tensor of `shape`: (first element, length) in
// order, for readers of flat ranges (the mfsdp format, safetensors files, fused tensors).
std::vector<std::pair<int64_t, int64_t>> slice_range_runs(const std::vector<int64_t>& shape,
                                                          const std::vector<int64_t>& slice_shape,
                                                          const std::vector<int64_t>& origin, int64_t begin, int64_t end);

// Writes this rank's __<rank>_0.distcp into `dir`: every piece as DCP chunks (boxes of the
// global tensor), and on rank 0 also the non-tensor entries of `metadata` (mfsdp's metadata.json
// content as "mfsdp_metadata", and Megatron's "iteration", "checkpoint_version" and per-parameter
// optimizer step). Returns the rank's report for write_dcp_metadata.
nlohmann::json write_dcp_rank_file(const std::string& dir, int rank, const std::vector<TensorPiece>& pieces,
                                   const nlohmann::json& metadata);

// Rank 0: `dir`/.metadata and .checksums.json from every rank's report (reports[r] from rank r). Throws
// std::logic_error if ranks disagree on a tensor or its chunks do not add up to it (a bug).
void write_dcp_metadata(const std::string& dir, const std::vector<nlohmann::json>& reports);

// A tensor of mfsdp's view made of rows of a tensor on disk: the source viewed as [rows,
// row_numel], rows taken run by run and concatenated. A stored tensor is one run of all its rows;
// a Megatron layer's q_proj is every query group's q rows of the fused linear_qkv
// (megatron_gpt_names.h), a torch_dist layer is one index of the stacked layer axis.
struct RowSource {
  std::string key;
  int64_t row_numel = 1;
  std::vector<std::pair<int64_t, int64_t>> runs;  // (first source row, rows)
};

// The whole of `key` (of `shape`) as a RowSource.
RowSource whole_tensor(const std::string& key, const std::vector<int64_t>& shape);

// Elements [offset, offset + dst.numel()) of the tensor `source` describes, into the 1-D `dst`.
void read_rows(const dcp::Reader& reader, const RowSource& source, int64_t offset, const at::Tensor& dst);

// The DCP checkpoint `path` names (an iteration folder, or a save folder's latest); an mfsdp
// format checkpoint or anything else is std::invalid_argument saying so.
dcp::Reader open_dcp_folder(const std::string& path);

// A DCP checkpoint opened for CheckpointReader: the metadata.json-shaped JSON (from
// "mfsdp_metadata", or made up from Megatron's or PyTorch's entries for a checkpoint mfsdp did not
// write) with "tensors" and "files" under canonical names, and the on-disk key of each name.
struct OpenedDcp {
  std::shared_ptr<const dcp::Reader> reader;
  nlohmann::json metadata;
  std::map<std::string, RowSource> sources;  // canonical name -> where its elements are
};
OpenedDcp open_dcp_checkpoint(const std::string& dir);

}  // namespace mfsdp::checkpoint
