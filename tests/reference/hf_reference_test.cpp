// Reference tests (ctest label "reference"): mfsdp's tools against the real transformers of the
// reference environment (CMake's MFSDP_PYTHON, the .venv scripts/setup.sh makes). The Python
// side is tests/reference/hf_llama_reference.py, one process per test case.
//
//   ExportHf*:  mfsdp-pretrain trains a tiny GQA Llama and saves a 2-rank checkpoint;
//               mfsdp-ckpt export-hf writes it as an HF folder; transformers loads that folder
//               and must give mfsdp-generate's logits (max |diff| <= 1e-5) and greedy ids.
//   ImportHf*:  transformers makes and saves a random GQA Llama; mfsdp-ckpt import-hf converts it,
//               and mfsdp-generate on the checkpoint and on the HF folder itself must give
//               transformers' logits and greedy ids.
//   Qwen2*:     the same import with a random Qwen2ForCausalLM (GQA, tied, non-zero q/k/v biases);
//               then the imported checkpoint goes back out through export-hf (model_type qwen2,
//               from the checkpoint's model_config) and transformers loads that folder as
//               Qwen2ForCausalLM with mfsdp's logits and greedy ids.
//   Qwen3*, Mixtral*, Qwen2Moe*, DeepseekV3*: the same import and export for those families.
//
// A missing reference Python or transformers is a failure (not a skip): these tests exist to run.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "harness/run_command.h"
#include "harness/temp_dir.h"
#include "mfsdp/checkpoint/safetensors.h"

namespace {

namespace fs = std::filesystem;
using mfsdp::testing::CommandOutcome;
using mfsdp::testing::TempDir;

const std::string kPython = MFSDP_PYTHON_PATH;
const std::string kScript = MFSDP_REFERENCE_SCRIPT;
constexpr int kNewTokens = 12;
constexpr double kLogitsAtol = 1e-5;

// Single-quoted for the shell.
std::string q(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

CommandOutcome run(const std::string& command) { return mfsdp::testing::run_command(command); }

// The reference Python with one thread: these tests share a small machine with builds.
std::string python() { return "env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 " + q(kPython) + " " + q(kScript); }

// The ids mfsdp-generate --print-ids printed: its last line of digits and commas.
std::string printed_ids(const std::string& output) {
  std::string last;
  size_t begin = 0;
  while (begin < output.size()) {
    size_t end = output.find('\n', begin);
    if (end == std::string::npos) end = output.size();
    const std::string line = output.substr(begin, end - begin);
    if (!line.empty() && line.find_first_not_of("0123456789,") == std::string::npos) last = line;
    begin = end + 1;
  }
  return last;
}

// Runs mfsdp-generate greedily on `model` and returns the ids it printed; writes the prompt's
// logits to `logits`.
std::string generate_ids(const std::string& model, const std::string& prompt, const std::string& logits) {
  CommandOutcome r = run(q(MFSDP_GENERATE_BIN_PATH) + " --device cpu --model " + q(model) + " --prompt-ids " + prompt +
                         " --greedy --max-new-tokens " + std::to_string(kNewTokens) + " --print-ids --logits-out " +
                         q(logits));
  EXPECT_EQ(r.exit_code, 0) << "mfsdp-generate --model " << model << "\n" << r.output;
  const std::string ids = printed_ids(r.output);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), ',') + 1, kNewTokens) << "ids '" << ids << "' from\n" << r.output;
  return ids;
}

// max |a - b| of the "logits" tensors of two safetensors files (read with mfsdp's reader).
double logits_max_diff(const std::string& a, const std::string& b) {
  const at::Tensor x = mfsdp::SafetensorsFile(a).load("logits"), y = mfsdp::SafetensorsFile(b).load("logits");
  EXPECT_EQ(x.sizes(), y.sizes()) << a << " vs " << b;
  if (x.sizes() != y.sizes()) return HUGE_VAL;
  return (x.to(at::kDouble) - y.to(at::kDouble)).abs().max().item<double>();
}

class HfReference : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(fs::exists(kPython))
        << "the reference Python " << kPython << " (CMake's MFSDP_PYTHON) does not exist: run scripts/setup.sh, "
        << "which creates the project's .venv with torch, transformers and safetensors, or configure with "
        << "-DMFSDP_PYTHON=<a Python that has them>";
    // Looked up, not imported: importing torch takes seconds, and the test's own Python runs import them.
    CommandOutcome r = run(q(kPython) + " -c 'import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None "
                                        "for m in (\"torch\", \"transformers\", \"safetensors\")))'");
    ASSERT_EQ(r.exit_code, 0) << "the reference Python " << kPython
                              << " does not have torch, transformers and safetensors: run scripts/setup.sh "
                              << "(it installs scripts/requirements.txt into the .venv)\n"
                              << r.output;
  }
};

// Trains, exports, and compares with transformers; `tied` picks Megatron's default tied
// embeddings or --untie-embeddings-and-output-weights (then the HF folder is also split into
// shards with an index, the layout of big models).
void check_export(bool tied) {
  TempDir dir("mfsdp-ref-export");
  const std::string ckpt = dir.file("ckpt"), hf = dir.file("hf"), logits = dir.file("mfsdp_logits.safetensors");
  // GQA, SwiGLU, a RoPE base and norm epsilon unlike transformers' defaults (10000, 1e-6), so a
  // config field lost on the way shows.
  // --init-method-std 0.3 (not 0.02): logits of a few units and a varied greedy continuation;
  // small weights give logits near 0 and one token repeated, which would test little.
  // --max-position-embeddings 64: room for the prompt and the new tokens.
  const std::string model_flags =
      " --device cpu --mock-data --vocab-size 64 --make-vocab-size-divisible-by 64 --num-layers 2 --hidden-size 32"
      " --num-attention-heads 4 --group-query-attention --num-query-groups 2 --swiglu --ffn-hidden-size 48"
      " --seq-length 16 --max-position-embeddings 64 --rotary-base 500000 --norm-epsilon 1e-4"
      " --init-method-std 0.3 --micro-batch-size 2 --global-batch-size 8 --train-iters 3 --lr 3e-3"
      " --lr-warmup-iters 1 --log-interval 1 --eval-interval 1000 --eval-iters 1 --seed 11" +
      std::string(tied ? "" : " --untie-embeddings-and-output-weights");
  CommandOutcome train = run(q(MFSDP_RUN_BIN_PATH) + " --nproc-per-node 2 " + q(MFSDP_PRETRAIN_BIN_PATH) +
                             model_flags + " --save " + q(ckpt));
  ASSERT_EQ(train.exit_code, 0) << train.output;
  CommandOutcome exported = run(q(MFSDP_CKPT_BIN_PATH) + " export-hf " + q(ckpt) + " " + q(hf) + " --dtype fp32" +
                                (tied ? "" : " --max-shard-size 20KB"));
  ASSERT_EQ(exported.exit_code, 0) << exported.output;
  if (!tied) {
    ASSERT_TRUE(fs::exists(fs::path(hf) / "model.safetensors.index.json")) << "expected a sharded export";
  }

  const std::string prompt = "3,17,42,9,28,55,1";
  const std::string ids = generate_ids(ckpt, prompt, logits);
  // The same model through the other two ways in: the iteration folder and the exported folder.
  EXPECT_EQ(generate_ids(dir.file("ckpt/iter_0000003"), prompt, dir.file("iter_logits.safetensors")), ids);
  EXPECT_EQ(logits_max_diff(dir.file("iter_logits.safetensors"), logits), 0.0) << "--model ckpt/iter_0000003";
  EXPECT_EQ(generate_ids(hf, prompt, dir.file("hf_logits.safetensors")), ids) << "--model " << hf;
  EXPECT_EQ(logits_max_diff(dir.file("hf_logits.safetensors"), logits), 0.0) << "--model " << hf;

  CommandOutcome ref = run(python() + " check-export " + q(hf) + " " + q(logits) + " --prompt-ids " + prompt +
                           " --mfsdp-ids " + ids + " --max-new-tokens " + std::to_string(kNewTokens) + " --atol " +
                           std::to_string(kLogitsAtol));
  std::cout << ref.output;  // what was compared, shown whether it passes or not
  EXPECT_EQ(ref.exit_code, 0) << "transformers disagrees with mfsdp on " << hf << " (its report is above)";
}

// transformers makes a random Llama; mfsdp imports it (and reads the folder directly) and must
// generate what transformers generated.
// `type`: the family (hf_llama_reference.py make-random --model-type); every type but llama is
// also exported again and checked in transformers. `make_args`: more make-random options.
void check_import(bool tied, const std::string& type = "llama", const std::string& make_args = "") {
  TempDir dir("mfsdp-ref-import");
  const std::string hf = dir.file("hf"), ckpt = dir.file("ckpt"), hf_logits = dir.file("hf_logits.safetensors");
  const std::string prompt = "5,17,99,200,42,7,150,3";
  CommandOutcome made = run(python() + " make-random " + q(hf) + (tied ? " --tied" : " --untied") + " --seed " +
                            // the untied model also has a non-default RoPE base, which
                            // transformers 5 writes only inside "rope_parameters"
                            (tied ? "2" : "1 --rope-theta 500000") + " --model-type " + type + make_args + " --prompt-ids " +
                            prompt + " --max-new-tokens " +
                            std::to_string(kNewTokens) + " --ids-out " + q(dir.file("hf_ids.txt")) + " --logits-out " +
                            q(hf_logits));
  std::cout << made.output;
  ASSERT_EQ(made.exit_code, 0) << "making the transformers model failed (its output is above)";
  std::ifstream ids_file(dir.file("hf_ids.txt"));
  const std::string hf_ids = printed_ids(std::string(std::istreambuf_iterator<char>(ids_file), {}));
  ASSERT_FALSE(hf_ids.empty()) << "no ids in " << dir.file("hf_ids.txt");

  CommandOutcome imported = run(q(MFSDP_CKPT_BIN_PATH) + " import-hf " + q(hf) + " " + q(ckpt));
  ASSERT_EQ(imported.exit_code, 0) << imported.output;
  // DeepSeek-V3's logits are compared relative to their scale (1e-5 of max |logit|): its latent
  // projections and norms, with the random model's wide weights (initializer_range 0.25), round
  // fp32 differently than transformers does by ~1e-5 at logits of ~7.
  double atol = kLogitsAtol;
  if (type == "deepseek_v3")
    atol *= std::max(1.0, mfsdp::SafetensorsFile(hf_logits).load("logits").abs().max().item<double>());
  for (const std::string& model : {ckpt, hf}) {
    const std::string logits = dir.file(model == ckpt ? "ckpt_logits.safetensors" : "direct_logits.safetensors");
    const std::string ids = generate_ids(model, prompt, logits);
    const double diff = logits_max_diff(logits, hf_logits);
    std::cout << "mfsdp-generate --model " << model << ": greedy " << ids << "; logits max |mfsdp - transformers| = "
              << diff << "\n";
    EXPECT_EQ(ids, hf_ids) << "greedy ids of mfsdp-generate --model " << model << " (transformers: " << hf_ids
                           << ")";
    EXPECT_LE(diff, atol) << "logits of mfsdp-generate --model " << model;
  }
  if (type == "llama") return;

  // Back out: the checkpoint's model_config (written by import-hf) must still name the family.
  const std::string out = dir.file("exported");
  CommandOutcome exported = run(q(MFSDP_CKPT_BIN_PATH) + " export-hf " + q(ckpt) + " " + q(out) + " --dtype fp32");
  ASSERT_EQ(exported.exit_code, 0) << exported.output;
  std::ifstream config_file(fs::path(out) / "config.json");
  const std::string config((std::istreambuf_iterator<char>(config_file)), {});
  EXPECT_NE(config.find("\"" + type + "\""), std::string::npos) << "exported config.json:\n" << config;
  const std::string ids = generate_ids(ckpt, prompt, dir.file("ckpt_logits2.safetensors"));
  CommandOutcome ref = run(python() + " check-export " + q(out) + " " + q(dir.file("ckpt_logits2.safetensors")) +
                           " --model-type " + type + " --prompt-ids " + prompt + " --mfsdp-ids " + ids +
                           " --max-new-tokens " + std::to_string(kNewTokens) + " --atol " + std::to_string(atol));
  std::cout << ref.output;
  EXPECT_EQ(ref.exit_code, 0) << "transformers disagrees with mfsdp on the exported " << type << " " << out
                              << " (its report is above)";
}

}  // namespace

TEST_F(HfReference, ExportHfUntiedMatchesTransformers) { check_export(/*tied=*/false); }
TEST_F(HfReference, ExportHfTiedMatchesTransformers) { check_export(/*tied=*/true); }
TEST_F(HfReference, ImportHfUntiedGeneratesTransformersIds) { check_import(/*tied=*/false); }
TEST_F(HfReference, ImportHfTiedGeneratesTransformersIds) { check_import(/*tied=*/true); }
TEST_F(HfReference, Qwen2ImportAndExportMatchTransformers) { check_import(/*tied=*/true, "qwen2"); }
// Qwen3's per-head q/k norms and a head_dim unlike hidden / heads.
TEST_F(HfReference, Qwen3ImportAndExportMatchTransformers) { check_import(/*tied=*/false, "qwen3"); }
// Mixtures of experts: top-2 of 4 experts; Qwen3-MoE with a dense layer between MoE layers and
// renormalised weights, Qwen2-MoE with raw softmax weights and a gated shared expert, Mixtral's
// names (block_sparse_moe, w1/w3/w2).
TEST_F(HfReference, Qwen3MoeImportAndExportMatchTransformers) { check_import(/*tied=*/false, "qwen3_moe"); }
TEST_F(HfReference, Qwen2MoeImportAndExportMatchTransformers) { check_import(/*tied=*/true, "qwen2_moe"); }
TEST_F(HfReference, MixtralImportAndExportMatchTransformers) { check_import(/*tied=*/false, "mixtral"); }
// Multi-head latent attention with YaRN, group-limited sigmoid routing with a random
// e_score_correction_bias, shared experts, a dense first layer; with the query bottleneck
// (q_lora_rank 32) and without it (q_proj).
TEST_F(HfReference, DeepseekV3ImportAndExportMatchTransformers) { check_import(/*tied=*/false, "deepseek_v3"); }
TEST_F(HfReference, DeepseekV3WithoutQueryLoraImportAndExportMatchTransformers) {
  check_import(/*tied=*/true, "deepseek_v3", " --q-lora-rank 0");
}
