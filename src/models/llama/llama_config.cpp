#include <stdexcept>
#include <string>

#include "mfsdp/models/llama.h"

namespace mfsdp {
namespace {

void require(bool ok, const std::string& field, const std::string& expected, const std::string& found) {
  if (!ok)
    throw std::invalid_argument("LlamaConfig." + field + ": expected " + expected + ", found " +
                                found);
}

}  // namespace

void LlamaConfig::validate() const {
  auto positive = [](const char* field, int64_t v) {
    require(v > 0, field, "a positive value", std::to_string(v));
  };
  positive("vocab_size", vocab_size);
  positive("hidden_size", hidden_size);
  positive("intermediate_size", intermediate_size);
  positive("num_layers", num_layers);
  positive("num_attention_heads", num_attention_heads);
  positive("num_key_value_heads", num_key_value_heads);
  positive("max_position_embeddings", max_position_embeddings);
  require(explicit_head_dim >= 0, "explicit_head_dim", "0 or a positive value", std::to_string(explicit_head_dim));
  require(explicit_head_dim > 0 || hidden_size % num_attention_heads == 0, "num_attention_heads",
          "a divisor of hidden_size " + std::to_string(hidden_size),
          std::to_string(num_attention_heads));
  require(num_attention_heads % num_key_value_heads == 0, "num_key_value_heads",
          "a divisor of num_attention_heads " + std::to_string(num_attention_heads),
          std::to_string(num_key_value_heads));
  require(mla.has_value() || head_dim() % 2 == 0, "num_attention_heads",
          "an even head_dim (hidden_size / num_attention_heads) for RoPE",
          "head_dim " + std::to_string(head_dim()));
  require(rope_theta > 0, "rope_theta", "a positive value", std::to_string(rope_theta));
  require(rms_norm_eps >= 0, "rms_norm_eps", "a non-negative value", std::to_string(rms_norm_eps));
  require(init_std >= 0, "init_std", "a non-negative value", std::to_string(init_std));
  if (mla) {
    try {
      mla->validate();
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(std::string("LlamaConfig.mla.") + (e.what() + std::string("MlaConfig.").size()));
    }
    require(mla->hidden_size == hidden_size, "mla.hidden_size", "hidden_size " + std::to_string(hidden_size),
            std::to_string(mla->hidden_size));
    require(mla->num_heads == num_attention_heads, "mla.num_heads",
            "num_attention_heads " + std::to_string(num_attention_heads), std::to_string(mla->num_heads));
    require(mla->rope_theta == rope_theta, "mla.rope_theta", "rope_theta " + std::to_string(rope_theta),
            std::to_string(mla->rope_theta));
  }
  try {
    moe.validate(num_layers);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string("LlamaConfig.") + e.what());  // "LlamaConfig.MoeConfig.<field>: ..."
  }
}

}  // namespace mfsdp
