#include "fsdp/unit_parameters.h"

#include <algorithm>
#include <stdexcept>

namespace mfsdp::detail {

bool has_prefix(const std::string& name, const std::string& prefix) {
  return name.size() > prefix.size() && name.compare(0, prefix.size(), prefix) == 0 &&
         name[prefix.size()] == '.';
}

OwnedParameters owned_parameters(const torch::nn::Module& module, const std::vector<std::string>& inner_units) {
  OwnedParameters out;
  // Each tensor's first name and the unit owning it (an index into inner_units; -1: this unit).
  std::map<const c10::TensorImpl*, std::pair<std::string, int>> owner;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    const std::string& name = item.key();
    int unit_of = -1;
    size_t best = 0;
    for (size_t u = 0; u < inner_units.size(); ++u)
      if (has_prefix(name, inner_units[u]) && inner_units[u].size() >= best) {
        unit_of = static_cast<int>(u);
        best = inner_units[u].size();
      }
    auto [it, inserted] = owner.emplace(item.value().unsafeGetTensorImpl(), std::make_pair(name, unit_of));
    if (!inserted) {
      if (it->second.second != unit_of)
        throw std::invalid_argument(
            "fully_shard: parameter '" + name + "' is the same tensor as '" + it->second.first +
            "' but they belong to different units; put both modules in one unit (e.g. tie the "
            "embedding and output layer in the root) or untie them");
      continue;  // tied within this unit: one storage, first name wins
    }
    if (unit_of == -1) out.own.emplace_back(name, item.value());
  }
  for (const auto& [impl, entry] : owner) out.names[impl] = entry.first;
  return out;
}

std::vector<std::vector<NamedParameter>> parameter_groups(const std::vector<NamedParameter>& own) {
  std::vector<std::pair<std::pair<at::ScalarType, bool>, std::vector<NamedParameter>>> buckets;
  for (const auto& [name, p] : own) {
    const auto key = std::make_pair(p.scalar_type(), p.requires_grad());
    auto it = std::find_if(buckets.begin(), buckets.end(), [&](const auto& b) { return b.first == key; });
    if (it == buckets.end()) it = buckets.insert(buckets.end(), {key, {}});
    it->second.emplace_back(name, p);
  }
  std::vector<std::vector<NamedParameter>> groups;
  for (auto& bucket : buckets) groups.push_back(std::move(bucket.second));
  return groups;
}

}  // namespace mfsdp::detail
