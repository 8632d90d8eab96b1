// Pipeline parallelism end to end, through mfsdp-run (docs/pretrain.md, "Pipeline parallelism"):
// every layout trains as one process does (losses, gradient norms, parameter norms and every
// saved weight after 3 AdamW steps), resumes bit-exactly at the same layout and reshards to
// others, PyTorch's DCP reads a pipeline checkpoint whole, and the flags Megatron refuses are
// refused naming them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "harness/expect_error.h"
#include "harness/metrics_file.h"
#include "harness/run_command.h"
#include "harness/temp_dir.h"
#include "mfsdp/checkpoint/checkpoint.h"

namespace {

using mfsdp::testing::run_command;
using mfsdp::testing::TempDir;
using mfsdp::testing::training_records;

const std::string kRun = MFSDP_RUN_BIN_PATH;
const std::string kPretrain = MFSDP_PRETRAIN_BIN_PATH;
const std::string kPython = MFSDP_PYTHON_PATH;

// 4 decoder layers, 4 micro-batches of 2 per data-parallel replica at DP 1. The byte-level
// vocabulary pads to 512 rows at TP 1 (a multiple of 256) and at TP 2 (128 x 2). AdamW eps 1e-3:
// tensor and context parallelism sum in another order, and with eps 1e-8 Adam turns a nearly
// cancelling gradient element into a step of up to lr either way (tests/dist/parallel_llama_test.cpp).
const std::string kModel =
    " --device cpu --tokenizer-type ByteLevelTokenizer --mock-data --num-layers 4 --hidden-size 64"
    " --num-attention-heads 4 --swiglu --ffn-hidden-size 128 --seq-length 32 --micro-batch-size 2"
    " --global-batch-size 8 --lr 3e-3 --lr-warmup-iters 1 --log-interval 1 --eval-interval 1000 --eval-iters 1"
    " --seed 3 --log-params-norm --adam-eps 1e-3";
const std::string kVocab = " --make-vocab-size-divisible-by 256", kVocabTp = " --make-vocab-size-divisible-by 128";
const std::string kMoe =
    " --num-layers 2 --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 64 --moe-aux-loss-coeff 1e-2"
    " --moe-z-loss-coeff 1e-3";

mfsdp::testing::CommandOutcome pretrain(int ranks, const std::string& flags) {
  return run_command(kRun + " --nproc-per-node " + std::to_string(ranks) + " " + kPretrain + kModel + flags + " 2>&1");
}

// Every step's loss, gradient norm and parameter norm within `tolerance` relative.
void expect_same_steps(const std::string& want_file, const std::string& got_file, const std::string& name,
                       double tolerance) {
  const auto want = training_records(want_file), got = training_records(got_file);
  ASSERT_EQ(got.size(), want.size()) << name;
  for (size_t i = 0; i < want.size(); ++i)
    for (const char* key : {"lm_loss", "grad_norm", "params_norm"}) {
      const double w = want[i][key].get<double>(), g = got[i][key].get<double>();
      EXPECT_LE(std::abs(g - w), tolerance * std::abs(w)) << name << ": iteration " << i + 1 << " " << key;
    }
}

// The same model tensors, each within `tolerance` of its largest magnitude.
void expect_same_weights(const std::string& want_dir, const std::string& got_dir, const std::string& name,
                         double tolerance) {
  const mfsdp::CheckpointReader want(want_dir), got(got_dir);
  std::vector<std::string> want_names, got_names;
  for (const std::string& n : want.tensor_names())
    if (n.rfind("model.", 0) == 0) want_names.push_back(n);
  for (const std::string& n : got.tensor_names())
    if (n.rfind("model.", 0) == 0) got_names.push_back(n);
  ASSERT_EQ(got_names, want_names) << name;
  for (const std::string& n : want_names) {
    const at::Tensor w = want.read(n), g = got.read(n);
    ASSERT_EQ(g.sizes(), w.sizes()) << name << ": " << n;
    const double scale = w.abs().max().item<double>();
    EXPECT_LE((g - w).abs().max().item<double>(), tolerance * scale) << name << ": " << n;
  }
}

struct Layout {
  std::string name;
  int ranks;
  std::string flags;
  bool tied = true;
  bool tensor_parallel = false;
};

// Against one process, 3 AdamW steps, within 1e-5: the stages hold disjoint layers, so only the
// order of fp32 sums (tensor and data parallelism) may differ.
TEST(Pipeline, EveryLayoutTrainsLikeOneProcess) {
  TempDir dir("mfsdp-pp-layouts");
  const std::string steps = " --train-iters 3";
  for (const auto& [name, flags] : {std::pair<std::string, std::string>{"one", kVocab + " --export-hf " + dir.file("one_hf")},
                                    {"one_untied", kVocab + " --untie-embeddings-and-output-weights"}}) {
    const auto r = pretrain(1, steps + flags + " --save " + dir.file(name) + " --metrics-file " + dir.file(name + ".jsonl"));
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  const std::string pp2 = " --pipeline-model-parallel-size 2";
  const std::vector<Layout> layouts = {
      {"pp2", 2, pp2},
      {"pp4", 4, " --pipeline-model-parallel-size 4"},
      {"pp2_untied", 2, pp2 + " --untie-embeddings-and-output-weights", false},
      {"pp2_dp2", 4, pp2},
      {"pp2_dp2_optim_grads", 4, pp2 + " --data-parallel-sharding-strategy optim_grads"},
      {"pp2_dp2_optim", 4, pp2 + " --data-parallel-sharding-strategy optim"},
      {"pp2_dp2_no_shard", 4, pp2 + " --data-parallel-sharding-strategy no_shard"},
      {"pp2_hsdp2", 4, pp2 + " --num-distributed-optimizer-instances 2"},
      {"pp2_tp2", 4, pp2 + " --tensor-model-parallel-size 2 --sequence-parallel", true, true},
      {"pp2_cp2", 4, pp2 + " --context-parallel-size 2"},
      // Uneven stages: 1 and 3 layers; with the embedding and loss counted, 1, 2 and 1 over 3.
      {"pp2_first1", 2, pp2 + " --decoder-first-pipeline-num-layers 1 --untie-embeddings-and-output-weights", false},
      {"pp3_accounted", 3,
       " --pipeline-model-parallel-size 3 --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split"},
      // Interleaved 1F1B: two chunks of one layer per stage (layers 0 and 2 on stage 0).
      {"pp2_vp2", 2, pp2 + " --num-virtual-stages-per-pipeline-rank 2"},
      {"pp2_vp2_untied", 2, pp2 + " --num-layers-per-virtual-pipeline-stage 1 --untie-embeddings-and-output-weights",
       false},
      {"pp2_vp2_tp2", 4,
       pp2 + " --virtual-pipeline-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel", true, true},
  };
  for (const Layout& l : layouts) {
    // The whole model gathered over the stages (and TP ranks): a Hugging Face folder, as one rank's.
    const bool export_hf = l.name == "pp2" || l.name == "pp4" || l.name == "pp2_tp2";
    const std::string flags = steps + l.flags + (l.tensor_parallel ? kVocabTp : kVocab) + " --save " + dir.file(l.name) +
                              " --metrics-file " + dir.file(l.name + ".jsonl") +
                              (export_hf ? " --export-hf " + dir.file(l.name + "_hf") : "");
    const auto r = pretrain(l.ranks, flags);
    ASSERT_EQ(r.exit_code, 0) << l.name << "\n" << r.output;
    const std::string ref = l.tied ? "one" : "one_untied";
    expect_same_steps(dir.file(ref + ".jsonl"), dir.file(l.name + ".jsonl"), l.name, 1e-5);
    expect_same_weights(dir.file(ref), dir.file(l.name), l.name, 1e-5);
    // The log's bubble: the stages' idle fraction, beside 1F1B's ideal (P - 1) / (m + P - 1).
    for (const auto& record : training_records(dir.file(l.name + ".jsonl"))) {
      ASSERT_TRUE(record.contains("pipeline_bubble")) << l.name;
      EXPECT_GE(record["pipeline_bubble"].get<double>(), 0.0) << l.name;
      EXPECT_LT(record["pipeline_bubble"].get<double>(), 1.0) << l.name;
      EXPECT_GT(record["pipeline_bubble_ideal"].get<double>(), 0.0) << l.name;
    }
    if (!export_hf) continue;
    const std::string script =
        "import sys\n"
        "from safetensors.torch import load_file\n"
        "ref, got = load_file(sys.argv[1]), load_file(sys.argv[2])\n"
        "assert sorted(got) == sorted(ref), sorted(set(got) ^ set(ref))[:5]\n"
        "for k in ref:\n"
        "    assert (got[k] - ref[k]).abs().max() <= 1e-5 * ref[k].abs().max(), k\n"
        "print('same', len(ref), 'tensors')\n";
    const auto e = run_command(kPython + " -c \"" + script + "\" " + dir.file("one_hf/model.safetensors") + " " +
                               dir.file(l.name + "_hf/model.safetensors") + " 2>&1");
    EXPECT_EQ(e.exit_code, 0) << l.name << "\n" << e.output;
    EXPECT_NE(e.output.find("same"), std::string::npos) << l.name << "\n" << e.output;
  }
}

// MoE layers on two stages, with and without expert parallelism: the balancing losses too.
TEST(Pipeline, MixtureOfExpertsTrainsLikeOneProcess) {
  TempDir dir("mfsdp-pp-moe");
  const std::string flags = kMoe + kVocab + " --train-iters 3";
  auto r = pretrain(1, flags + " --metrics-file " + dir.file("one.jsonl"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const auto& [name, ranks, layout] :
       {std::tuple<std::string, int, std::string>{"pp2", 2, " --pipeline-model-parallel-size 2"},
        {"pp2_ep2", 4, " --pipeline-model-parallel-size 2 --expert-model-parallel-size 2"}}) {
    r = pretrain(ranks, flags + layout + " --metrics-file " + dir.file(name + ".jsonl"));
    ASSERT_EQ(r.exit_code, 0) << name << "\n" << r.output;
    expect_same_steps(dir.file("one.jsonl"), dir.file(name + ".jsonl"), name, 1e-5);
    const auto want = training_records(dir.file("one.jsonl")), got = training_records(dir.file(name + ".jsonl"));
    for (size_t i = 0; i < want.size(); ++i)
      for (const char* key : {"load_balancing_loss", "z_loss"})
        EXPECT_NEAR(got[i][key].get<double>(), want[i][key].get<double>(), 1e-5 * want[i][key].get<double>())
            << name << " " << key;
  }
}

// Six iterations straight at PP 2; three, saved, then three more at PP 2 (the same bits), at one
// rank and at PP 2 x TP 2 (the same up to the order of fp32 sums). PyTorch reads the PP 2
// checkpoint whole: the tensors of a one-process checkpoint, each written once.
TEST(Pipeline, ResumesBitExactlyAndReshards) {
  TempDir dir("mfsdp-pp-resume");
  const std::string pp2 = " --pipeline-model-parallel-size 2 --train-iters 6";
  ASSERT_EQ(pretrain(2, pp2 + kVocab + " --metrics-file " + dir.file("straight.jsonl")).exit_code, 0);
  auto r = pretrain(2, pp2 + kVocab + " --exit-interval 3 --save " + dir.file("ckpt"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = pretrain(1, " --train-iters 3" + kVocab + " --save " + dir.file("one"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto straight = training_records(dir.file("straight.jsonl"));
  ASSERT_EQ(straight.size(), 6u);
  for (const auto& [name, ranks, flags, exact] :
       {std::tuple<std::string, int, std::string, bool>{"same", 2, pp2 + kVocab, true},
        {"to_one", 1, " --train-iters 6" + kVocab, false},
        {"to_pp2_tp2", 4, pp2 + kVocabTp + " --tensor-model-parallel-size 2", false}}) {
    r = pretrain(ranks, flags + " --load " + dir.file("ckpt") + " --metrics-file " + dir.file(name + ".jsonl"));
    ASSERT_EQ(r.exit_code, 0) << name << "\n" << r.output;
    const auto resumed = training_records(dir.file(name + ".jsonl"));
    ASSERT_EQ(resumed.size(), 3u) << name;
    for (size_t i = 0; i < 3; ++i)
      for (const char* key : {"lm_loss", "grad_norm", "params_norm"}) {
        const double w = straight[i + 3][key].get<double>(), g = resumed[i][key].get<double>();
        if (exact)
          EXPECT_EQ(g, w) << name << " iteration " << i + 4 << " " << key;
        else
          EXPECT_NEAR(g, w, 1e-5 * std::abs(w)) << name << " iteration " << i + 4 << " " << key;
      }
  }
  const std::string script =
      "import sys, torch\n"
      "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
      "def model(path):\n"
      "    dcp_to_torch_save(path, path + '.pt')\n"
      "    sd = torch.load(path + '.pt', weights_only=False)\n"
      "    return {k: v for k, v in sd.items() if torch.is_tensor(v) and 'optimizer' not in k and 'rng' not in k}\n"
      "ref, got = model(sys.argv[1]), model(sys.argv[2])\n"
      "assert sorted(got) == sorted(ref), sorted(set(got) ^ set(ref))[:5]\n"
      "for k in ref:\n"
      "    assert got[k].shape == ref[k].shape, k\n"
      "    assert (got[k].float() - ref[k].float()).abs().max() <= 1e-5 * ref[k].float().abs().max(), k\n"
      "print('pytorch read', len(ref), 'tensors')\n";
  r = run_command(kPython + " -c \"" + script + "\" " + dir.file("one/iter_0000003") + " " +
                  dir.file("ckpt/iter_0000003") + " 2>&1");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("pytorch read"), std::string::npos) << r.output;
}

// --memory-plan names each stage's share of the schedule's activations: with P = 2 and 4
// micro-batches, Megatron's 1F1B keeps min(P - s, m) on stage s (2, 1); its interleaved 1F1B with
// V = 2 runs (P - s - 1) x 2 + (V - 1) x P warm-up forwards before the first backward, so one more
// is kept at the peak (5, 3) of the step's V x m = 8.
TEST(Pipeline, MemoryPlanShowsTheActivationsEachStageKeeps) {
  const std::string plan = " --simulate-world-size 2 --memory-plan --pipeline-model-parallel-size 2" + kVocab;
  const auto one = run_command(kPretrain + kModel + plan + " 2>&1");
  ASSERT_EQ(one.exit_code, 0) << one.output;
  mfsdp::testing::expect_contains(one.output, {"pipeline stage 0 of 2: decoder layers 0 to 1, the embedding\n"
                                               "   activations kept at once, at most: 2 of the step's 4 micro-batches (1F1B)",
                                               "pipeline stage 1 of 2: decoder layers 2 to 3, the output layer\n"
                                               "   activations kept at once, at most: 1 of the step's 4 micro-batches"});
  const auto interleaved = run_command(kPretrain + kModel + plan + " --num-virtual-stages-per-pipeline-rank 2 2>&1");
  ASSERT_EQ(interleaved.exit_code, 0) << interleaved.output;
  mfsdp::testing::expect_contains(interleaved.output,
                                  {"at most: 5 of the step's 8 (micro-batch, chunk) forwards (interleaved 1F1B)",
                                   "at most: 3 of the step's 8 (micro-batch, chunk) forwards"});
}

// Megatron's refusals, exit 2 naming the flag (before any rank starts).
TEST(Pipeline, RefusesWhatMegatronRefuses) {
  struct Refusal {
    int ranks;
    std::string flags, names;
  };
  for (const Refusal& c : std::vector<Refusal>{
           {2, " --pipeline-model-parallel-size 2 --num-layers 3", "--num-layers"},
           {1, " --decoder-first-pipeline-num-layers 1", "--pipeline-model-parallel-size"},
           {2, " --pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 1 "
               "--account-for-embedding-in-pipeline-split",
            "--account-for-embedding-in-pipeline-split"},
           {3, " --pipeline-model-parallel-size 2", "--pipeline-model-parallel-size"},
           // Interleaving: 3 micro-batches are not a multiple of the 2 stages; 4 layers do not
           // make chunks of 3.
           {2, " --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --global-batch-size 6",
            "--global-batch-size"},
           {2, " --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 3",
            "--num-layers-per-virtual-pipeline-stage"},
       }) {
    const auto r = pretrain(c.ranks, c.flags + kVocab + " --train-iters 1");
    EXPECT_EQ(r.exit_code, 2) << c.flags << "\n" << r.output;
    EXPECT_NE(r.output.find(c.names), std::string::npos) << c.flags << "\n" << r.output;
  }
}

}  // namespace
