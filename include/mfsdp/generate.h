// Text generation with a trained (unsharded) Llama model: greedy or top-k / top-p sampling with a
// KV cache; and load_model, which reads a sharded checkpoint (any world size) or a Hugging Face
// Llama folder for mfsdp-generate. There is no model format of its own: a run's weights reach
// generation as its `--save` checkpoint or its `--export-hf` folder.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mfsdp/llama.h"

namespace mfsdp {

struct GenerateOptions {
  int64_t max_new_tokens = 64;
  bool greedy = false;       // argmax; else sample
  double temperature = 1.0;  // > 0
  int64_t top_k = 0;         // 0: no top-k filter
  double top_p = 1.0;        // (0, 1]: nucleus filter
  uint64_t seed = 0;
  int64_t stop_id = -1;      // stop after generating this id (e.g. EOD); -1: never
};

// Returns the generated ids (without the prompt, with stop_id when produced): generate_batch
// (batched_generate.h) on a batch of one with row seed `seed`, so a KV cache, the prompt once,
// then one token per step, stopping before a token would sit at position max_position_embeddings.
// Throws std::invalid_argument on bad options or an empty prompt.
std::vector<int64_t> generate(LlamaForCausalLMImpl& model, const std::vector<int64_t>& prompt,
                              const GenerateOptions& options);

struct LoadedModel {
  LlamaForCausalLM model{nullptr};  // fp32, on CPU
  std::string tokenizer_type;       // "" when the source does not say (HF folders, imports)
};

// What mfsdp-generate --model accepts:
//   a sharded checkpoint (locate_checkpoint, checkpoint.h: a save folder, read at its latest
//     iteration, or an iteration folder of either format, a bare PyTorch dcp.save folder
//     included): its metadata's model_config (or `model_config_file`) and its "model." tensors; the
//     tokenizer is the checkpoint's "--tokenizer-type" argument, if any;
//   a Hugging Face Llama or Qwen2 folder (is_hf_folder: config.json + model.safetensors or an
//     index with shards), as import_hf accepts it: "rotary_emb.inv_freq" buffers are ignored, a
//     tied model's "lm_head.weight" must equal the embedding, bias tensors are an error unless
//     the config has Qwen2's q/k/v biases (then exactly those are required).
// Tensors are read through TensorSource (tensor_source.h) and cast to fp32; the set of tensors is
// checked with check_llama_tensors (hf_interop.h) before any is read. Errors
// (std::invalid_argument) name `path` and what was wrong: not one of these, a config that is not
// a supported Llama config, missing / unexpected / misshapen / non-floating-point tensors.
// `model_config_file`: the model as a Hugging Face config.json, for a checkpoint that records no
// model_config (PyTorch's dcp.save; checkpoint_model_config in tensor_source.h).
LoadedModel load_model(const std::string& path, const std::string& model_config_file = "");

}  // namespace mfsdp
