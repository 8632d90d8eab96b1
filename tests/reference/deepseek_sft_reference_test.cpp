// Reference test (ctest label "reference"): supervised fine-tuning of a DeepSeek-V3 with expert
// parallelism, alone and beside tensor or context parallelism, equals transformers'
// DeepseekV3ForCausalLM trained with torch.optim.AdamW on the same batches. The Python side is tests/reference/deepseek_sft_reference.py.
//
// transformers makes a small random DeepseekV3ForCausalLM (multi-head latent attention with the
// query bottleneck and YaRN; the first layer dense, then DeepSeek MoE: 8 experts in 4 groups,
// top-2 of the 2 best groups, sigmoid scores with a random e_score_correction_bias, renormalised,
// times routed_scaling_factor 2.5, plus 2 shared experts). mfsdp-sft --hf-load trains it 3 steps
// on 2 ranks with --expert-model-parallel-size 2 (each rank 4 of the experts), the dense weights
// sharded over the 2 ranks, or split by heads and widths over them (--tensor-model-parallel-size
// 2, sequence parallel, the experts whole: --expert-tensor-parallel-size 1), or the sequences
// split over them (--context-parallel-size 2), fp32, on a pre-tokenized file whose 8 sequences of mixed lengths are
// the whole global batch of every step (2 micro-batches of 2 per rank, padded); the reference
// trains the same folder on the same sequences, one at a time, with the same loss (token-mean:
// the target tokens' summed negative log-likelihoods / the global batch's target tokens),
// clip_grad_norm_ and AdamW with Megatron's groups (no decay on 1-D parameters). Compared:
//   - each step's loss and gradient norm (before clipping), within 1e-5 relative;
//   - every tensor of mfsdp-sft's --export-hf folder against the reference's final weights,
//     within 1e-5 of the tensor's max |w|; and their updates (final - initial) within 1e-3 of
//     the tensor's max |update|, so that the weights agreeing is not only their start agreeing;
//   - the routing bias e_score_correction_bias is the folder's on both sides, bit for bit.
// Made equal on purpose, since transformers' DeepSeek-V3 has neither: no balancing or z-loss in
// the gradient (--moe-aux-loss-coeff 0, --moe-z-loss-coeff 0) and no aux-loss-free bias update
// (--moe-router-bias-update-rate 0). Dropless routing (--moe-expert-capacity-factor 0), as
// transformers routes. Routing is discontinuous where two experts' (or groups') scores tie; on
// these data the closest pair, over the 3 steps, differs by 3e-5 (transformers' scores), far beyond
// the ~1e-7 by which the two sides differ.
//
// A missing reference Python or transformers is a failure (not a skip): these tests exist to run.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "harness/metrics_file.h"
#include "harness/run_command.h"
#include "harness/temp_dir.h"
#include "mfsdp/checkpoint/safetensors.h"

namespace {

namespace fs = std::filesystem;
using mfsdp::testing::CommandOutcome;
using mfsdp::testing::TempDir;
using nlohmann::json;

const std::string kPython = MFSDP_PYTHON_PATH;
const std::string kScript = std::string(MFSDP_SOURCE_DIR) + "/tests/reference/deepseek_sft_reference.py";

constexpr int kSteps = 3;
constexpr int kSequences = 8;  // the global batch: every step trains on all of them
constexpr double kLossRtol = 1e-5;
constexpr double kWeightRtol = 1e-5;
constexpr double kUpdateRtol = 1e-3;

// The optimizer, the same on both sides. The learning rate moves the weights by a few percent in
// 3 steps (the loss falls from 6.1 to 3.9). Adam's eps is 1e-3, not Megatron's 1e-8: the update
// g / (|g| + eps) has slope up to 1 / eps in g, so with eps 1e-8 the fp32 rounding of a
// near-zero gradient element (~1e-8 of the tensor's largest, both sides agreeing to ~1e-6 of
// it) becomes a different update of up to the learning rate itself (measured: 1e-3 of max |w|
// after 3 steps). With eps 1e-3 the update of a small gradient is proportional to it, so a wrong
// gradient shows in the weights rather than being flattened to its sign. Clipping at 1.0 is
// active (the gradient norm is 2.6 .. 4.3).
const double kLr = 1e-2, kWeightDecay = 0.1, kBeta1 = 0.9, kBeta2 = 0.95, kEps = 1e-3, kClip = 1.0;

// Single-quoted for the shell.
std::string q(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// The reference Python with one thread: these tests share a small machine with builds.
std::string python() { return "env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 " + q(kPython) + " " + q(kScript); }

std::string num(double v) {
  std::ostringstream s;
  s.precision(17);
  s << v;
  return s.str();
}

// kSequences pre-tokenized sequences of 10 .. 24 ids below 257 (the byte-level tokenizer's
// vocabulary, within the model's 300): targets after a prompt of a few tokens, and in every
// other sequence a hole in the targets, so the mask is not just a suffix. std::mt19937's output
// is the same everywhere (its distributions are not, so none is used).
void write_data(const std::string& path) {
  std::mt19937 gen(20240917);
  std::ofstream out(path);
  for (int i = 0; i < kSequences; ++i) {
    const int64_t length = 10 + gen() % 15, prompt = 2 + gen() % 5;
    json ids = json::array(), mask = json::array();
    for (int64_t t = 0; t < length; ++t) {
      ids.push_back(gen() % 257);
      mask.push_back(t >= prompt && !(i % 2 == 1 && t == prompt + 2) ? 1 : 0);
    }
    out << json{{"input_ids", ids}, {"loss_mask", mask}}.dump() << "\n";
  }
}

using mfsdp::testing::training_records;

double max_abs(const at::Tensor& t) { return t.numel() == 0 ? 0.0 : t.abs().max().item<double>(); }

TEST(DeepseekSftReference, ExpertTensorAndContextParallelSftEqualsTransformersWithAdamW) {
  ASSERT_TRUE(fs::exists(kPython))
      << "the reference Python " << kPython << " (CMake's MFSDP_PYTHON) does not exist: run scripts/setup.sh, "
      << "which creates the project's .venv with torch, transformers and safetensors";
  TempDir dir("mfsdp-deepseek-sft");
  const std::string hf = dir.file("hf"), data = dir.file("train.jsonl"), ref = dir.file("reference");
  CommandOutcome made = mfsdp::testing::run_command(python() + " make " + q(hf) + " --seed 3");
  std::cout << made.output;
  ASSERT_EQ(made.exit_code, 0) << "making the transformers model failed (its output is above)";
  write_data(data);

  const std::string optimizer = " --lr " + num(kLr) + " --weight-decay " + num(kWeightDecay) + " --adam-beta1 " +
                                num(kBeta1) + " --adam-beta2 " + num(kBeta2) + " --adam-eps " + num(kEps) +
                                " --clip-grad " + num(kClip);
  CommandOutcome reference = mfsdp::testing::run_command(python() + " train " + q(hf) + " " + q(data) + " " + q(ref) +
                                                         " --steps " + std::to_string(kSteps) + optimizer);
  std::cout << reference.output;
  ASSERT_EQ(reference.exit_code, 0) << "the transformers training failed (its output is above)";

  for (const std::string layout : {"", " --tensor-model-parallel-size 2 --sequence-parallel --expert-tensor-parallel-size 1",
                                   " --context-parallel-size 2"}) {
  SCOPED_TRACE("--expert-model-parallel-size 2" + layout);
  const std::string name = layout.empty() ? "ep" : layout.find("tensor") != std::string::npos ? "tp" : "cp";
  const std::string out = dir.file("export-" + name), metrics = dir.file("metrics-" + name + ".jsonl");
  const std::string flags =
      " --device cpu --hf-load " + q(hf) + " --train-files " + q(data) + layout +
      " --tokenizer-type ByteLevelTokenizer --max-length 32 --micro-batch-size 2 --global-batch-size " +
      std::to_string(kSequences) + " --train-iters " + std::to_string(kSteps) +
      " --loss-agg-mode token-mean --expert-model-parallel-size 2 --optimizer adam" + optimizer +
      " --lr-decay-style constant --lr-warmup-iters 0 --min-lr " + num(kLr) +
      " --moe-aux-loss-coeff 0 --moe-z-loss-coeff 0 --moe-router-bias-update-rate 0"
      " --moe-expert-capacity-factor 0 --seed 1 --log-interval 1 --metrics-file " +
      q(metrics) + " --export-hf " + q(out);
  CommandOutcome train =
      mfsdp::testing::run_command(q(MFSDP_RUN_BIN_PATH) + " --nproc-per-node 2 " + q(MFSDP_SFT_BIN_PATH) + flags);
  ASSERT_EQ(train.exit_code, 0) << train.output;

  // Losses and gradient norms, step by step.
  std::ifstream report_file(ref + "/report.json");
  const json report = json::parse(report_file);
  const std::vector<json> records = training_records(metrics);
  ASSERT_EQ(records.size(), static_cast<size_t>(kSteps)) << train.output;
  double worst_loss = 0, worst_norm = 0;
  for (int s = 0; s < kSteps; ++s) {
    const double loss = records[s]["lm_loss"].get<double>(), want = report["losses"][s].get<double>();
    const double norm = records[s]["grad_norm"].get<double>(), want_norm = report["grad_norms"][s].get<double>();
    worst_loss = std::max(worst_loss, std::abs(loss - want) / std::abs(want));
    worst_norm = std::max(worst_norm, std::abs(norm - want_norm) / std::abs(want_norm));
    std::cout << "step " << s + 1 << ": loss mfsdp " << num(loss) << ", transformers " << num(want)
              << "; grad norm mfsdp " << num(norm) << ", transformers " << num(want_norm) << "\n";
    EXPECT_NEAR(loss, want, kLossRtol * std::abs(want)) << "loss of step " << s + 1;
    EXPECT_NEAR(norm, want_norm, kLossRtol * std::abs(want_norm)) << "gradient norm of step " << s + 1;
    EXPECT_EQ(records[s]["lr"].get<double>(), kLr) << "a constant learning rate, step " << s + 1;
  }
  EXPECT_LT(report["losses"][kSteps - 1].get<double>(), 0.8 * report["losses"][0].get<double>())
      << "the weights must move enough for the comparison to mean something";

  // The final weights, every tensor of the export against the reference's.
  const mfsdp::SafetensorsFile initial(hf + "/model.safetensors"), theirs(ref + "/hf/model.safetensors"),
      ours(out + "/model.safetensors");
  EXPECT_EQ(ours.names(), theirs.names()) << "the export's tensors vs transformers' save_pretrained";
  double worst_weight = 0, worst_update = 0;
  std::string worst_weight_name, worst_update_name;
  int compared = 0;
  for (const std::string& name : theirs.names()) {
    if (!ours.contains(name)) continue;  // reported by the names' comparison above
    const at::Tensor want = theirs.load(name).to(at::kDouble), got = ours.load(name).to(at::kDouble),
                     start = initial.load(name).to(at::kDouble);
    ASSERT_EQ(got.sizes(), want.sizes()) << name;
    ++compared;
    if (name.find("e_score_correction_bias") != std::string::npos) {
      EXPECT_TRUE(at::equal(want, start)) << name << ": transformers never updates the routing bias";
      EXPECT_TRUE(at::equal(got, start)) << name << ": --moe-router-bias-update-rate 0 must leave it as loaded (max |diff| "
                                         << max_abs(got - start) << ")";
      continue;
    }
    const double diff = max_abs(got - want), scale = max_abs(want);
    const double update = max_abs(want - start), update_diff = max_abs((got - start) - (want - start));
    ASSERT_GT(update, 0) << name << " did not move in transformers' training";
    if (diff / scale > worst_weight) worst_weight = diff / scale, worst_weight_name = name;
    if (update_diff / update > worst_update) worst_update = update_diff / update, worst_update_name = name;
    EXPECT_LE(diff, kWeightRtol * scale) << name << ": max |mfsdp - transformers| " << diff << ", max |w| " << scale;
    EXPECT_LE(update_diff, kUpdateRtol * update)
        << name << ": the updates differ by " << update_diff << ", max |update| " << update;
  }
  EXPECT_EQ(compared, static_cast<int>(theirs.names().size()));
  std::cout << "compared " << compared << " tensors; losses: max relative difference " << worst_loss
            << "; gradient norms: " << worst_norm << "; weights: max |diff| / max |w| " << worst_weight << " ("
            << worst_weight_name << "); updates: max |diff| / max |update| " << worst_update << " ("
            << worst_update_name << ")\n";
  }
}

}  // namespace
