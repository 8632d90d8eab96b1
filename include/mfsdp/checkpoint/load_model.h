// load_model: an unsharded model for inference (mfsdp-generate) from a sharded checkpoint of any
// world size or a Hugging Face folder of a registered model family; and the streaming Hugging Face
// load of the trainers' --hf-load: a folder described from its headers (describe_hf_model), then
// each rank's element ranges read straight into its shards (load_hf_shards), so no rank holds the
// whole model (docs/checkpoints.md, "Hugging Face").
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/comm/comm.h"
#include "mfsdp/fsdp/fully_shard.h"
#include "mfsdp/models/model_spec.h"

namespace mfsdp {

struct LoadedModel {
  std::shared_ptr<CausalLM> model;  // fp32, on CPU
  ModelConfig config;               // its family and configuration
  std::string tokenizer_type;       // "" when the source does not say (HF folders, imports)
};

// What mfsdp-generate --model accepts:
//   a sharded checkpoint (locate_checkpoint, checkpoint.h: a save folder, read at its latest
//     iteration, or an iteration folder of either format, a bare PyTorch dcp.save folder
//     included): its metadata's model_config (or `model_config_file`) and its "model." tensors; the
//     tokenizer is the checkpoint's "--tokenizer-type" argument, if any;
//   a Hugging Face folder (is_hf_folder: config.json + model.safetensors or an
//     index with shards), as import_hf accepts it: "rotary_emb.inv_freq" buffers are ignored, a
//     tied model's "lm_head.weight" must equal the embedding, tensors the family may leave out are
//     reconciled with its config (ModelSpec::with_hf_tensors: Qwen2's q/k/v biases, all or none).
// Tensors are read through TensorSource (tensor_source.h) and cast to fp32; the set of tensors is
// checked with check_model_tensors (hf_interop.h) before any is read. Errors
// (std::invalid_argument) name `path` and what was wrong: not one of these, a config that no
// model family reads, missing / unexpected / misshapen / non-floating-point tensors.
// `model_config_file`: the model as a Hugging Face config.json, for a checkpoint that records no
// model_config (PyTorch's dcp.save; checkpoint_model_config in tensor_source.h).
LoadedModel load_model(const std::string& path, const std::string& model_config_file = "");

class TensorSource;

// A Hugging Face folder's model, known from config.json and the safetensors headers alone.
struct HfModel {
  ModelConfig config;                                  // with_hf_tensors applied
  std::map<std::string, std::vector<int64_t>> shapes;  // the model's tensors by HF name
  std::string where;                                   // "Hugging Face folder '<dir>'"
};
// What load_model accepts from a folder, checked without reading a weight: the config (errors name
// config.json), the tensors a family may leave out, "rotary_emb.inv_freq" ignored, a tied
// "lm_head.weight" equal to the embedding (compared a piece at a time), check_model_tensors, and
// every model tensor floating point. std::invalid_argument naming the folder otherwise.
HfModel describe_hf_model(const TensorSource& source);

// --hf-load into a sharded model built from describe_hf_model(...).config (deferred init: the
// values are overwritten): every rank reads, for each parameter slice it holds
// (FsdpHandle::local_shards: its shard, its experts only under expert parallelism) and for the
// module buffers, just those elements from the safetensors files, converted to the buffer's dtype
// piece by piece (TensorSource::read_range), then refreshes the model weights from the main
// weights. Collective over `world`: an error on any rank (a tensor the model holds that the
// folder lacks or shapes otherwise, a short file) throws on every rank, naming the rank, the file
// and the tensor; the model's values are then undefined (the trainers exit). Returns the bytes
// this rank read. `slices`: the rank's tensor-parallel slices (TensorSlice, checkpoint.h), read
// as the runs of the whole tensors they cover.
int64_t load_hf_shards(const std::string& hf_dir, FsdpHandle& model, Communicator& world,
                       const TensorSlices& slices = {});

}  // namespace mfsdp
