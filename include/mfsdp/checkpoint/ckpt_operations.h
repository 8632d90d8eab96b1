// The library side of `mfsdp-ckpt`'s inspect, print-tensor, compare and convert (docs/mfsdp_ckpt.md),
// so that tests call what the tool runs; export-hf and import-hf are hf_interop.h.
//
// Errors are std::invalid_argument naming the file or folder and, where one is at fault, the
// tensor. compare, inspect and print-tensor read piece by piece (TensorSource, tensor_source.h);
// convert holds the whole model in memory.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/checkpoint/state_dict_ops.h"
#include "mfsdp/checkpoint/tensor_source.h"

namespace mfsdp {

// ---- inspect, print-tensor ---------------------------------------------------------------------

// `mfsdp-ckpt inspect`: the metadata (format, version, iteration, consumed_samples, world_size,
// args, model_config, scheduler, optimizer, files) and "tensors": {name: {dtype, shape, chunks:
// count}}; with `chunks`, "chunks" is the metadata's list (file, key, offset, numel, bytes).
// Plus "summary": {tensors, model_parameters, total_bytes}.
nlohmann::ordered_json inspect_checkpoint(const CheckpointReader& reader, bool chunks);

// `mfsdp-ckpt print-tensor`: dtype, shape, the first `max_elements` values (row-major) and
// min/max/mean (over every element, in fp64). `name` may omit the leading "model." of a
// model tensor.
std::string describe_tensor(const TensorSource& source, const std::string& name, int64_t max_elements);

// ---- compare -----------------------------------------------------------------------------------

// One row of `mfsdp-ckpt compare-two-checkpoint` (alias `compare`).
struct TensorComparison {
  std::string name;
  enum class Status { kEqual, kDifferent, kShapeMismatch, kOnlyInA, kOnlyInB } status = Status::kEqual;
  double max_abs_diff = 0;  // fp64; NaN where one side is NaN and the other not (same-position
                            // NaNs and equal infinities count as equal)
  std::vector<int64_t> shape_a, shape_b;
  at::ScalarType dtype_a = at::kFloat, dtype_b = at::kFloat;
};
// What counts as equal: torch.allclose's |a - b| <= atol + rtol * |b| per element (NaNs at the
// same place and equal infinities are equal). The defaults are Megatron checkpoint_inspector's
// compare-two-checkpoint; atol = rtol = 0 asks for the same values bit for bit.
struct CompareOptions {
  double atol = 1e-8;
  double rtol = 1e-5;
  bool model_only = false;  // only names starting with "model."
  at::Device device = at::kCPU;  // where the differences are computed
};
struct ComparisonReport {
  std::vector<TensorComparison> rows;  // every tensor name of A and B, sorted
  CompareOptions options;
  // Between two DCP checkpoints: non-tensor entries (pickled objects: optimizer groups, RNG
  // states, ...) whose key is in one checkpoint only; their values are not compared.
  std::vector<std::string> objects_only_in_a, objects_only_in_b;
  bool same = true;  // every tensor in both, same shape, allclose (dtypes may differ); no lone object
  std::string table() const;  // the text the tool prints
};
// Compares element by element in fp64, a bounded number of elements at a time, on
// options.device (blocks are read on the CPU and moved there).
ComparisonReport compare_tensors(const TensorSource& a, const TensorSource& b, const CompareOptions& options = {});

// ---- convert: state-dict transforms ------------------------------------------------------------

struct StateTransform {
  StateDictOps ops;    // Megatron's modify-state-dict ops (state_dict_ops.h)
  bool swiglu = false;  // split fused fc1 into gate/up
};

// Applies, in this order: the remove ops (drops every name in which a remove regex is found);
// `swiglu` (every tensor whose last-but-one name component is "fc1" or "linear_fc1", e.g.
// "decoder.layers.0.mlp.linear_fc1.weight", is split along dim 0 into its first half, named with
// "gate_proj" in place of that component, and its second half, named with "up_proj"; Megatron's
// fused [gate; up] layout); the rename ops (the first that matches each name rewrites it).
// Throws std::invalid_argument naming the tensor for an fc1 weight with an odd or missing dim 0,
// naming both source tensors when two end up with one name, and for an empty name.
std::map<std::string, at::Tensor> apply_state_transform(std::map<std::string, at::Tensor> tensors,
                                                        const StateTransform& transform);

// `mfsdp-ckpt convert IN OUT`: IN is an HF folder (its tensors by HF name, model_config = its
// config.json), a torch.save file (read_torch_save: flattened keys; model_config empty) or a
// checkpoint (its "model." tensors without the prefix; model_config copied). The transform is
// applied, then OUT is written by write_checkpoint as "model.<name>" tensors, model weights only,
// at `iteration`, args {"converted_from": IN}. Returns the names written (without "model.").
std::vector<std::string> convert_to_checkpoint(const std::string& in, const std::string& out,
                                               const StateTransform& transform, int64_t iteration);

// ---- flag values -------------------------------------------------------------------------------

// "500MB", "2GB", "1.5GB", "64KiB", "123" (bytes): decimal units K/M/G/T(B) = 10^3.., binary
// KiB/MiB/GiB/TiB = 2^10..; case-insensitive. Throws std::invalid_argument naming the text.
uint64_t parse_byte_size(const std::string& text);

}  // namespace mfsdp
