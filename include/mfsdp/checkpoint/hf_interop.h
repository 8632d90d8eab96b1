// Hugging Face import and export: a checkpoint's model as a folder transformers loads, and a
// transformers folder of a registered model family (model_spec.h) as a checkpoint to fine-tune from (`mfsdp-ckpt export-hf` and
// `import-hf`, docs/mfsdp_ckpt.md).
//
//   mfsdp::export_hf("ckpt", "hf_out", std::nullopt, 5'000'000'000);  // checkpoint -> HF folder
//   mfsdp::import_hf("hf_in", "ckpt_in");                               // HF folder -> checkpoint
//
// Names: a checkpoint stores the model's parameters as "model.<fqn>" (checkpoint.h) and the fqns
// of every family's CausalLM are transformers' names (causal_lm.h), so an HF tensor "<name>" is the
// checkpoint tensor "model.<name>" ("model.layers.0.mlp.up_proj.weight" is stored as
// "model.model.layers.0.mlp.up_proj.weight", "lm_head.weight" as "model.lm_head.weight").
//
// Both read and check everything before they write anything; checkpoints are written with
// write_checkpoint (atomic), HF weights with write_safetensors_sharded. Errors are
// std::invalid_argument naming the file or folder and, where one is at fault, the tensor.
// Limitation: both hold the whole model in memory (once, in the output dtype).
// Reading either kind without converting it: tensor_source.h; the other mfsdp-ckpt operations:
// ckpt_operations.h.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mfsdp/models/model_spec.h"

namespace mfsdp {

// Writes `out_dir`/config.json (the family's hf_config of the checkpoint's model_config, torch_dtype =
// the export dtype, pretty-printed) and the checkpoint's "model." tensors, without that prefix
// and in the export dtype, as model.safetensors, or as shards plus model.safetensors.index.json
// when they exceed max_shard_bytes. `ckpt` is a save folder (its latest iteration) or an
// iter_NNNNNNN folder. The export dtype is `dtype` (float32, bfloat16 or float16) when given,
// else the checkpoint's own: the dtype of its "model.model.embed_tokens.weight" (every tensor
// is cast to it when the model's tensors disagree, as import_hf records that dtype too), so
// import_hf followed by export_hf gives back the folder's weights byte for byte. Returns the
// export dtype. Errors, before anything is written: no model_config (recorded or given), a
// model_config that no model family reads, tensors that do not match it exactly (a
// missing or unexpected tensor, a wrong shape: named), a non-floating-point tensor, no `dtype`
// and a checkpoint dtype that safetensors exports do not take here (float64: pass a dtype).
// `model_config_file`: the model as a Hugging Face config.json, for a checkpoint that records no
// model_config (PyTorch's dcp.save; checkpoint_model_config in tensor_source.h).
at::ScalarType export_hf(const std::string& ckpt, const std::string& out_dir, std::optional<at::ScalarType> dtype,
                         uint64_t max_shard_bytes, const std::string& model_config_file = "");

// Reads an HF folder (a config.json whose model_type a family reads, model_spec_for_hf;
// model.safetensors or an index with shards) and writes `out_ckpt` as an fsdp_dtensor
// checkpoint with the model weights only (iteration 0, no optimizer state), the tensors in their
// saved dtype, model_config = the family's hf_config(config, dtype of embed_tokens), args
// {"imported_from": hf_dir}: what `mfsdp-pretrain --load OUT --finetune` starts from.
// Dropped: "*rotary_emb.inv_freq" buffers; "lm_head.weight" of a tied model when it equals
// model.embed_tokens.weight exactly (otherwise an error). Qwen2's q/k/v biases are imported
// (the family's with_hf_tensors: all of them or none). Errors: some biases but not all, or
// biases its config does not provide for (named), a missing or unexpected tensor, a wrong shape
// (both shapes), a non-floating-point tensor.
void import_hf(const std::string& hf_dir, const std::string& out_ckpt);

// Throws std::invalid_argument (starting with `where`) unless `shapes` holds exactly the
// parameters of the model `config` describes (model_tensor_shapes, model_spec.h) with their
// shapes. The message names every missing, unexpected and misshapen tensor (up to 8 of each,
// then a count).
void check_model_tensors(const std::map<std::string, std::vector<int64_t>>& shapes, const ModelConfig& config,
                         const std::string& where);

}  // namespace mfsdp
