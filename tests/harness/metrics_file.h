// The records of a trainer's --metrics-file (JSON lines, one per logged step) as tests read them.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <fstream>
#include <map>
#include <string>
#include <vector>

namespace mfsdp::testing {

// The training records of a metrics file, in order (evaluation records, "eval": true, left out).
inline std::vector<nlohmann::json> training_records(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    nlohmann::json r = nlohmann::json::parse(line);
    if (!r.value("eval", false)) out.push_back(r);
  }
  return out;
}

// Each iteration's lm loss, from the last record of each (a restarted run logs some twice).
inline std::map<int64_t, double> losses_by_iteration(const std::string& path) {
  std::map<int64_t, double> out;
  for (const auto& r : training_records(path)) out[r["iteration"].get<int64_t>()] = r["lm_loss"].get<double>();
  return out;
}

}  // namespace mfsdp::testing
