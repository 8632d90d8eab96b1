// YarnRopeScaling: the fields of a "yarn" rope_scaling, apart from the functions that use them
// (rope_scaling.h), so that model configs (mla_config.h, llama.h) can hold one.
#pragma once

#include <cstdint>

namespace mfsdp {

// HF's rope_scaling / rope_parameters of type "yarn". 0 for beta_fast / beta_slow means their
// defaults (32 / 1), as transformers' `or`; 0 for mscale / mscale_all_dim means unset.
struct YarnRopeScaling {
  double factor = 1.0;
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 32;
  double beta_slow = 1;
  double mscale = 0;
  double mscale_all_dim = 0;
  bool truncate = true;
  // Throws std::invalid_argument naming the field: factor > 0, original_max_position_embeddings
  // > 0, betas and mscales >= 0 and finite.
  void validate() const;
};

}  // namespace mfsdp
