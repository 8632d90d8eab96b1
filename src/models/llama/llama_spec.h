// Internal to src/models: the decoder's ModelSpecs, registered in src/models/model_registry.cpp:
//   llama      Llama, Mistral without a sliding window, Qwen2 (Megatron's GPT with RoPE and RMSNorm,
//              SwiGLU or GeLU MLP);
//   qwen3      Qwen3 and Qwen3-MoE (per-head q/k RMSNorm, --qk-layernorm);
//   mixtral    Mixtral (experts without q/k norms or a shared expert);
//   qwen2_moe  Qwen2-MoE (a shared expert);
//   deepseek_v3  DeepSeek-V3 (multi-head latent attention, YaRN, group-limited sigmoid routing).
#pragma once

#include "mfsdp/models/llama_hf_config.h"

namespace mfsdp {

const ModelSpec& llama_spec();
const ModelSpec& qwen3_spec();
const ModelSpec& mixtral_spec();
const ModelSpec& qwen2_moe_spec();
const ModelSpec& deepseek_v3_spec();

}  // namespace mfsdp
