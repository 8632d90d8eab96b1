// The smallest Llama the tests build (2 layers, d=16, GQA 4/2, vocab 40): shared by the tests that
// only need some Llama, so that each does not spell out its own.
#pragma once

#include "mfsdp/models/llama.h"

namespace mfsdp::testing {

inline LlamaConfig tiny_llama_config() {
  LlamaConfig c;
  c.vocab_size = 40;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 32;
  return c;
}

}  // namespace mfsdp::testing
