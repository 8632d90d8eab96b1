// Internal to src/models: the Llama family's ModelSpec (Llama, Mistral without a sliding window,
// Qwen2; Megatron's GPT with RoPE and RMSNorm, SwiGLU or GeLU MLP). Registered in
// src/models/model_registry.cpp.
#pragma once

#include "mfsdp/models/llama_hf_config.h"

namespace mfsdp {

const ModelSpec& llama_spec();

}  // namespace mfsdp
