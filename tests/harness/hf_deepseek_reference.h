// Runs tests/reference/deepseek_v3_reference.py (transformers' DeepSeek-V3 pieces) on tensors a
// test made: writes them and the configs to a temporary folder, runs the script with the
// reference environment's Python (MFSDP_PYTHON_PATH; MFSDP_SOURCE_DIR locates the script, both
// compile definitions of the including test) and returns what it wrote. Header-only.
#pragma once

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "harness/run_command.h"
#include "harness/temp_dir.h"
#include "mfsdp/checkpoint/safetensors.h"

namespace mfsdp::testing {

// One case: the config and the tensors the script reads.
struct DeepseekReferenceCase {
  nlohmann::json config;
  std::vector<std::pair<std::string, at::Tensor>> inputs;
};

// `mode` is the script's (route, rope, mla); all `cases` in one run of it. Returns, per case,
// what the script wrote for it; on a failure of the script the test fails with its output and
// the maps are empty.
inline std::vector<std::map<std::string, at::Tensor>> run_deepseek_reference(
    const std::string& mode, const std::vector<DeepseekReferenceCase>& cases) {
  TempDir dir("deepseek_ref");
  const std::string config_path = dir.file("cases.json"), in = dir.file("in.safetensors"),
                    out = dir.file("out.safetensors");
  nlohmann::json configs = nlohmann::json::array();
  std::vector<std::pair<std::string, at::Tensor>> inputs;
  for (size_t i = 0; i < cases.size(); ++i) {
    configs.push_back(cases[i].config);
    for (const auto& [name, t] : cases[i].inputs) inputs.emplace_back(std::to_string(i) + "." + name, t);
  }
  std::ofstream(config_path) << configs.dump();
  write_safetensors(in, inputs);
  const std::string cmd = std::string("OMP_NUM_THREADS=1 '") + MFSDP_PYTHON_PATH + "' '" + MFSDP_SOURCE_DIR +
                          "/tests/reference/deepseek_v3_reference.py' " + mode + " '" + config_path + "' '" + in +
                          "' '" + out + "'";
  const CommandOutcome r = run_command(cmd);
  EXPECT_EQ(r.exit_code, 0) << cmd << "\n" << r.output;
  std::vector<std::map<std::string, at::Tensor>> results(cases.size());
  if (r.exit_code != 0) return results;
  for (auto& [name, t] : SafetensorsFile(out).load_all()) {
    const size_t dot = name.find('.');
    results.at(std::stoul(name.substr(0, dot)))[name.substr(dot + 1)] = t;
  }
  return results;
}

}  // namespace mfsdp::testing
