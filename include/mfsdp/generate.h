// Text generation with a trained (unsharded) Llama model: greedy or top-k / top-p sampling with a
// KV cache; and the "final model" folder the trainer writes (config.json + model.pt) that
// mfsdp-generate loads until fsdp_dtensor checkpoints exist.
#pragma once

#include <cstdint>
#include <map>
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

// Returns the generated ids (without the prompt). Runs model->forward with a KV cache: the prompt
// once, then one token per step. Throws std::invalid_argument on bad options or an empty prompt.
std::vector<int64_t> generate(LlamaForCausalLMImpl& model, const std::vector<int64_t>& prompt,
                              const GenerateOptions& options);

// Writes `dir`/config.json (the LlamaConfig and `tokenizer_type`) and `dir`/model.pt (a plain
// dict of full tensors by HF name, loadable with Python's torch.load).
void save_final_model(const std::string& dir, const LlamaConfig& config,
                      const std::string& tokenizer_type,
                      const std::map<std::string, at::Tensor>& state);

struct LoadedModel {
  LlamaForCausalLM model{nullptr};
  std::string tokenizer_type;
};
// Reads what save_final_model wrote; errors name the file and the missing or mis-shaped tensor.
LoadedModel load_final_model(const std::string& dir);

}  // namespace mfsdp
