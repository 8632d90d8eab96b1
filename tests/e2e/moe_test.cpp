// Mixtures of experts end to end, through mfsdp-run: docs/moe.md's example at a reduced size
// (pretraining with expert parallelism, then SFT from its checkpoint, each loss falling, the
// export a Qwen3-MoE folder), resuming bit-exactly at the same expert-parallel size and
// continuing at another one (EP 2 -> EP 1 -> EP 2); GRPO after the SFT on the training that never stopped;
// aux-loss-free balancing: the expert bias each step moves as Megatron's rule says from the logged
// global token counts, saved where PyTorch's DCP reads it, resumed bit-exactly; DeepSeek-V3's
// architecture from Megatron's MLA and group-routing flags, trained with expert parallelism.
#include <gtest/gtest.h>

#include <filesystem>
#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "harness/metrics_file.h"
#include "harness/run_command.h"
#include "harness/temp_dir.h"
#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/checkpoint/dcp.h"

namespace {

using mfsdp::testing::run_command;
using mfsdp::testing::TempDir;
using json = nlohmann::json;

const std::string kRun = MFSDP_RUN_BIN_PATH;
const std::string kPretrain = MFSDP_PRETRAIN_BIN_PATH;
const std::string kSft = MFSDP_SFT_BIN_PATH;
const std::string kGrpo = MFSDP_GRPO_BIN_PATH;
const std::string kPython = MFSDP_PYTHON_PATH;

// docs/moe.md's model and MoE flags.
const std::string kModel =
    " --device cpu --tokenizer-type ByteLevelTokenizer --mock-data --num-layers 2 --hidden-size 64"
    " --num-attention-heads 4 --group-query-attention --num-query-groups 2 --kv-channels 32 --qk-layernorm --swiglu"
    " --ffn-hidden-size 128 --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 64 --moe-router-pre-softmax"
    " --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3 --seq-length 64 --micro-batch-size 4 --global-batch-size 16"
    " --lr 3e-3 --lr-warmup-iters 10 --eval-interval 1000 --eval-iters 1";

// A deepseek_v3 model from Megatron's flags: multi-head latent attention (a low-rank query, YaRN),
// sigmoid group-limited routing with an expert bias and a scaling factor, a shared expert, the
// first layer dense.
const std::string kDeepseekModel =
    " --device cpu --tokenizer-type ByteLevelTokenizer --mock-data --num-layers 2 --hidden-size 64"
    " --num-attention-heads 4 --swiglu --ffn-hidden-size 128 --multi-latent-attention --q-lora-rank 32"
    " --kv-lora-rank 16 --qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 16 --rotary-scaling-factor 4"
    " --mscale 1 --mscale-all-dim 1 --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 64"
    " --moe-shared-expert-intermediate-size 64 --moe-router-score-function sigmoid --moe-router-enable-expert-bias"
    " --moe-router-num-groups 2 --moe-router-group-topk 1 --moe-router-topk-scaling-factor 2.5"
    " --moe-layer-freq [0,1] --moe-aux-loss-coeff 1e-2 --seq-length 64 --micro-batch-size 4"
    " --global-batch-size 16 --lr 3e-3 --lr-warmup-iters 10 --eval-interval 1000 --eval-iters 1";

using mfsdp::testing::training_records;

std::string pretrain(const std::string& flags) {
  return kRun + " --nproc-per-node 2 " + kPretrain + kModel + flags + " 2>&1";
}

TEST(Moe, DocsExamplePretrainsWithExpertParallelismThenFinetunes) {
  TempDir dir("mfsdp-moe-docs");
  const auto r = run_command(pretrain(" --expert-model-parallel-size 2 --train-iters 40 --log-interval 10 --save " +
                                      dir.file("moe_ckpt") + " --metrics-file " + dir.file("pretrain.jsonl")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto train = training_records(dir.file("pretrain.jsonl"));
  ASSERT_EQ(train.size(), 4u) << r.output;
  EXPECT_LT(train.back()["lm_loss"].get<double>(), 0.8 * train.front()["lm_loss"].get<double>()) << r.output;
  EXPECT_NEAR(train.back()["load_balancing_loss"].get<double>(), 1.0, 0.5) << r.output;
  EXPECT_GT(train.back()["z_loss"].get<double>(), 0.0) << r.output;

  // SFT from it, the experts no longer split (EP 1): the checkpoint's names are global.
  const auto s = run_command(kRun + " --nproc-per-node 2 " + kSft + " --device cpu --load " + dir.file("moe_ckpt") +
                             " --finetune --tokenizer-type ByteLevelTokenizer --gen-task arith --gen-digits 1"
                             " --gen-seed 7 --gen-train-size 500 --gen-val-size 20 --max-length 32"
                             " --micro-batch-size 16 --global-batch-size 32 --train-iters 30 --lr 3e-3"
                             " --lr-warmup-iters 5 --log-interval 10 --eval-interval 1000 --eval-iters 1"
                             " --moe-aux-loss-coeff 1e-2 --save " + dir.file("sft_ckpt") + " --export-hf " + dir.file("sft_hf") + " --metrics-file " +
                             dir.file("sft.jsonl") + " 2>&1");
  ASSERT_EQ(s.exit_code, 0) << s.output;
  const auto sft = training_records(dir.file("sft.jsonl"));
  ASSERT_EQ(sft.size(), 3u) << s.output;
  EXPECT_LT(sft.back()["lm_loss"].get<double>(), 0.8 * sft.front()["lm_loss"].get<double>()) << s.output;
  std::ifstream config(dir.file("sft_hf/config.json"));
  ASSERT_TRUE(config.good()) << s.output;
  const json hf = json::parse(config);
  EXPECT_EQ(hf["model_type"], "qwen3_moe");
  EXPECT_EQ(hf["num_experts"], 4);
  EXPECT_EQ(hf["head_dim"], 32);

  // GRPO from the SFT checkpoint, the experts split again (rollouts gather every expert; the
  // reference policy is sharded as the policy is).
  const auto g = run_command(kRun + " --nproc-per-node 2 " + kGrpo + " --device cpu --load " + dir.file("sft_ckpt") +
                             " --finetune --tokenizer-type ByteLevelTokenizer --gen-task arith --gen-digits 1"
                             " --gen-seed 7 --gen-train-size 100 --gen-val-size 8 --max-prompt-length 32"
                             " --max-response-length 4 --train-batch-size 8 --rollout-n 4 --micro-batch-size 16"
                             " --train-iters 2 --lr 1e-4 --log-interval 1 --eval-interval 1000 --use-kl-loss"
                             " --kl-loss-coef 0.001 --moe-aux-loss-coeff 1e-2 --expert-model-parallel-size 2"
                             " --export-hf " + dir.file("grpo_hf") + " 2>&1");
  ASSERT_EQ(g.exit_code, 0) << g.output;
  EXPECT_NE(g.output.find("load_balancing_loss"), std::string::npos) << g.output;
  EXPECT_TRUE(std::filesystem::exists(dir.file("grpo_hf/model.safetensors"))) << g.output;
}

// Six iterations straight at EP 2; three, saved, then three more resumed at EP 2 (the same
// bits), and at EP 1 (the same training up to the order of floating-point sums).
TEST(Moe, ResumesBitExactlyAndAcrossExpertParallelSizes) {
  TempDir dir("mfsdp-moe-resume");
  const std::string common = " --log-interval 1 --seed 5 --lr-warmup-iters 2";
  const auto straight = run_command(pretrain(common + " --expert-model-parallel-size 2 --train-iters 6 --metrics-file " +
                                             dir.file("straight.jsonl")));
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  const auto first = run_command(pretrain(common + " --expert-model-parallel-size 2 --train-iters 6 --exit-interval 3 --save " +
                                          dir.file("ckpt") + " --metrics-file " + dir.file("first.jsonl")));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const auto want = training_records(dir.file("straight.jsonl"));
  ASSERT_EQ(want.size(), 6u);
  for (int ep : {2, 1}) {
    const std::string tag = "ep" + std::to_string(ep);
    const auto resumed = run_command(pretrain(common + " --expert-model-parallel-size " + std::to_string(ep) +
                                              " --train-iters 6 --load " + dir.file("ckpt") + " --metrics-file " +
                                              dir.file(tag + ".jsonl")));
    ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
    const auto got = training_records(dir.file(tag + ".jsonl"));
    ASSERT_EQ(got.size(), 3u) << resumed.output;
    for (size_t i = 0; i < 3; ++i) {
      const double a = got[i]["lm_loss"].get<double>(), b = want[3 + i]["lm_loss"].get<double>();
      if (ep == 2) {
        EXPECT_EQ(a, b) << "iteration " << 4 + i << " resumed at EP 2";
      } else {
        EXPECT_NEAR(a, b, 1e-5 * b) << "iteration " << 4 + i << " resumed at EP 1";
      }
      EXPECT_NEAR(got[i]["load_balancing_loss"].get<double>(), want[3 + i]["load_balancing_loss"].get<double>(), 1e-5)
          << tag;
    }
  }
}

TEST(Moe, ExpertBiasMovesByGlobalTokenCountsIsSavedAndResumes) {
  TempDir dir("mfsdp-moe-bias");
  std::string model = kModel;
  model.erase(model.find(" --moe-router-pre-softmax"), std::string(" --moe-router-pre-softmax").size());
  const double rate = 1e-2;
  const std::string flags = model + " --moe-router-score-function sigmoid --moe-router-enable-expert-bias" +
                            " --moe-router-bias-update-rate 1e-2 --moe-per-layer-logging --log-interval 1 --seed 5" +
                            " --lr-warmup-iters 2 --train-iters 6";
  auto run = [&](int ranks, const std::string& more) {
    return run_command(kRun + " --nproc-per-node " + std::to_string(ranks) + " " + kPretrain + flags + more + " 2>&1");
  };
  const auto one = run(1, " --metrics-file " + dir.file("one.jsonl"));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const auto two = run(2, " --expert-model-parallel-size 2 --save " + dir.file("ckpt") + " --metrics-file " +
                              dir.file("two.jsonl") + " --dump-param-to-param-group-map " + dir.file("map"));
  ASSERT_EQ(two.exit_code, 0) << two.output;
  // Megatron's parameter -> optimizer group map names every expert (rank 0 holds only experts
  // 0 and 1), and no buffer.
  mfsdp::dcp::Reader map(dir.file("map"));
  EXPECT_EQ(map.read_object("module.module.model.layers.1.mlp.experts.3.down_proj.weight"), 0);
  EXPECT_EQ(map.read_object("module.module.model.layers.0.mlp.gate.weight"), 0);
  for (const auto& [key, bytes] : map.metadata().bytes)
    EXPECT_EQ(key.find("e_score_correction_bias"), std::string::npos) << key;
  const auto single = training_records(dir.file("one.jsonl")), split = training_records(dir.file("two.jsonl"));
  ASSERT_EQ(single.size(), 6u);
  ASSERT_EQ(split.size(), 6u);

  // Megatron's rule from the counts over both ranks (what the log shows): bias_e moves by
  // rate x sign(mean - tokens_e) after every step.
  std::map<std::string, std::vector<double>> bias;
  for (size_t i = 0; i < split.size(); ++i) {
    const double a = split[i]["lm_loss"].get<double>(), b = single[i]["lm_loss"].get<double>();
    EXPECT_NEAR(a, b, 1e-5 * b) << "iteration " << i + 1 << ": EP 2 on 2 ranks against one process";
    for (const std::string layer : {"layer_0", "layer_1"}) {
      std::vector<double> tokens;
      double sum = 0;
      for (int e = 0; e < 4; ++e) {
        tokens.push_back(split[i]["tokens_per_expert/" + layer + "/expert_" + std::to_string(e)].get<double>());
        sum += tokens.back();
      }
      EXPECT_EQ(sum, 2.0 * 16 * 64) << "every token routed to top-2 experts";
      auto& b_layer = bias[layer];
      b_layer.resize(4, 0.0);
      for (int e = 0; e < 4; ++e) {
        const double offset = sum / 4 - tokens[static_cast<size_t>(e)];
        b_layer[static_cast<size_t>(e)] += rate * (offset > 0 ? 1 : offset < 0 ? -1 : 0);
      }
    }
  }
  // PyTorch's DCP reads the saved biases.
  const std::string script =
      "import json,sys,torch\n"
      "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
      "dcp_to_torch_save(sys.argv[1], sys.argv[2])\n"
      "sd = torch.load(sys.argv[2], weights_only=False)\n"
      "print(json.dumps({'model.' + k: v.tolist() for k, v in sd['model'].items() if k.endswith('correction_bias')}))\n";
  std::ofstream(dir.file("read.py")) << script;
  const auto read = run_command(kPython + " " + dir.file("read.py") + " " + dir.file("ckpt/iter_0000006") + " " +
                                dir.file("all.pt") + " 2>&1");
  ASSERT_EQ(read.exit_code, 0) << read.output;
  const json saved = json::parse(read.output.substr(read.output.rfind('{')));
  double moved = 0;  // a bias can come back to zero (the sign rule oscillates), not every one
  for (int l = 0; l < 2; ++l) {
    const std::string key = "model.module.model.layers." + std::to_string(l) + ".mlp.gate.e_score_correction_bias";
    ASSERT_TRUE(saved.contains(key)) << read.output;
    for (int e = 0; e < 4; ++e) {
      EXPECT_NEAR(saved[key][e].get<double>(), bias["layer_" + std::to_string(l)][static_cast<size_t>(e)], 1e-6)
          << key << " expert " << e;
      moved += std::abs(saved[key][e].get<double>());
    }
  }
  EXPECT_GT(moved, 0.0);

  // Resumed from iteration 3 at EP 2: the same losses bit for bit (the bias came back too).
  const auto first = run(2, " --expert-model-parallel-size 2 --exit-interval 3 --save " + dir.file("half"));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const auto resumed = run(2, " --expert-model-parallel-size 2 --load " + dir.file("half") + " --metrics-file " +
                                  dir.file("resumed.jsonl"));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  const auto got = training_records(dir.file("resumed.jsonl"));
  ASSERT_EQ(got.size(), 3u) << resumed.output;
  for (size_t i = 0; i < 3; ++i)
    EXPECT_EQ(got[i]["lm_loss"].get<double>(), split[3 + i]["lm_loss"].get<double>()) << "iteration " << 4 + i;
}

// Each of `layouts` (flags) on 4 ranks trains as one rank does (losses, grad norms, params norms
// within 1e-5 over 4 iterations) and prints `line` at start-up; `model` adds to `base` for all.
void expect_trains_like_one_rank(const std::vector<std::string>& layouts, const std::string& line,
                                 const std::string& model = "", const std::string& base = kModel) {
  TempDir dir("mfsdp-moe-layouts");
  // AdamW eps 1e-3 (as Pretrain.HybridShardingTrainsLikeOneRank): 4 ranks sum in another order.
  const std::string flags =
      base + model + " --train-iters 4 --lr-warmup-iters 1 --log-interval 1 --log-params-norm --adam-eps 1e-3";
  auto records = [&](int ranks, const std::string& extra, const std::string& name, std::string* output) {
    const std::string metrics = dir.file(name + ".jsonl");
    const auto r = run_command(kRun + " --nproc-per-node " + std::to_string(ranks) + " " + kPretrain + flags + extra +
                               " --metrics-file " + metrics + " 2>&1");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    if (output) *output = r.output;
    return training_records(metrics);
  };
  const auto one = records(1, "", "one", nullptr);
  ASSERT_EQ(one.size(), 4u);
  int run = 0;
  for (const std::string& layout : layouts) {
    std::string output;
    const auto other = records(4, layout, "layout" + std::to_string(run++), &output);
    ASSERT_EQ(other.size(), one.size()) << layout << "\n" << output;
    EXPECT_NE(output.find(line), std::string::npos) << output;
    for (size_t i = 0; i < one.size(); ++i)
      for (const char* key : {"lm_loss", "grad_norm", "params_norm", "load_balancing_loss", "z_loss"}) {
        if (!one[i].contains(key)) continue;  // z_loss without --moe-z-loss-coeff
        const double want = one[i][key].get<double>();
        EXPECT_NEAR(other[i][key].get<double>(), want, 1e-5 * std::abs(want)) << layout << " " << key << " it " << i + 1;
      }
  }
}

// HSDP with expert parallelism (the experts' own replicas: Megatron-FSDP's hybrid_fsdp_expt_group):
// 4 ranks as 2 instances x 2 shards, the experts split over 2 expert-parallel ranks and sharded
// over their 1-rank expert-data-parallel group in each instance, under ZeRO-3 and ZeRO-1 inside
// the instances and with HFSDP; the start-up line names the experts' layout.
TEST(Moe, HybridShardingWithExpertParallelismTrainsLikeOneRank) {
  const std::string hsdp_ep = " --num-distributed-optimizer-instances 2 --expert-model-parallel-size 2";
  expect_trains_like_one_rank({hsdp_ep + " --data-parallel-sharding-strategy optim_grads_params",
                               hsdp_ep + " --data-parallel-sharding-strategy optim",
                               hsdp_ep + " --outer-dp-sharding-strategy optim"},
                              "the experts likewise: 2 instances of 1 expert-data-parallel ranks");
}

// Context parallelism with MoE layers: each rank routes its chunks, the balancing losses count
// the whole sequences over the CP group (Megatron's tp_cp reduction), the experts' tokens go to
// their expert-parallel ranks (which are the CP pairs: ETP 1, EP 2 over DP 2 x CP 2).
TEST(Moe, ContextParallelWithExpertParallelismTrainsLikeOneRank) {
  expect_trains_like_one_rank({" --context-parallel-size 2 --expert-model-parallel-size 2",
                               " --context-parallel-size 2 --expert-model-parallel-size 2 --cp-comm-type p2p"
                               " --data-parallel-sharding-strategy optim",
                               " --context-parallel-size 2"},
                              "context-parallel 2");
}

// Tensor parallelism with MoE layers, under sequence parallelism (Megatron trains MoE layers
// with TP only so): each rank routes its slice of the sequence, the router's gradient summed over
// the pair. Experts whole (--expert-tensor-parallel-size 1) are sharded over their
// expert-data-parallel group, which spans the tensor-parallel pair; experts split
// (Megatron's default ETP = TP) run the pair's rows through both slices. TP2 x EP2 and TP2 with
// every expert here, each ETP, under ZeRO-3 and ZeRO-1/2; a gated shared expert (a
// tensor-parallel MLP) in every layer.
TEST(Moe, TensorParallelWithExpertParallelismTrainsLikeOneRank) {
  // Megatron pads the vocabulary to a multiple of 128 x TP by default: 64 x 2 pads as one rank.
  const std::string tp = " --tensor-model-parallel-size 2 --sequence-parallel --make-vocab-size-divisible-by 64";
  expect_trains_like_one_rank({tp + " --expert-model-parallel-size 2 --expert-tensor-parallel-size 1",
                               tp + " --expert-model-parallel-size 2 --data-parallel-sharding-strategy optim",
                               tp + " --expert-tensor-parallel-size 1 --data-parallel-sharding-strategy optim_grads",
                               tp},
                              "tensor-parallel 2",
                              " --moe-shared-expert-intermediate-size 64 --moe-shared-expert-gate");
}

// TP x CP with MoE layers: the balancing losses count over the tp_cp group of 4.
TEST(Moe, TensorAndContextParallelWithMoeTrainsLikeOneRank) {
  const std::string tp_cp =
      " --tensor-model-parallel-size 2 --sequence-parallel --make-vocab-size-divisible-by 64 --context-parallel-size 2";
  expect_trains_like_one_rank({tp_cp, tp_cp + " --expert-tensor-parallel-size 1 --expert-model-parallel-size 2"},
                              "context-parallel 2 x tensor-parallel 2");
}

// A checkpoint saved at iteration 3 by `saved` on 4 ranks resumes at each of `resumed` (ranks,
// flags), and each continues as the training that never stopped on one rank does.
void expect_resumes_like_one_rank(const std::string& saved, const std::vector<std::pair<int, std::string>>& resumed) {
  TempDir dir("mfsdp-moe-reshard");
  const std::string flags = kModel + " --train-iters 6 --lr-warmup-iters 1 --log-interval 1 --adam-eps 1e-3";
  auto launch = [&](int ranks, const std::string& extra) {
    const auto r = run_command(kRun + " --nproc-per-node " + std::to_string(ranks) + " " + kPretrain + flags + extra +
                               " 2>&1");
    EXPECT_EQ(r.exit_code, 0) << extra << "\n" << r.output;
  };
  launch(1, " --metrics-file " + dir.file("straight.jsonl"));
  launch(4, saved + " --exit-interval 3 --save " + dir.file("ckpt"));
  const auto straight = training_records(dir.file("straight.jsonl"));
  ASSERT_EQ(straight.size(), 6u);
  int n = 0;
  for (const auto& [ranks, layout] : resumed) {
    const std::string metrics = dir.file("resumed" + std::to_string(n++) + ".jsonl");
    launch(ranks, layout + " --load " + dir.file("ckpt") + " --metrics-file " + metrics);
    const auto got = training_records(metrics);
    ASSERT_EQ(got.size(), 3u) << layout;
    for (size_t i = 0; i < 3; ++i) {
      ASSERT_EQ(got[i]["iteration"], straight[i + 3]["iteration"]);
      for (const char* key : {"lm_loss", "grad_norm"}) {
        const double want = straight[i + 3][key].get<double>();
        EXPECT_NEAR(got[i][key].get<double>(), want, 1e-5 * std::abs(want)) << saved << " -> " << layout << " " << key
                                                                            << " it " << i + 4;
      }
    }
  }
}

// A checkpoint saved by HSDP 2 x EP 2 (each element once over the instances and the
// expert-parallel ranks) resumes at CP 2 x EP 2 and on one rank.
TEST(Moe, HybridExpertCheckpointResumesAtOtherLayouts) {
  expect_resumes_like_one_rank(" --num-distributed-optimizer-instances 2 --expert-model-parallel-size 2",
                               {{4, " --context-parallel-size 2 --expert-model-parallel-size 2"}, {1, ""}});
}

// A checkpoint saved by TP 2 x EP 2 with the experts split over the pair (ETP 2: each expert's
// rows and columns boxes of the whole) resumes on one rank, at TP 2 x EP 2 with experts whole
// (ETP 1), and at CP 2 x EP 2.
TEST(Moe, TensorExpertCheckpointResumesAtOtherLayouts) {
  const std::string tp = " --tensor-model-parallel-size 2 --sequence-parallel --make-vocab-size-divisible-by 64";
  expect_resumes_like_one_rank(tp + " --expert-model-parallel-size 2",
                               {{1, ""},
                                {4, tp + " --expert-model-parallel-size 2 --expert-tensor-parallel-size 1"},
                                {4, " --context-parallel-size 2 --expert-model-parallel-size 2"}});
}

TEST(Moe, BadExpertParallelSizesAreNamed) {
  TempDir dir("mfsdp-moe-bad");
  const auto three = run_command(pretrain(" --expert-model-parallel-size 3 --train-iters 1"));
  EXPECT_NE(three.exit_code, 0);
  EXPECT_NE(three.output.find("--expert-model-parallel-size: 3 is more than the world size 2"), std::string::npos)
      << three.output;
  const auto odd = run_command(pretrain(" --num-experts 3 --expert-model-parallel-size 2 --train-iters 1 --lr-warmup-iters 0"));
  EXPECT_NE(odd.exit_code, 0);
  EXPECT_NE(odd.output.find("--expert-model-parallel-size: 2 does not divide the model ("), std::string::npos)
      << odd.output;
  EXPECT_NE(odd.output.find("'s 3 experts"), std::string::npos) << odd.output;
  const auto bias = run_command(pretrain(" --moe-router-enable-expert-bias --train-iters 1"));
  EXPECT_NE(bias.exit_code, 0);
  EXPECT_NE(bias.output.find("--moe-router-enable-expert-bias: needs --moe-router-score-function sigmoid"),
            std::string::npos) << bias.output;
  const auto dense = run_command(kRun + " --nproc-per-node 2 " + kPretrain +
                                 " --device cpu --mock-data --vocab-size 64 --train-iters 1 --expert-model-parallel-size 2 2>&1");
  EXPECT_NE(dense.exit_code, 0);
  EXPECT_NE(dense.output.find("--expert-model-parallel-size: the model"), std::string::npos) << dense.output;
  EXPECT_NE(dense.output.find("has no experts"), std::string::npos) << dense.output;
  // Megatron's MoE layer trains under TP only with sequence parallelism.
  const auto no_sp = run_command(pretrain(" --tensor-model-parallel-size 2 --train-iters 1 --lr-warmup-iters 0"));
  EXPECT_NE(no_sp.exit_code, 0);
  EXPECT_NE(no_sp.output.find("--tensor-model-parallel-size: 2 with the model ("), std::string::npos) << no_sp.output;
  EXPECT_NE(no_sp.output.find("MoE layers needs --sequence-parallel"), std::string::npos) << no_sp.output;
  const auto etp = run_command(pretrain(" --tensor-model-parallel-size 2 --sequence-parallel --train-iters 1 --lr-warmup-iters 0"
                                        " --moe-ffn-hidden-size 63"));
  EXPECT_NE(etp.exit_code, 0);
  EXPECT_NE(etp.output.find("--expert-tensor-parallel-size: 2 does not divide the model ("), std::string::npos)
      << etp.output;
  EXPECT_NE(etp.output.find("moe_intermediate_size 63"), std::string::npos) << etp.output;
}

// Megatron's MLA flags (--multi-latent-attention and the rest) with DeepSeek-V3's MoE flags build
// a deepseek_v3 model that trains with expert parallelism and is recorded as one in its
// checkpoint.
TEST(Moe, MultiLatentAttentionDeepseekModelTrainsWithExpertParallelism) {
  TempDir dir("mfsdp-moe-mla");
  const auto r = run_command(kRun + " --nproc-per-node 2 " + kPretrain + kDeepseekModel +
                             " --expert-model-parallel-size 2 --train-iters 40 --log-interval 10 --save " +
                             dir.file("ckpt") + " --metrics-file " + dir.file("m.jsonl") + " 2>&1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto train = training_records(dir.file("m.jsonl"));
  ASSERT_EQ(train.size(), 4u) << r.output;
  EXPECT_LT(train.back()["lm_loss"].get<double>(), 0.8 * train.front()["lm_loss"].get<double>()) << r.output;
  const json config = mfsdp::CheckpointReader(dir.file("ckpt/iter_0000040")).metadata()["model_config"];
  EXPECT_EQ(config["model_type"], "deepseek_v3") << config.dump();
  EXPECT_EQ(config["q_lora_rank"], 32);
  EXPECT_EQ(config["qk_nope_head_dim"], 16);
  EXPECT_EQ(config["qk_rope_head_dim"], 8);
  EXPECT_EQ(config["rope_parameters"]["rope_type"], "yarn");
  EXPECT_EQ(config["rope_parameters"]["factor"], 4.0);
  EXPECT_EQ(config["first_k_dense_replace"], 1);
  EXPECT_EQ(config["n_shared_experts"], 1);
  EXPECT_EQ(config["n_group"], 2);
  EXPECT_EQ(config["topk_group"], 1);
  EXPECT_EQ(config["routed_scaling_factor"], 2.5);
}

// Multi-head latent attention under tensor parallelism (each rank its heads; the latents'
// down-projections and norms replicated, their gradients summed over the pair) with expert
// parallelism beside it, and under context parallelism (values of their own width exchanged by
// all-gather and by ring), on 4 ranks, against one rank.
TEST(Moe, MultiLatentAttentionUnderTensorAndContextParallelismTrainsLikeOneRank) {
  const std::string tp = " --tensor-model-parallel-size 2 --sequence-parallel --make-vocab-size-divisible-by 64";
  expect_trains_like_one_rank({tp + " --expert-model-parallel-size 2",
                               " --context-parallel-size 2 --expert-model-parallel-size 2 --cp-comm-type p2p",
                               " --context-parallel-size 2 --data-parallel-sharding-strategy optim"},
                              "parallelism: 4 ranks = ", "", kDeepseekModel);
}

}  // namespace
