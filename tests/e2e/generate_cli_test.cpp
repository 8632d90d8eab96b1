// mfsdp-generate's command line: every bad value exits 2 naming the flag, before the model is
// read (the --model given here does not exist, so reaching the load would fail otherwise, with
// exit 1); values that used to be misread (a list as its first number, a seed past 2^32 as 0) or
// to fail deep in LibTorch (a temperature of 1e-300) are refused.
#include <gtest/gtest.h>

#include <string>

#include "harness/run_command.h"

namespace {

const std::string kGenerate = std::string(MFSDP_GENERATE_BIN_PATH) + " --device cpu --model /nonexistent/mfsdp-model";

void expect_refused(const std::string& flags, const std::string& needle) {
  const auto r = mfsdp::testing::run_command(kGenerate + flags);
  EXPECT_EQ(r.exit_code, 2) << flags << "\n" << r.output;
  EXPECT_NE(r.output.find(needle), std::string::npos) << flags << "\n" << r.output;
  EXPECT_EQ(r.output.find("/nonexistent/mfsdp-model' does not exist"), std::string::npos)
      << "the model was read before the flags were checked: " << r.output;
  for (const char* internal : {"top_p must", "max_new_tokens", "Exception raised from"})
    EXPECT_EQ(r.output.find(internal), std::string::npos) << flags << "\n" << r.output;
}

}  // namespace

TEST(GenerateCli, BadValuesExitTwoNamingTheFlagBeforeTheModelIsRead) {
  expect_refused(" --prompt-ids 1 --max-new-tokens 1,2", "--max-new-tokens");
  expect_refused(" --prompt-ids 1 --max-new-tokens -1", "--max-new-tokens");
  expect_refused(" --prompt-ids 1 --max-new-tokens 2000000", "--max-new-tokens");
  expect_refused(" --prompt-ids 1 --temperature 1e-300", "--temperature");
  expect_refused(" --prompt-ids 1 --temperature 0", "--temperature");
  expect_refused(" --prompt-ids 1 --top-p 0", "--top-p");
  expect_refused(" --prompt-ids 1 --top-p 1.5", "--top-p");
  expect_refused(" --prompt-ids 1 --top-k -3", "--top-k");
  expect_refused(" --prompt-ids 1 --seed 18446744073709551616", "--seed");
  expect_refused(" --prompt-ids 1 --seed -1", "--seed");
  expect_refused(" --prompt-ids 1,x", "--prompt-ids");
  expect_refused(" --prompt-ids 1,-2", "--prompt-ids");
  expect_refused(" --prompt-ids 1 --device tpu", "--device");
  expect_refused(" --prompt-ids 1 --prompt hello", "--prompt");
  expect_refused("", "--prompt / --prompt-ids");
  expect_refused(" --prompt-ids 1 --vocab-file v.json", "--vocab-file / --merge-file");
  expect_refused(" --prompt-ids 1 --model-config /nonexistent/config.json", "--model-config");
  expect_refused(" --prompt-ids 1 --no-such-flag", "--no-such-flag");
  // Good flags reach the model, whose absence is then the error (exit 1, naming it).
  const auto r = mfsdp::testing::run_command(kGenerate + " --prompt-ids 1,2 --seed 4294967296 --temperature 0.5");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("/nonexistent/mfsdp-model"), std::string::npos) << r.output;
}
