// Hugging Face interop and the library side of the `mfsdp-ckpt` tool (docs/mfsdp_ckpt.md).
//
//   mfsdp::export_hf("ckpt", "hf_out", at::kBFloat16, 5'000'000'000);   // checkpoint -> HF folder
//   mfsdp::import_hf("hf_in", "ckpt_in");                                 // HF folder -> checkpoint
//
// Names: a checkpoint stores the model's parameters as "model.<fqn>" (checkpoint.h) and the fqns
// of LlamaForCausalLM are transformers' names (llama.h), so an HF tensor "<name>" is the
// checkpoint tensor "model.<name>" ("model.layers.0.mlp.up_proj.weight" is stored as
// "model.model.layers.0.mlp.up_proj.weight", "lm_head.weight" as "model.lm_head.weight").
//
// Every function reads and checks everything before it writes anything; checkpoints are written
// with write_checkpoint (atomic), HF weights with write_safetensors_sharded. Errors are
// std::invalid_argument naming the file or folder and, where one is at fault, the tensor.
// Limitation: export, import and convert hold the whole model in memory (once, in the output
// dtype); compare, inspect and print-tensor read piece by piece.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mfsdp/checkpoint.h"
#include "mfsdp/llama.h"
#include "mfsdp/safetensors.h"

namespace mfsdp {

// ---- Hugging Face export / import ------------------------------------------------------------

// Writes `out_dir`/config.json (llama_hf_config of the checkpoint's model_config, torch_dtype =
// `dtype`, pretty-printed) and the checkpoint's "model." tensors, without that prefix and cast to
// `dtype` (float32, bfloat16 or float16), as model.safetensors, or as shards plus
// model.safetensors.index.json when they exceed max_shard_bytes. `ckpt` is a save folder (its
// latest iteration) or an iter_NNNNNNN folder. Errors, before anything is written: no
// model_config in the metadata, a model_config that is not a supported Llama config, tensors
// that do not match it exactly (a missing or unexpected tensor, a wrong shape: named).
void export_hf(const std::string& ckpt, const std::string& out_dir, at::ScalarType dtype,
               uint64_t max_shard_bytes);

// Reads an HF folder (config.json of model_type llama, or mistral/qwen2 as llama_config_from_hf
// accepts; model.safetensors or an index with shards) and writes `out_ckpt` as an fsdp_dtensor
// checkpoint with the model weights only (iteration 0, no optimizer state), the tensors in their
// saved dtype, model_config = llama_hf_config(config, dtype of embed_tokens), args
// {"imported_from": hf_dir}: what `mfsdp-pretrain --load OUT --finetune` starts from.
// Dropped: "*rotary_emb.inv_freq" buffers; "lm_head.weight" of a tied model when it equals
// model.embed_tokens.weight exactly (otherwise an error). Qwen2's q/k/v biases are imported
// (reconcile_hf_biases, hf_llama.h: all of them or none). Errors: some biases but not all, or
// biases under a Llama config (named), a missing or unexpected tensor, a wrong shape (both
// shapes), a non-floating-point tensor.
void import_hf(const std::string& hf_dir, const std::string& out_ckpt);

// Name -> shape of every parameter LlamaForCausalLM(cfg) has, in module order (embedding, layers,
// final norm, lm_head). Built from a deferred-init model: nothing is allocated.
std::vector<std::pair<std::string, std::vector<int64_t>>> llama_parameter_shapes(const LlamaConfig& cfg);

// Throws std::invalid_argument (starting with `where`) unless `shapes` holds exactly the
// parameters of LlamaForCausalLM(cfg) with their shapes. The message names every missing,
// unexpected and misshapen tensor (up to 8 of each, then a count).
void check_llama_tensors(const std::map<std::string, std::vector<int64_t>>& shapes, const LlamaConfig& cfg,
                         const std::string& where);

// ---- Where tensors come from -------------------------------------------------------------------

// True when `path` is a folder with config.json and model.safetensors or
// model.safetensors.index.json (a Hugging Face model folder).
bool is_hf_folder(const std::string& path);
// True when `path` is a checkpoint save folder (latest_checkpointed_iteration.txt) or an
// iter_NNNNNNN folder (metadata.json).
bool is_checkpoint(const std::string& path);

// Read-only, whole-tensor or element-range access to the tensors of a checkpoint (every tensor:
// model, optimizer state, RNG) or of an HF folder (names "model.<HF name>", see above). Only
// headers are read when opening; an HF folder's index and shard headers are validated as
// read_safetensors_folder does.
class TensorSource {
 public:
  // A checkpoint or an HF folder (is_checkpoint / is_hf_folder); anything else throws.
  explicit TensorSource(const std::string& path);

  bool is_checkpoint() const { return reader_ != nullptr; }
  // "checkpoint <iter dir>" or "Hugging Face folder <dir>".
  std::string description() const;
  const std::vector<std::string>& names() const { return names_; }  // sorted
  bool contains(const std::string& name) const;
  std::vector<int64_t> shape(const std::string& name) const;
  at::ScalarType dtype(const std::string& name) const;
  int64_t numel(const std::string& name) const;
  at::Tensor read(const std::string& name) const;
  // Elements [offset, offset + count) of the flattened tensor, as a 1-D CPU tensor.
  at::Tensor read_elements(const std::string& name, int64_t offset, int64_t count) const;
  // The checkpoint's model_config, or the HF folder's config.json (an empty object if none).
  nlohmann::json model_config() const;
  const CheckpointReader* checkpoint() const { return reader_.get(); }

 private:
  std::string path_;
  std::unique_ptr<CheckpointReader> reader_;
  std::vector<SafetensorsFile> files_;                   // HF folder: its safetensors files
  std::map<std::string, std::pair<size_t, std::string>> hf_;  // "model.<n>" -> (file, "<n>")
  std::vector<std::string> names_;
};

// ---- The tool's operations ---------------------------------------------------------------------

// `mfsdp-ckpt inspect`: the metadata (format, version, iteration, consumed_samples, world_size,
// args, model_config, scheduler, optimizer, files) and "tensors": {name: {dtype, shape, chunks:
// count}}; with `chunks`, "chunks" is the metadata's list (file, key, offset, numel, bytes).
// Plus "summary": {tensors, model_parameters, total_bytes}.
nlohmann::ordered_json inspect_checkpoint(const CheckpointReader& reader, bool chunks);

// `mfsdp-ckpt print-tensor`: dtype, shape, the first `max_elements` values (row-major) and
// min/max/mean (over every element, in fp64). `name` may omit the leading "model." of a
// model tensor.
std::string describe_tensor(const TensorSource& source, const std::string& name, int64_t max_elements);

// One row of `mfsdp-ckpt compare`.
struct TensorComparison {
  std::string name;
  enum class Status { kEqual, kDifferent, kShapeMismatch, kOnlyInA, kOnlyInB } status = Status::kEqual;
  double max_abs_diff = 0;  // fp64; NaN where one side is NaN and the other not (same-position
                            // NaNs and equal infinities count as equal)
  std::vector<int64_t> shape_a, shape_b;
  at::ScalarType dtype_a = at::kFloat, dtype_b = at::kFloat;
};
struct ComparisonReport {
  std::vector<TensorComparison> rows;  // every name of A and B, sorted
  double atol = 0;
  bool same = true;  // every tensor in both, same shape, max |a-b| <= atol (dtypes may differ)
  std::string table() const;  // the text the tool prints
};
// Compares element by element in fp64, a bounded number of elements at a time, on `device`
// (blocks are read on the CPU and moved there). With `model_only`, only names starting with
// "model." are compared.
ComparisonReport compare_tensors(const TensorSource& a, const TensorSource& b, double atol, bool model_only = false,
                                 const at::Device& device = at::kCPU);

// ---- `mfsdp-ckpt convert`: state-dict transforms ----------------------------------------------

struct StateTransform {
  std::vector<std::string> remove;                            // ECMAScript regexes (full match)
  bool swiglu = false;                                        // split fused fc1 into gate/up
  std::vector<std::pair<std::string, std::string>> rename;    // OLD -> NEW, substring, in order
};

// Applies, in this order: `remove` (drops every name fully matching one of the regexes);
// `swiglu` (every tensor whose last-but-one name component is "fc1" or "linear_fc1", e.g.
// "decoder.layers.0.mlp.linear_fc1.weight", is split along dim 0 into its first half, named with
// "gate_proj" in place of that component, and its second half, named with "up_proj"; Megatron's
// fused [gate; up] layout); `rename` (every occurrence of OLD in every name becomes NEW, one
// rule after the other). Throws std::invalid_argument naming the tensor for an fc1 weight with an
// odd or missing dim 0, naming both source tensors when two end up with one name, and for an
// invalid regex.
std::map<std::string, at::Tensor> apply_state_transform(std::map<std::string, at::Tensor> tensors,
                                                        const StateTransform& transform);

// `mfsdp-ckpt convert IN OUT`: IN is an HF folder (its tensors by HF name, model_config = its
// config.json), a torch.save file (read_torch_save: flattened keys; model_config empty) or a
// checkpoint (its "model." tensors without the prefix; model_config copied). The transform is
// applied, then OUT is written by write_checkpoint as "model.<name>" tensors, model weights only,
// at `iteration`, args {"converted_from": IN}. Returns the names written (without "model.").
std::vector<std::string> convert_to_checkpoint(const std::string& in, const std::string& out,
                                               const StateTransform& transform, int64_t iteration);

// "500MB", "2GB", "1.5GB", "64KiB", "123" (bytes): decimal units K/M/G/T(B) = 10^3.., binary
// KiB/MiB/GiB/TiB = 2^10..; case-insensitive. Throws std::invalid_argument naming the text.
uint64_t parse_byte_size(const std::string& text);

}  // namespace mfsdp
