#include <ATen/ATen.h>

#include <stdexcept>
#include <string>

#include "mfsdp/models/causal_lm.h"

namespace mfsdp {

KVCache::KVCache(int64_t num_layers) {
  if (num_layers <= 0)
    throw std::invalid_argument("KVCache: expected a positive number of layers, found " +
                                std::to_string(num_layers));
  keys_.resize(num_layers);
  values_.resize(num_layers);
}

int64_t KVCache::length() const { return keys_[0].defined() ? keys_[0].size(2) : 0; }

std::pair<at::Tensor, at::Tensor> KVCache::append(int64_t layer, const at::Tensor& k,
                                                       const at::Tensor& v) {
  if (layer < 0 || layer >= num_layers())
    throw std::out_of_range("KVCache::append: layer " + std::to_string(layer) +
                            " outside [0, " + std::to_string(num_layers()) + ")");
  // Keys and values may differ in width (multi-head latent attention's dn + dr and dv).
  if (k.dim() != 4 || v.dim() != 4 || !k.sizes().slice(0, 3).equals(v.sizes().slice(0, 3)))
    throw std::invalid_argument("KVCache::append: expected k [B, nkv, T, hd] and v [B, nkv, T, hd_v] "
                                "for layer " + std::to_string(layer));
  at::Tensor& keys = keys_[layer];
  at::Tensor& values = values_[layer];
  if (!keys.defined()) {
    keys = k.detach();
    values = v.detach();
  } else {
    if (keys.size(0) != k.size(0) || keys.size(1) != k.size(1) || keys.size(3) != k.size(3) ||
        values.size(3) != v.size(3))
      throw std::invalid_argument("KVCache::append: layer " + std::to_string(layer) +
                                  " caches shape " + c10::str(keys.sizes()) +
                                  ", appended keys of shape " + c10::str(k.sizes()));
    keys = at::cat({keys, k.detach()}, 2);
    values = at::cat({values, v.detach()}, 2);
  }
  return {keys, values};
}

void KVCache::clear() {
  for (auto& k : keys_) k = at::Tensor();
  for (auto& v : values_) v = at::Tensor();
}

}  // namespace mfsdp
