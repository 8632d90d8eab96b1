// Runs tests/reference/deepseek_v3_reference.py (transformers' DeepSeek-V3 pieces) on tensors a
// test made: writes them and the config to a temporary folder, runs the script with the
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

// `mode` is the script's (route, rope, mla); `config` becomes its CONFIG.json. On a failure of
// the script the test fails with its output and an empty map comes back.
inline std::map<std::string, at::Tensor> run_deepseek_reference(
    const std::string& mode, const nlohmann::json& config,
    const std::vector<std::pair<std::string, at::Tensor>>& inputs) {
  TempDir dir("deepseek_ref");
  const std::string config_path = dir.file("config.json"), in = dir.file("in.safetensors"),
                    out = dir.file("out.safetensors");
  std::ofstream(config_path) << config.dump();
  write_safetensors(in, inputs);
  const std::string cmd = std::string("OMP_NUM_THREADS=1 '") + MFSDP_PYTHON_PATH + "' '" + MFSDP_SOURCE_DIR +
                          "/tests/reference/deepseek_v3_reference.py' " + mode + " '" + config_path + "' '" + in +
                          "' '" + out + "'";
  const CommandOutcome r = run_command(cmd);
  EXPECT_EQ(r.exit_code, 0) << cmd << "\n" << r.output;
  if (r.exit_code != 0) return {};
  return SafetensorsFile(out).load_all();
}

}  // namespace mfsdp::testing
