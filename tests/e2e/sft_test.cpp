// mfsdp-sft end to end, through mfsdp-run. The reference is a plain single-process forward of the
// same initial model on each conversation alone (no batching, padding, packing or sharding):
// the first step's loss must equal it for every split of the global batch into micro-batches and
// ranks, for every sharding strategy, packed or not; the weights after two SGD steps must agree
// across those splits. Then a short run that learns, validates and exports, and bad input.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "harness/run_command.h"
#include "harness/temp_dir.h"
#include "mfsdp/checkpoint/load_model.h"
#include "mfsdp/data/chat_dataset.h"
#include "mfsdp/data/chat_template.h"
#include "mfsdp/data/tokenizer.h"
#include "mfsdp/models/generate.h"
#include "mfsdp/models/llama.h"

namespace {

using mfsdp::testing::run_command;
using mfsdp::testing::TempDir;

const std::string kRun = MFSDP_RUN_BIN_PATH;
const std::string kSft = MFSDP_SFT_BIN_PATH;

constexpr int64_t kSeed = 11;
const std::string kModel =
    " --device cpu --tokenizer-type ByteLevelTokenizer --make-vocab-size-divisible-by 1 --num-layers 2"
    " --hidden-size 32 --num-attention-heads 4 --group-query-attention --num-query-groups 2"
    " --swiglu --ffn-hidden-size 48 --max-length 64 --seed 11 --log-interval 1 --eval-interval 1000";

mfsdp::LlamaConfig model_config() {
  mfsdp::LlamaConfig c;
  c.vocab_size = 257;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 64;
  c.rms_norm_eps = 1e-5;
  c.tie_word_embeddings = true;
  return c;
}

// Conversations of different lengths (so per-sequence and per-token means differ), a system
// message in some.
std::vector<mfsdp::SftExample> conversations(int count, bool uniform) {
  std::vector<mfsdp::SftExample> out;
  for (int i = 0; i < count; ++i) {
    const int a = uniform ? 10 + 7 * i % 40 : (i % 2 ? 3 + i : 1000 + 37 * i);
    const int b = uniform ? 11 + 5 * i % 40 : 20 + 3 * i;
    mfsdp::SftExample e;
    if (!uniform && i % 3 == 0) e.messages.push_back({"system", "Add."});
    e.messages.push_back({"user", std::to_string(a) + "+" + std::to_string(b) + "="});
    e.messages.push_back({"assistant", std::to_string(a + b)});
    out.push_back(e);
  }
  return out;
}

// The loss of the initial model on `examples`, each run alone through LlamaForCausalLM: targets
// are the assistant tokens and EOD (apply_chat_template's mask); token-mean or the mean over
// conversations of their token means.
double reference_loss(const std::vector<mfsdp::SftExample>& examples, bool token_mean) {
  mfsdp::LlamaOptions options;
  options.init_seed = kSeed;
  mfsdp::LlamaForCausalLM model(model_config(), options);
  torch::NoGradGuard no_grad;
  mfsdp::ByteLevelTokenizer tokenizer;
  double sum = 0, tokens = 0, sequence_means = 0;
  for (const auto& e : examples) {
    mfsdp::ChatTokens t = mfsdp::apply_chat_template(tokenizer, "plain", e.messages, false);
    const auto n = static_cast<int64_t>(t.ids.size());
    at::Tensor ids = torch::tensor(t.ids, torch::kLong).view({1, n});
    at::Tensor logp = torch::log_softmax(model->forward(ids).to(torch::kDouble), -1)[0];
    double s = 0, k = 0;
    for (int64_t i = 1; i < n; ++i)
      if (t.loss_mask[i]) {
        s -= logp[i - 1][t.ids[i]].item<double>();
        k += 1;
      }
    sum += s;
    tokens += k;
    sequence_means += s / k;
  }
  return token_mean ? sum / tokens : sequence_means / static_cast<double>(examples.size());
}

struct RunResult {
  std::vector<nlohmann::json> train, eval;
  std::string output;
};

RunResult sft(const TempDir& dir, int ranks, const std::string& flags, const std::string& tag) {
  const std::string metrics = dir.file(tag + ".jsonl");
  auto r = run_command(kRun + " --nproc-per-node " + std::to_string(ranks) + " " + kSft + kModel +
                       " --metrics-file " + metrics + " " + flags);
  EXPECT_EQ(r.exit_code, 0) << tag << ":\n" << r.output;
  RunResult out;
  out.output = r.output;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    (j.contains("eval") ? out.eval : out.train).push_back(j);
  }
  return out;
}

std::map<std::string, at::Tensor> final_weights(const std::string& dir) {
  std::map<std::string, at::Tensor> out;
  auto loaded = mfsdp::load_model(dir);
  for (const auto& p : loaded.model->named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

void expect_close(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b,
                  const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (const auto& [name, t] : a)
    EXPECT_TRUE(torch::allclose(t, b.at(name), 1e-4, 1e-6))
        << what << ": " << name << " differs by " << (t - b.at(name)).abs().max().item<double>();
}

}  // namespace

TEST(Sft, FirstLossEqualsAPlainForwardForEverySplitAndStrategy) {
  TempDir dir("mfsdp-sft");
  const auto examples = conversations(8, /*uniform=*/false);
  mfsdp::write_sft_jsonl(dir.file("train.jsonl"), examples);
  for (const std::string mode : {"token-mean", "seq-mean-token-mean"}) {
    const double expected = reference_loss(examples, mode == "token-mean");
    const std::string common = " --train-files " + dir.file("train.jsonl") + " --loss-agg-mode " + mode +
                               " --global-batch-size 8 --train-iters 2 --optimizer sgd --lr 0.5"
                               " --sgd-momentum 0 --clip-grad 0";
    struct Split {
      int ranks;
      int micro_batch;
      const char* strategy;
    };
    std::map<std::string, at::Tensor> golden;
    double golden_norm = 0;
    for (const Split& s : {Split{1, 8, "optim_grads_params"}, Split{1, 4, "no_shard"}, Split{2, 4, "optim_grads_params"},
                           Split{2, 2, "optim_grads"}, Split{2, 1, "optim"}, Split{2, 2, "no_shard"}}) {
      const std::string tag = mode + "_" + std::to_string(s.ranks) + "x" + std::to_string(s.micro_batch) + "_" + s.strategy;
      RunResult r = sft(dir, s.ranks, common + " --micro-batch-size " + std::to_string(s.micro_batch) +
                                          " --data-parallel-sharding-strategy " + s.strategy +
                                          " --save " + dir.file(tag),
                        tag);
      ASSERT_EQ(r.train.size(), 2u) << r.output;
      EXPECT_NEAR(r.train[0]["lm_loss"].get<double>(), expected, 1e-5 * expected) << tag;
      const double norm = r.train[0]["grad_norm"].get<double>();
      auto weights = final_weights(dir.file(tag));
      if (golden.empty()) {
        golden = weights;
        golden_norm = norm;
        EXPECT_GT(norm, 0);
      } else {
        EXPECT_NEAR(norm, golden_norm, 1e-5 * golden_norm) << tag;
        expect_close(weights, golden, tag);
      }
    }
  }
}

TEST(Sft, PackedLossEqualsUnpacked) {
  TempDir dir("mfsdp-sft-pack");
  // 8 conversations of 27 tokens: two fit a row of 64, so packing makes 4 rows.
  const auto examples = conversations(8, /*uniform=*/true);
  mfsdp::write_sft_jsonl(dir.file("train.jsonl"), examples);
  for (const std::string mode : {"token-mean", "seq-mean-token-mean"}) {
    const double expected = reference_loss(examples, mode == "token-mean");
    const std::string common = " --train-files " + dir.file("train.jsonl") + " --loss-agg-mode " + mode +
                               " --train-iters 1 --optimizer sgd --lr 0.5 --sgd-momentum 0 --clip-grad 0";
    RunResult plain = sft(dir, 2, common + " --micro-batch-size 2 --global-batch-size 8 --save " +
                                      dir.file("plain"), mode + "_plain");
    RunResult packed = sft(dir, 2, common + " --packing --micro-batch-size 1 --global-batch-size 4 --save " +
                                       dir.file("packed"), mode + "_packed");
    ASSERT_EQ(plain.train.size(), 1u);
    ASSERT_EQ(packed.train.size(), 1u);
    EXPECT_NE(packed.output.find("4 packed rows"), std::string::npos) << packed.output;
    EXPECT_NEAR(plain.train[0]["lm_loss"].get<double>(), expected, 1e-5 * expected) << mode;
    EXPECT_NEAR(packed.train[0]["lm_loss"].get<double>(), expected, 1e-5 * expected) << mode;
    expect_close(final_weights(dir.file("packed")), final_weights(dir.file("plain")), mode + " packed vs plain");
  }
}

TEST(Sft, LearnsValidatesAndExports) {
  TempDir dir("mfsdp-sft-learn");
  std::vector<mfsdp::SftExample> train, val;
  for (int i = 0; i < 64; ++i) train.push_back({{{"user", "say " + std::to_string(i % 4)}, {"assistant", "ok" + std::to_string(i % 4)}}});
  for (int i = 0; i < 4; ++i) val.push_back({{{"user", "say " + std::to_string(i)}, {"assistant", "ok" + std::to_string(i)}}});
  mfsdp::write_sft_jsonl(dir.file("train.jsonl"), train);
  mfsdp::write_sft_jsonl(dir.file("val.jsonl"), val);
  RunResult r = sft(dir, 2,
                    " --train-files " + dir.file("train.jsonl") + " --val-files " + dir.file("val.jsonl") +
                        " --micro-batch-size 8 --train-iters 200 --lr 1e-2 --lr-decay-style constant"
                        " --eval-interval 100 --eval-iters 1"
                        " --save " + dir.file("ckpt") + " --export-hf " + dir.file("hf"),
                    "learn");
  ASSERT_EQ(r.train.size(), 200u) << r.output;
  EXPECT_LT(r.train.back()["lm_loss"].get<double>(), 0.05 * r.train.front()["lm_loss"].get<double>()) << r.output;
  ASSERT_EQ(r.eval.size(), 2u) << r.output;
  EXPECT_TRUE(r.eval.back().contains("val/loss"));
  EXPECT_DOUBLE_EQ(r.eval.back()["val/exact_match"].get<double>(), 1.0) << r.output;
  EXPECT_TRUE(std::filesystem::exists(dir.file("learn.svg")));
  EXPECT_TRUE(std::filesystem::exists(dir.file("hf/config.json")));
  EXPECT_TRUE(std::filesystem::exists(dir.file("hf/model.safetensors")));
  EXPECT_TRUE(std::filesystem::exists(dir.file("ckpt/latest_checkpointed_iteration.txt")));
  // The export holds the same model as the checkpoint (fp32: the same values): mfsdp-generate's
  // loader reads both.
  auto exported = final_weights(dir.file("hf"));
  EXPECT_EQ(exported.size(), mfsdp::LlamaForCausalLM(model_config())->named_parameters().size());
  auto saved = final_weights(dir.file("ckpt"));
  ASSERT_EQ(saved.size(), exported.size());
  for (const auto& [name, t] : saved) EXPECT_TRUE(torch::equal(t, exported.at(name))) << name;
}

TEST(Sft, BadInputIsNamed) {
  TempDir dir("mfsdp-sft-bad");
  // Flag errors stop before the rendezvous; data errors come from a launched rank.
  auto expect_error = [&](const std::string& flags, int code, const std::string& needle) {
    auto r = run_command((code == 2 ? kSft : kRun + " --nproc-per-node 1 " + kSft) + kModel + flags);
    EXPECT_EQ(r.exit_code, code) << flags << "\n" << r.output;
    EXPECT_NE(r.output.find(needle), std::string::npos) << flags << "\n" << r.output;
  };
  expect_error(" --train-iters 1", 2, "--train-files: is required");
  expect_error(" --train-iters 1 --train-files x --data-path y", 2, "--data-path: unknown flag");
  expect_error(" --train-iters 1 --train-files x --loss-agg-mode seq-mean", 2, "--loss-agg-mode");
  expect_error(" --train-iters 1 --train-files x --save-final-model y", 2, "--save-final-model: was removed");
  // Sizes that used to name --seq-length (not an SFT flag) or end in std::bad_alloc.
  expect_error(" --train-iters 1 --gen-task arith --max-length 2147483648", 2, "--max-length: must be at most 4194304");
  expect_error(" --train-iters 1 --gen-task arith --gen-train-size 4294967296", 2,
               "--gen-train-size: must be at most 4194304");
  expect_error(" --train-iters 1 --gen-task arith --gen-digits 19", 2, "--gen-digits: must be in 1..18, got 19");
  {
    std::ofstream(dir.file("broken.jsonl")) << "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, "
                                               "{\"role\": \"assistant\", \"content\": \"yo\"}]}\n{not json\n";
  }
  expect_error(" --train-iters 1 --train-files " + dir.file("broken.jsonl"), 1, "broken.jsonl:2");
  mfsdp::write_sft_jsonl(dir.file("long.jsonl"), {{{{"user", std::string(80, 'x')}, {"assistant", "y"}}}});
  expect_error(" --train-iters 1 --train-files " + dir.file("long.jsonl"), 1, "example 1 has");
}
