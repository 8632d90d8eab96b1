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
#include "mfsdp/data/posttrain/chat_dataset.h"
#include "mfsdp/data/posttrain/chat_template.h"
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

// The loss of the initial model on `sequences`, each run alone through LlamaForCausalLM: targets
// are the tokens their loss_mask marks (after the first); token-mean or the mean over sequences of
// their token means.
double reference_loss(const std::vector<mfsdp::ChatTokens>& sequences, bool token_mean) {
  mfsdp::LlamaOptions options;
  options.init_seed = kSeed;
  mfsdp::LlamaForCausalLM model(model_config(), options);
  torch::NoGradGuard no_grad;
  double sum = 0, tokens = 0, sequence_means = 0;
  for (const auto& t : sequences) {
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
  return token_mean ? sum / tokens : sequence_means / static_cast<double>(sequences.size());
}

// The same for conversations: targets are the assistant tokens and EOD (apply_chat_template's
// mask with the plain template).
double reference_loss(const std::vector<mfsdp::SftExample>& examples, bool token_mean) {
  mfsdp::ByteLevelTokenizer tokenizer;
  std::vector<mfsdp::ChatTokens> sequences;
  for (const auto& e : examples)
    sequences.push_back(mfsdp::apply_chat_template(tokenizer, "plain", e.messages, false));
  return reference_loss(sequences, token_mean);
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

// Tensor parallelism (vocabulary-parallel token losses), context parallelism (each rank its
// load-balanced chunks of every row: ids, labels, positions, segments and loss weights) and both,
// beside data parallelism: losses and gradient norms over 3 SGD steps equal one rank's within
// 1e-5 (as Pretrain.TensorAndContextParallelTrainLikeOneRank), both loss modes, on conversations
// of mixed lengths (one per row) and packed ones (several per row, positions restarting). The
// one-rank runs pad the vocabulary to 258 as TP 2 does (--make-vocab-size-divisible-by 2).
TEST(Sft, TensorAndContextParallelTrainLikeOneRank) {
  TempDir dir("mfsdp-sft-ndp");
  mfsdp::write_sft_jsonl(dir.file("mixed.jsonl"), conversations(8, /*uniform=*/false));
  mfsdp::write_sft_jsonl(dir.file("packed.jsonl"), conversations(16, /*uniform=*/true));
  struct Layout {
    int ranks;
    const char* flags;
    const char* banner;
  };
  const std::string tp = " --tensor-model-parallel-size 2 --make-vocab-size-divisible-by 1";
  for (const std::string mode : {"token-mean", "seq-mean-token-mean"})
    for (const bool packed : {false, true}) {
      // Unpacked: 8 rows; packed: 16 conversations of ~27 tokens, two to a row of 64 (8 rows).
      const std::string data = dir.file(packed ? "packed.jsonl" : "mixed.jsonl");
      const std::string common = " --train-files " + data + " --val-files " + data +
                                 " --val-generate-samples 2 --max-new-tokens 4" +
                                 (packed ? " --packing" : "") + " --loss-agg-mode " + mode +
                                 " --global-batch-size 8 --train-iters 3 --optimizer sgd --lr 0.2"
                                 " --sgd-momentum 0 --clip-grad 0";
      const std::string name = mode + (packed ? "_packed" : "_mixed");
      RunResult one = sft(dir, 1, common + " --micro-batch-size 4 --make-vocab-size-divisible-by 2", name + "_one");
      ASSERT_EQ(one.train.size(), 3u) << one.output;
      if (packed) EXPECT_NE(one.output.find("8 packed rows"), std::string::npos) << one.output;
      int n = 0;
      for (const Layout l : {Layout{4, " --micro-batch-size 2", "data-parallel 2 x context-parallel 1 x tensor-parallel 2"},
                             Layout{4, " --micro-batch-size 2 --context-parallel-size 2 --cp-comm-type p2p",
                                    "data-parallel 2 x context-parallel 2 x tensor-parallel 1"},
                             Layout{4, " --micro-batch-size 4 --context-parallel-size 2 --sequence-parallel",
                                    "data-parallel 1 x context-parallel 2 x tensor-parallel 2"}}) {
        const bool with_tp = std::string(l.banner).find("tensor-parallel 2") != std::string::npos;
        const std::string flags = common + l.flags + (with_tp ? tp : " --make-vocab-size-divisible-by 2");
        const std::string tag = name + "_layout" + std::to_string(n++);
        RunResult got = sft(dir, l.ranks, flags, tag);
        ASSERT_EQ(got.train.size(), one.train.size()) << tag << "\n" << got.output;
        EXPECT_NE(got.output.find(std::string(" parallelism: 4 ranks = ") + l.banner), std::string::npos)
            << got.output;
        for (size_t i = 0; i < one.train.size(); ++i)
          for (const char* key : {"lm_loss", "grad_norm"}) {
            const double want = one.train[i][key].get<double>();
            EXPECT_NEAR(got.train[i][key].get<double>(), want, 1e-5 * std::abs(want))
                << tag << " " << key << " iteration " << i + 1;
          }
        // The held-out loss after training (each rank its chunks of its rows) and greedy answers.
        ASSERT_FALSE(got.eval.empty()) << got.output;
        ASSERT_FALSE(one.eval.empty()) << one.output;
        const double want = one.eval.back()["lm_loss"].get<double>();
        EXPECT_NEAR(got.eval.back()["lm_loss"].get<double>(), want, 1e-5 * std::abs(want)) << tag << " validation";
        EXPECT_EQ(got.eval.back()["val/exact_match"], one.eval.back()["val/exact_match"]) << tag;
      }
    }
}

// The fused loss (the default, here in chunks of 500 logits elements: a few vocabulary rows for
// a micro-batch's padded rows) trains as the loss from the full logits, with masks and packed
// conversations, on one rank and tensor-parallel 2: losses, gradient norms and the held-out loss.
TEST(Sft, FusedLossTrainsLikeTheFullLogits) {
  TempDir dir("mfsdp-sft-fused");
  mfsdp::write_sft_jsonl(dir.file("mixed.jsonl"), conversations(8, /*uniform=*/false));
  const std::string common = " --train-files " + dir.file("mixed.jsonl") + " --val-files " + dir.file("mixed.jsonl") +
                             " --loss-agg-mode seq-mean-token-mean --global-batch-size 8 --micro-batch-size 4"
                             " --train-iters 3 --optimizer sgd --lr 0.2 --sgd-momentum 0 --clip-grad 0";
  int n = 0;
  for (const std::string layout : {std::string(" --make-vocab-size-divisible-by 2"),
                                   std::string(" --tensor-model-parallel-size 2 --make-vocab-size-divisible-by 1")}) {
    const int ranks = n == 0 ? 1 : 2;
    const std::string tag = "layout" + std::to_string(n++);
    RunResult plain = sft(dir, ranks, common + layout + " --no-cross-entropy-loss-fusion", tag + "_plain");
    RunResult fused = sft(dir, ranks, common + layout + " --cross-entropy-chunk-elements 500", tag + "_fused");
    EXPECT_NE(fused.output.find(" loss: the output layer fused with it in chunks of 500 logits elements"),
              std::string::npos) << fused.output;
    EXPECT_NE(plain.output.find(" loss: from the full logits"), std::string::npos) << plain.output;
    ASSERT_EQ(plain.train.size(), 3u) << plain.output;
    ASSERT_EQ(fused.train.size(), 3u) << fused.output;
    for (size_t i = 0; i < 3; ++i)
      for (const char* key : {"lm_loss", "grad_norm"}) {
        const double want = plain.train[i][key].get<double>();
        EXPECT_NEAR(fused.train[i][key].get<double>(), want, 1e-5 * std::abs(want)) << tag << " " << key << " " << i;
      }
    ASSERT_FALSE(plain.eval.empty()) << plain.output;
    ASSERT_FALSE(fused.eval.empty()) << fused.output;
    const double want = plain.eval.back()["lm_loss"].get<double>();
    EXPECT_NEAR(fused.eval.back()["lm_loss"].get<double>(), want, 1e-5 * std::abs(want)) << tag << " validation";
  }
}

// Pipeline stages: conversations of mixed lengths make rows of a different length in every
// micro-batch, so each activation's shape travels ahead of it (--variable-seq-lengths, always on
// in mfsdp-sft). PP 2 under both loss modes, PP 2 x DP 2, PP 2 x TP 2 with sequence parallelism,
// PP 2 x CP 2 and interleaved PP 2 x V 2 (4 layers): losses and gradient norms of 3 SGD steps,
// the held-out loss and greedy exact match equal one rank's within 1e-5.
TEST(Sft, PipelineStagesTrainLikeOneRank) {
  TempDir dir("mfsdp-sft-pp");
  mfsdp::write_sft_jsonl(dir.file("mixed.jsonl"), conversations(8, /*uniform=*/false));
  const std::string data = dir.file("mixed.jsonl");
  struct Layout {
    int ranks;
    std::string flags;
    const char* banner;
  };
  const std::string pp = " --pipeline-model-parallel-size 2";
  const std::string vocab = " --make-vocab-size-divisible-by 2";  // 258 rows, as TP 2's 1 x 2
  for (const std::string mode : {"token-mean", "seq-mean-token-mean"}) {
    const std::string common = " --train-files " + data + " --val-files " + data +
                               " --val-generate-samples 2 --max-new-tokens 4 --loss-agg-mode " + mode +
                               " --global-batch-size 8 --train-iters 3 --optimizer sgd --lr 0.2 --sgd-momentum 0"
                               " --clip-grad 0 --micro-batch-size 2";
    std::vector<Layout> layouts = {{2, pp + vocab, "x pipeline-parallel 2"},
                                   {4, pp + vocab, "data-parallel 2 x context-parallel 1 x tensor-parallel 1 x pipeline-parallel 2"}};
    if (mode == "seq-mean-token-mean") {
      layouts.push_back({4, pp + " --tensor-model-parallel-size 2 --sequence-parallel --make-vocab-size-divisible-by 1",
                         "tensor-parallel 2 x pipeline-parallel 2"});
      layouts.push_back({4, pp + " --context-parallel-size 2 --cp-comm-type p2p" + vocab, "context-parallel 2"});
      layouts.push_back({2, pp + " --num-layers 4 --num-virtual-stages-per-pipeline-rank 2" + vocab, "pipeline-parallel 2"});
    }
    const RunResult one = sft(dir, 1, common + vocab, mode + "_one");
    const RunResult one4 = sft(dir, 1, common + vocab + " --num-layers 4", mode + "_one4");
    ASSERT_EQ(one.train.size(), 3u) << one.output;
    int n = 0;
    for (const Layout& l : layouts) {
      const std::string tag = mode + "_layout" + std::to_string(n++);
      const RunResult& want = l.flags.find("--num-layers 4") != std::string::npos ? one4 : one;
      const RunResult got = sft(dir, l.ranks, common + l.flags, tag);
      ASSERT_EQ(got.train.size(), want.train.size()) << tag << "\n" << got.output;
      EXPECT_NE(got.output.find(l.banner), std::string::npos) << tag << "\n" << got.output;
      for (size_t i = 0; i < want.train.size(); ++i)
        for (const char* key : {"lm_loss", "grad_norm"}) {
          const double w = want.train[i][key].get<double>();
          EXPECT_NEAR(got.train[i][key].get<double>(), w, 1e-5 * std::abs(w)) << tag << " " << key << " iteration " << i + 1;
        }
      ASSERT_FALSE(got.eval.empty()) << got.output;
      const double w = want.eval.back()["lm_loss"].get<double>();
      EXPECT_NEAR(got.eval.back()["lm_loss"].get<double>(), w, 1e-5 * std::abs(w)) << tag << " validation";
      EXPECT_EQ(got.eval.back()["val/exact_match"], want.eval.back()["val/exact_match"]) << tag;
    }
  }
}

// An MoE model (shared expert, balancing and z-losses) on padded conversations of mixed lengths:
// each rank routes its part of the rows (sequence-parallel slices, context-parallel chunks) and
// leaves its padding out of the balancing losses' counts, as one rank leaves it out of the whole
// rows. TP 2 x EP 2 with the experts whole, TP 2 with them split over the pair (ETP 2), and
// CP 2 x EP 2: losses, gradient norms and balancing losses over 3 SGD steps equal one rank's
// within 1e-5.
TEST(Sft, MoeTrainsLikeOneRankUnderTensorExpertAndContextParallelism) {
  TempDir dir("mfsdp-sft-moe");
  mfsdp::write_sft_jsonl(dir.file("mixed.jsonl"), conversations(8, /*uniform=*/false));
  const std::string data = dir.file("mixed.jsonl");
  const std::string common = " --train-files " + data + " --global-batch-size 8 --train-iters 3 --optimizer sgd"
                             " --lr 0.2 --sgd-momentum 0 --clip-grad 0 --num-experts 4 --moe-router-topk 2"
                             " --moe-ffn-hidden-size 32 --moe-shared-expert-intermediate-size 32"
                             " --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3";
  const std::string tp = " --tensor-model-parallel-size 2 --sequence-parallel --make-vocab-size-divisible-by 1";
  // The balancing losses are over each micro-batch's rows: every run groups the rows in twos.
  RunResult one = sft(dir, 1, common + " --micro-batch-size 2 --make-vocab-size-divisible-by 2", "one");
  ASSERT_EQ(one.train.size(), 3u) << one.output;
  int n = 0;
  for (const std::string layout :
       {tp + " --micro-batch-size 2 --expert-model-parallel-size 2 --expert-tensor-parallel-size 1",
        tp + " --micro-batch-size 2",
        std::string(" --micro-batch-size 2 --context-parallel-size 2 --expert-model-parallel-size 2"
                    " --make-vocab-size-divisible-by 2")}) {
    const std::string tag = "layout" + std::to_string(n++);
    RunResult got = sft(dir, 4, common + layout, tag);
    ASSERT_EQ(got.train.size(), one.train.size()) << layout << "\n" << got.output;
    for (size_t i = 0; i < one.train.size(); ++i)
      for (const char* key : {"lm_loss", "grad_norm", "load_balancing_loss", "z_loss"}) {
        ASSERT_TRUE(one.train[i].contains(key)) << key;
        const double want = one.train[i][key].get<double>();
        EXPECT_NEAR(got.train[i][key].get<double>(), want, 1e-5 * std::abs(want)) << layout << " " << key
                                                                                  << " iteration " << i + 1;
      }
  }
}

// --hf-load into tensor-parallel slices: each TP rank reads its rows or columns of every tensor
// from the safetensors files, each pipeline stage its layers; the runs then train as one rank
// started from the same folder does.
TEST(Sft, TensorAndPipelineRanksStartFromAHuggingFaceFolder) {
  TempDir dir("mfsdp-sft-tp-hf");
  mfsdp::write_sft_jsonl(dir.file("data.jsonl"), conversations(8, /*uniform=*/false));
  const std::string common = " --train-files " + dir.file("data.jsonl") +
                             " --global-batch-size 8 --optimizer sgd --lr 0.2 --sgd-momentum 0 --clip-grad 0";
  RunResult made = sft(dir, 1, common + " --micro-batch-size 4 --train-iters 1 --make-vocab-size-divisible-by 2 --export-hf " +
                                   dir.file("hf"), "made");
  ASSERT_EQ(made.train.size(), 1u) << made.output;
  const std::string from = common + " --train-iters 3 --hf-load " + dir.file("hf");
  RunResult one = sft(dir, 1, from + " --micro-batch-size 4", "one");
  RunResult tp = sft(dir, 2, from + " --micro-batch-size 4 --tensor-model-parallel-size 2", "tp");
  // Pipeline stages read their own layers; the last stage its copy of the tied embedding.
  RunResult pp = sft(dir, 2, from + " --micro-batch-size 4 --pipeline-model-parallel-size 2", "pp");
  ASSERT_EQ(one.train.size(), 3u) << one.output;
  ASSERT_EQ(tp.train.size(), 3u) << tp.output;
  EXPECT_NE(tp.output.find(" parallelism: 2 ranks = data-parallel 1 x context-parallel 1 x tensor-parallel 2"),
            std::string::npos)
      << tp.output;
  ASSERT_EQ(pp.train.size(), 3u) << pp.output;
  for (size_t i = 0; i < 3; ++i)
    for (const char* key : {"lm_loss", "grad_norm"}) {
      const double want = one.train[i][key].get<double>();
      EXPECT_NEAR(tp.train[i][key].get<double>(), want, 1e-5 * std::abs(want)) << key << " iteration " << i + 1;
      EXPECT_NEAR(pp.train[i][key].get<double>(), want, 1e-5 * std::abs(want)) << "PP 2 " << key << " iteration " << i + 1;
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
  EXPECT_NE(r.output.find(
                "chat template plain (auto: the tokenizer has neither <|start_header_id|> nor <|im_start|>)"),
            std::string::npos)
      << r.output;
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

// A template mfsdp does not build in, applied upstream: pre-tokenized lines train exactly as the
// sequences they hold, in both forms (loss_mask, and labels with -100), on one rank and two.
TEST(Sft, TrainsOnPreTokenizedData) {
  TempDir dir("mfsdp-sft-pretok");
  std::vector<mfsdp::ChatTokens> sequences;
  std::ofstream masks(dir.file("masks.jsonl")), labels(dir.file("labels.jsonl"));
  for (int i = 0; i < 8; ++i) {
    // "<Q>a+b</Q><A>" then the answer and EOD trained on, a user turn of different length.
    mfsdp::ChatTokens t;
    auto add = [&](const std::string& text, uint8_t m) {
      for (unsigned char c : text) {
        t.ids.push_back(c);
        t.loss_mask.push_back(m);
      }
    };
    const int a = 3 + 17 * i, b = 40 + i;
    add("<Q>" + std::to_string(a) + "+" + std::to_string(b) + std::string(i % 3, ' ') + "</Q><A>", 0);
    add(std::to_string(a + b), 1);
    t.ids.push_back(mfsdp::ByteLevelTokenizer::kEod);
    t.loss_mask.push_back(1);
    nlohmann::json label = nlohmann::json::array();
    for (size_t k = 0; k < t.ids.size(); ++k) label.push_back(t.loss_mask[k] ? t.ids[k] : -100);
    masks << nlohmann::json{{"input_ids", t.ids}, {"loss_mask", t.loss_mask}}.dump() << "\n";
    labels << nlohmann::json{{"input_ids", t.ids}, {"labels", label}, {"attention_mask", "ignored"}}.dump()
           << "\n";
    if (i == 3) masks << "\n";  // blank lines are skipped
    sequences.push_back(std::move(t));
  }
  masks.close();
  labels.close();
  const double expected = reference_loss(sequences, /*token_mean=*/true);
  for (const auto& [file, ranks] : {std::pair<std::string, int>{"masks", 2}, {"labels", 1}}) {
    RunResult r = sft(dir, ranks,
                      " --train-files " + dir.file(file + ".jsonl") +
                          " --global-batch-size 8 --micro-batch-size " + std::to_string(8 / ranks) +
                          " --train-iters 1 --optimizer sgd --lr 0.5 --chat-template llama3",
                      file + "_run");  // its metrics file: not the data file rank 0 would truncate
    ASSERT_EQ(r.train.size(), 1u) << r.output;
    EXPECT_NEAR(r.train[0]["lm_loss"].get<double>(), expected, 1e-5 * expected) << file << "\n" << r.output;
    // --chat-template names a template this byte tokenizer could not render: unused here.
    EXPECT_NE(r.output.find("8 pre-tokenized training sequences"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("chat template unused (pre-tokenized data)"), std::string::npos) << r.output;
  }
}

TEST(Sft, BadPreTokenizedLinesAreNamed) {
  TempDir dir("mfsdp-sft-pretok-bad");
  const std::string good = "{\"input_ids\": [65, 66, 67], \"loss_mask\": [0, 1, 1]}\n";
  struct Case {
    const char* name;
    std::string second_line;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {"vocab", "{\"input_ids\": [65, 257], \"loss_mask\": [0, 1]}",
       ": \"input_ids\"[1] is 257: not a token id"},
      {"negative", "{\"input_ids\": [-1, 66], \"labels\": [-100, 66]}", ": \"input_ids\"[0] is -1"},
      {"float", "{\"input_ids\": [65, 66.5], \"loss_mask\": [0, 1]}", ": \"input_ids\"[1] is 66.5"},
      {"huge", "{\"input_ids\": [65, 66], \"loss_mask\": [0, 1e999999]}",
       ": invalid JSON ([json.exception.out_of_range.406] number overflow parsing '1e999999')"},
      {"not_list", "{\"input_ids\": \"AB\", \"loss_mask\": [0, 1]}", ": \"input_ids\" must be a list"},
      {"lengths", "{\"input_ids\": [65, 66, 67], \"loss_mask\": [0, 1]}",
       ": \"loss_mask\" has 2 values and \"input_ids\" 3"},
      {"mask_value", "{\"input_ids\": [65, 66], \"loss_mask\": [0, 2]}",
       ": \"loss_mask\"[1] is 2; a loss mask value must be 0 or 1"},
      {"label", "{\"input_ids\": [65, 66], \"labels\": [-100, 67]}",
       ": \"labels\"[1] is 67; a label must be -100 (not trained) or input_ids[1] (66)"},
      {"no_mask", "{\"input_ids\": [65, 66]}", ": \"input_ids\" needs \"loss_mask\" or \"labels\""},
      {"both", "{\"input_ids\": [65, 66], \"loss_mask\": [0, 1], \"labels\": [-100, 66]}",
       ": has both \"loss_mask\" and \"labels\""},
      {"mixed", "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}", ": no \"input_ids\""},
      {"json", "{\"input_ids\": [65, 66], \"loss_mask\": [0, 1]", ": invalid JSON"},
      {"empty", "{\"input_ids\": [], \"loss_mask\": []}", ": \"input_ids\" is empty"},
      {"no_target", "{\"input_ids\": [65, 66], \"loss_mask\": [1, 0]}", " has no token to train on"},
  };
  for (const Case& c : cases) {
    const std::string file = dir.file(std::string(c.name) + ".jsonl");
    std::ofstream(file) << good << c.second_line << "\n" << good;
    auto r =
        run_command(kRun + " --nproc-per-node 1 " + kSft + kModel + " --train-iters 1 --train-files " + file);
    EXPECT_EQ(r.exit_code, 1) << c.name << "\n" << r.output;
    EXPECT_NE(r.output.find(file + ":2" + c.needle), std::string::npos) << c.name << "\n" << r.output;
  }
  {
    // A broken first line still counts as pre-tokenized when it names input_ids.
    const std::string file = dir.file("first.jsonl");
    std::ofstream(file) << "{\"input_ids\": [65, 1e999999], \"loss_mask\": [0, 1]}\n" << good;
    auto r =
        run_command(kRun + " --nproc-per-node 1 " + kSft + kModel + " --train-iters 1 --train-files " + file);
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find(file + ":1: invalid JSON"), std::string::npos) << r.output;
  }
  // Longer than --max-length 64: named by file:line, cut by --truncation.
  nlohmann::json ids = nlohmann::json::array(), mask = nlohmann::json::array();
  for (int k = 0; k < 80; ++k) {
    ids.push_back(65 + k % 26);
    mask.push_back(k >= 70 ? 1 : 0);
  }
  const std::string file = dir.file("long.jsonl");
  std::ofstream(file) << good << nlohmann::json{{"input_ids", ids}, {"loss_mask", mask}}.dump() << "\n";
  auto r =
      run_command(kRun + " --nproc-per-node 1 " + kSft + kModel + " --train-iters 1 --train-files " + file);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find(file + ":2 has 80 tokens, more than --max-length 64"), std::string::npos)
      << r.output;
  r = run_command(kRun + " --nproc-per-node 1 " + kSft + kModel +
                  " --train-iters 1 --truncation right --train-files " + file);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find(file + ":2 has no token to train on after --truncation right"), std::string::npos)
      << r.output;
}

// A tokenizer.json over bytes (id = byte, no merges) with `tokens` added from id 256: a tokenizer
// with a family's special tokens.
std::string write_byte_tokenizer(const TempDir& dir, const std::string& name,
                                 const std::vector<std::string>& tokens) {
  auto utf8 = [](uint32_t cp) {  // bytes_to_unicode symbols are below U+0800
    std::string s;
    if (cp < 0x80) return std::string(1, static_cast<char>(cp));
    s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    return s;
  };
  nlohmann::json vocab = nlohmann::json::object(), added = nlohmann::json::array();
  for (int b = 0; b < 256; ++b) vocab[utf8(mfsdp::gpt2_byte_to_unicode(static_cast<uint8_t>(b)))] = b;
  for (size_t k = 0; k < tokens.size(); ++k)
    added.push_back({{"id", 256 + k},
                     {"content", tokens[k]},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  const nlohmann::json file = {
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", nlohmann::json::array()}}}};
  std::filesystem::create_directories(dir.file(name));
  std::ofstream(dir.file(name + "/tokenizer.json")) << file.dump();
  return dir.file(name);
}

// --chat-template auto picks the family's template from the tokenizer's special tokens, says so
// at start-up, and trains on that template's mask.
TEST(Sft, AutoTemplateFromTheTokenizer) {
  TempDir dir("mfsdp-sft-auto");
  const auto examples = conversations(4, /*uniform=*/false);
  mfsdp::write_sft_jsonl(dir.file("train.jsonl"), examples);
  struct Case {
    std::vector<std::string> tokens;
    std::string name, why;
  };
  for (const Case& c : {Case{{"<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|endoftext|>"},
                             "qwen3",
                             "the tokenizer has <|im_start|> and <think>"},
                        Case{{"<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                              "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"},
                             "llama3.1",
                             "the tokenizer has <|start_header_id|> and <|eom_id|>"}}) {
    const std::string folder = write_byte_tokenizer(dir, c.name, c.tokens);
    auto tokenizer = mfsdp::load_hf_tokenizer(folder);
    int64_t targets = 0;
    for (const auto& e : examples)
      for (uint8_t m : mfsdp::apply_chat_template(*tokenizer, c.name, e.messages, false).loss_mask)
        targets += m;
    const std::string flags = " --train-files " + dir.file("train.jsonl") +
                              " --tokenizer-type HuggingFaceTokenizer"
                              " --tokenizer-model " +
                              folder +
                              " --max-length 128 --global-batch-size 4"
                              " --micro-batch-size 4 --train-iters 1";
    RunResult r = sft(dir, 1, flags, c.name);
    ASSERT_EQ(r.train.size(), 1u) << r.output;
    EXPECT_NE(r.output.find("chat template " + c.name + " (auto: " + c.why + ")"), std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find(", " + std::to_string(targets) + " target tokens)"), std::string::npos)
        << targets << "\n"
        << r.output;
  }
}
