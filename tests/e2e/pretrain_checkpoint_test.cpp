// mfsdp-pretrain --save / --load end to end, through mfsdp-run: training 8 iterations equals
// training 4, saving, resuming and training 4 more, bit for bit (ZeRO-3 and no_shard); a 2-rank
// checkpoint resumes on 1 rank under another strategy; --finetune and every resume rule that
// can go wrong give an error naming the flag or field.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "harness/file_bytes.h"
#include "harness/run_command.h"
#include "harness/temp_dir.h"
#include "mfsdp/checkpoint/dcp.h"

namespace {

namespace fs = std::filesystem;
using mfsdp::testing::CommandOutcome;
using mfsdp::testing::run_command;
using mfsdp::testing::TempDir;

const std::string kModel =
    " --device cpu --mock-data --vocab-size 64 --make-vocab-size-divisible-by 64 --num-layers 2 --hidden-size 32"
    " --num-attention-heads 4 --group-query-attention --num-query-groups 2 --swiglu"
    " --ffn-hidden-size 48 --seq-length 16 --micro-batch-size 2 --global-batch-size 8"
    " --train-iters 8 --lr 3e-3 --lr-warmup-iters 2 --lr-decay-style cosine --min-lr 3e-4"
    " --clip-grad 1.0 --log-interval 1 --eval-interval 1000 --eval-iters 1 --seed 7";

CommandOutcome pretrain(int ranks, const std::string& flags, const std::string& env = "") {
  return run_command(env + " " + MFSDP_RUN_BIN_PATH + " --nproc-per-node " + std::to_string(ranks) + " " +
                     MFSDP_PRETRAIN_BIN_PATH + kModel + flags);
}

struct Step {
  double loss, grad_norm, lr;
};
// Training records of a metrics file, by iteration.
std::map<int64_t, Step> steps_of(const std::string& metrics) {
  std::map<int64_t, Step> out;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("eval")) continue;
    out[j["iteration"].get<int64_t>()] = {j["lm_loss"].get<double>(), j["grad_norm"].get<double>(),
                                          j["lr"].get<double>()};
  }
  return out;
}

std::string read_file(const std::string& path) { return mfsdp::testing::slurp(path); }

// A resumed run's 4 iterations (metrics `resumed`) against the uninterrupted run's (`whole`):
// equal bit for bit when `exact`, else within fp32 rounding of sums in another order (1e-5).
void expect_resumed_like(const std::string& whole, const std::string& resumed, const std::string& name, bool exact) {
  auto a = steps_of(whole), b = steps_of(resumed);
  ASSERT_EQ(b.size(), 4u) << name;
  for (auto& [it, step] : b) {
    if (exact) {
      EXPECT_EQ(step.loss, a.at(it).loss) << name << " iteration " << it;
      EXPECT_EQ(step.grad_norm, a.at(it).grad_norm) << name << " iteration " << it;
    } else {
      EXPECT_NEAR(step.loss, a.at(it).loss, 1e-5 * a.at(it).loss) << name << " iteration " << it;
    }
  }
}

void expect_exact_resume(const std::string& strategy) {
  TempDir dir("mfsdp-resume");
  const std::string s = " --data-parallel-sharding-strategy " + strategy;
  CommandOutcome whole = pretrain(2, s + " --metrics-file " + dir.file("whole.jsonl"));
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  CommandOutcome first = pretrain(2, s + " --save " + dir.file("ckpt") + " --save-interval 2 --exit-interval 4" +
                                         " --metrics-file " + dir.file("first.jsonl"));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  EXPECT_NE(first.output.find("exiting at iteration 4"), std::string::npos) << first.output;
  EXPECT_EQ(read_file(dir.file("ckpt/latest_checkpointed_iteration.txt")), "4\n");
  CommandOutcome second = pretrain(2, s + " --load " + dir.file("ckpt") + " --save " + dir.file("ckpt") +
                                          " --metrics-file " + dir.file("second.jsonl"));
  ASSERT_EQ(second.exit_code, 0) << second.output;
  EXPECT_NE(second.output.find("loaded checkpoint"), std::string::npos) << second.output;

  auto a = steps_of(dir.file("whole.jsonl")), b1 = steps_of(dir.file("first.jsonl")),
       b2 = steps_of(dir.file("second.jsonl"));
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b1.size(), 4u);
  ASSERT_EQ(b2.size(), 4u) << "the resumed run must start at iteration 5";
  for (int64_t it = 1; it <= 8; ++it) {
    const Step& got = it <= 4 ? b1.at(it) : b2.at(it);
    // Bit for bit: fp32 on CPU, same data position, optimizer state and step.
    EXPECT_EQ(got.loss, a.at(it).loss) << strategy << " iteration " << it;
    EXPECT_EQ(got.grad_norm, a.at(it).grad_norm) << strategy << " iteration " << it;
    EXPECT_EQ(got.lr, a.at(it).lr) << strategy << " iteration " << it;
  }
  EXPECT_EQ(read_file(dir.file("ckpt/latest_checkpointed_iteration.txt")), "8\n");
}

}  // namespace

TEST(PretrainCheckpoint, ResumeIsBitExactUnderZero3) { expect_exact_resume("optim_grads_params"); }
TEST(PretrainCheckpoint, ResumeIsBitExactUnderNoShard) { expect_exact_resume("no_shard"); }

// --ckpt-format mfsdp still saves the earlier format; resuming from it (saving fsdp_dtensor) is
// bit exact. --dump-param-to-param-group-map writes Megatron's map (weight-decay group 0, 1-D 1).
TEST(PretrainCheckpoint, ResumesFromTheEarlierFormatAndDumpsTheGroupMap) {
  TempDir dir("mfsdp-format");
  CommandOutcome whole = pretrain(2, " --metrics-file " + dir.file("whole.jsonl"));
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  CommandOutcome first = pretrain(2, " --save " + dir.file("ckpt") + " --exit-interval 4 --ckpt-format mfsdp" +
                                         " --dump-param-to-param-group-map " + dir.file("map"));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  EXPECT_TRUE(fs::exists(dir.file("ckpt/iter_0000004/metadata.json")));
  EXPECT_TRUE(fs::exists(dir.file("ckpt/iter_0000004/rank_00001.safetensors")));
  CommandOutcome second = pretrain(2, " --load " + dir.file("ckpt") + " --save " + dir.file("ckpt") +
                                          " --metrics-file " + dir.file("second.jsonl"));
  ASSERT_EQ(second.exit_code, 0) << second.output;
  EXPECT_TRUE(fs::exists(dir.file("ckpt/iter_0000008/.metadata")));
  auto a = steps_of(dir.file("whole.jsonl")), b = steps_of(dir.file("second.jsonl"));
  ASSERT_EQ(b.size(), 4u);
  for (auto& [it, step] : b) EXPECT_EQ(step.loss, a.at(it).loss) << "iteration " << it;

  mfsdp::dcp::Reader map(dir.file("map"));
  EXPECT_EQ(map.read_object("module.module.model.layers.0.self_attn.q_proj.weight"), 0);
  EXPECT_EQ(map.read_object("module.module.model.embed_tokens.weight"), 0);
  EXPECT_EQ(map.read_object("module.module.model.layers.1.post_attention_layernorm.weight"), 1);
  EXPECT_EQ(map.read_object("module.module.model.norm.weight"), 1);
  EXPECT_EQ(map.metadata().bytes.size(), 2u * 9 + 2);  // 9 per layer, embedding, norm (tied head)
  CommandOutcome bad = pretrain(1, " --ckpt-format torch_dist --train-iters 1");
  EXPECT_NE(bad.exit_code, 0) << bad.output;
  EXPECT_NE(bad.output.find("--ckpt-format"), std::string::npos) << bad.output;
}

TEST(PretrainCheckpoint, ResumesOnOneRankWithAnotherStrategy) {
  TempDir dir("mfsdp-reshard");
  CommandOutcome whole = pretrain(2, " --metrics-file " + dir.file("whole.jsonl"));
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  CommandOutcome first = pretrain(2, " --save " + dir.file("ckpt") + " --exit-interval 4");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  CommandOutcome second = pretrain(1, " --load " + dir.file("ckpt") + " --data-parallel-sharding-strategy no_shard" +
                                          " --metrics-file " + dir.file("second.jsonl"));
  ASSERT_EQ(second.exit_code, 0) << second.output;
  EXPECT_NE(second.output.find("NOT restored (other world size)"), std::string::npos) << second.output;
  auto a = steps_of(dir.file("whole.jsonl")), b = steps_of(dir.file("second.jsonl"));
  ASSERT_EQ(b.size(), 4u);
  // Another world size sums in another order: equal up to fp32 rounding.
  for (auto& [it, step] : b) EXPECT_NEAR(step.loss, a.at(it).loss, 1e-5 * a.at(it).loss) << "iteration " << it;
}

// HSDP checkpoints: each element is written once (by one replica); a 2 x 2 HSDP job resumes bit
// for bit as 2 x 2, and its checkpoint loads into a plain 2-rank job (and that one's into 2 x 2)
// with the losses of the uninterrupted run. HFSDP (each rank writes its own sub-shards) resumes
// as HFSDP and reshards to and from a plain job the same way.
TEST(PretrainCheckpoint, HybridShardingResumesAndReshards) {
  TempDir dir("mfsdp-hsdp-ckpt");
  const std::string hsdp = " --num-distributed-optimizer-instances 2";
  CommandOutcome whole = pretrain(4, hsdp + " --metrics-file " + dir.file("whole.jsonl"));
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  CommandOutcome first = pretrain(4, hsdp + " --save " + dir.file("hsdp") + " --exit-interval 4");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  CommandOutcome plain_first = pretrain(2, " --save " + dir.file("plain") + " --exit-interval 4");
  ASSERT_EQ(plain_first.exit_code, 0) << plain_first.output;
  struct Resume {
    int ranks;
    std::string flags, from, name;
    bool exact;
  };
  const std::string hfsdp = hsdp + " --outer-dp-sharding-strategy optim";
  CommandOutcome hfsdp_first = pretrain(4, hfsdp + " --save " + dir.file("hfsdp") + " --exit-interval 4");
  ASSERT_EQ(hfsdp_first.exit_code, 0) << hfsdp_first.output;
  for (const Resume& r : {Resume{4, hsdp, "hsdp", "same", true}, Resume{2, "", "hsdp", "to_plain", false},
                          Resume{4, hsdp, "plain", "from_plain", false}, Resume{4, hfsdp, "hfsdp", "hfsdp_same", false},
                          Resume{2, "", "hfsdp", "hfsdp_to_plain", false}, Resume{4, hfsdp, "plain", "plain_to_hfsdp", false}}) {
    CommandOutcome second = pretrain(r.ranks, r.flags + " --load " + dir.file(r.from) + " --metrics-file " +
                                                  dir.file(r.name + ".jsonl"));
    ASSERT_EQ(second.exit_code, 0) << r.name << "\n" << second.output;
    expect_resumed_like(dir.file("whole.jsonl"), dir.file(r.name + ".jsonl"), r.name + "\n" + second.output, r.exact);
  }
}

// Tensor-parallel checkpoints hold whole tensors, each TP rank's FSDP shard of its slice written as
// boxes of them (Megatron-FSDP's DTensor layout). A TP 2 job resumes bit for bit; its checkpoint
// loads into a plain 2-rank job, a 1-rank checkpoint into TP 2 x DP 2 with sequence parallelism,
// and an asynchronous save of TP 2 x HSDP 2 (two replicas of each slice, each writing half) into
// one rank, each with the losses of the uninterrupted run. PyTorch's DCP reads the TP checkpoints into whole tensors equal to one process's (weights
// and AdamW moments after 4 steps, up to fp32 rounding).
TEST(PretrainCheckpoint, TensorParallelResumesAndReshards) {
  TempDir dir("mfsdp-tp-ckpt");
  // TP 1 and 2 pad the vocabulary alike (a multiple of 32 x TP), so the checkpoints' shapes agree.
  // AdamW eps 1e-3 in every run: TP sums in another order, and with eps 1e-8 Adam turns a nearly
  // cancelling gradient element into a step of up to lr either way (tests/dist/parallel_llama_test.cpp).
  const std::string vocab = " --make-vocab-size-divisible-by 32 --adam-eps 1e-3",
                    tp = vocab + " --tensor-model-parallel-size 2";
  auto run = [&](int ranks, const std::string& flags) {
    CommandOutcome r = pretrain(ranks, flags);
    EXPECT_EQ(r.exit_code, 0) << flags << "\n" << r.output;
    return r.exit_code == 0;
  };
  ASSERT_TRUE(run(2, tp + " --metrics-file " + dir.file("whole.jsonl")));
  ASSERT_TRUE(run(2, tp + " --save " + dir.file("tp") + " --exit-interval 4"));
  ASSERT_TRUE(run(1, vocab + " --save " + dir.file("one") + " --exit-interval 4"));
  ASSERT_TRUE(run(4, tp + " --sequence-parallel --num-distributed-optimizer-instances 2 --async-save --save " +
                         dir.file("tp_dp") + " --exit-interval 4"));
  struct Resume {
    int ranks;
    std::string flags, from, name;
    bool exact;
  };
  for (const Resume& r : {Resume{2, tp, "tp", "same", true}, Resume{2, vocab, "tp", "to_plain", false},
                          Resume{4, tp + " --sequence-parallel", "one", "from_one", false},
                          Resume{1, vocab, "tp_dp", "async_to_one", false}}) {
    ASSERT_TRUE(run(r.ranks, r.flags + " --load " + dir.file(r.from) + " --metrics-file " + dir.file(r.name + ".jsonl")))
        << r.name;
    expect_resumed_like(dir.file("whole.jsonl"), dir.file(r.name + ".jsonl"), r.name, r.exact);
  }
  // PyTorch reads each TP checkpoint whole (dcp_to_torch_save assembles every tensor from its
  // chunks) and compares it with the 1-rank checkpoint: same keys and shapes, values within 1e-4
  // of each tensor's largest magnitude (fp32 sums in another order after 4 AdamW steps: ~1e-5; a
  // slice written to the wrong place is off by the tensor's own size).
  const std::string script =
      "import sys, torch\n"
      "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
      "def tensors(path, out):\n"
      "    dcp_to_torch_save(path, out)\n"
      "    flat = {}\n"
      "    def walk(prefix, v):\n"
      "        if isinstance(v, dict):\n"
      "            for k, x in v.items(): walk(prefix + '/' + str(k), x)\n"
      "        elif torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0 and 'rng' not in prefix:\n"
      "            flat[prefix] = v\n"
      "    walk('', torch.load(out, weights_only=False))\n"
      "    return flat\n"
      "ref = tensors(sys.argv[1], sys.argv[1] + '.pt')\n"
      "for path in sys.argv[2:]:\n"
      "    got = tensors(path, path + '.pt')\n"
      "    assert sorted(got) == sorted(ref), (path, sorted(set(got) ^ set(ref))[:5])\n"
      "    assert all(got[k].shape == ref[k].shape for k in ref), path\n"
      "    worst, key = max((((got[k] - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-12)).item(), k) for k in ref)\n"
      "    print(path, len(ref), 'tensors, worst relative difference', worst, 'in', key)\n"
      "    assert worst < 1e-4, (path, worst)\n";
  std::ofstream(dir.file("compare.py")) << script;
  CommandOutcome compare = run_command(std::string(MFSDP_PYTHON_PATH) + " " + dir.file("compare.py") + " " +
                                       dir.file("one/iter_0000004") + " " + dir.file("tp/iter_0000004") + " " +
                                       dir.file("tp_dp/iter_0000004") + " 2>&1");
  EXPECT_EQ(compare.exit_code, 0) << compare.output;
  EXPECT_NE(compare.output.find("tp_dp/iter_0000004"), std::string::npos) << compare.output;

  // The earlier format cannot hold a slice: refused before training, naming the flag.
  CommandOutcome legacy = pretrain(2, tp + " --save " + dir.file("legacy") + " --ckpt-format mfsdp");
  EXPECT_EQ(legacy.exit_code, 2) << legacy.output;
  EXPECT_NE(legacy.output.find("--ckpt-format: mfsdp stores 1-D element ranges"), std::string::npos) << legacy.output;
}

TEST(PretrainCheckpoint, FinetuneAndResumeRulesNameTheFlag) {
  TempDir dir("mfsdp-rules");
  const std::string ckpt = dir.file("ckpt");
  ASSERT_EQ(pretrain(1, " --save " + ckpt + " --exit-interval 4").exit_code, 0);

  CommandOutcome finetune = pretrain(1, " --load " + ckpt + " --finetune --metrics-file " + dir.file("ft.jsonl"));
  ASSERT_EQ(finetune.exit_code, 0) << finetune.output;
  EXPECT_NE(finetune.output.find("weights only (--finetune)"), std::string::npos) << finetune.output;
  EXPECT_EQ(steps_of(dir.file("ft.jsonl")).size(), 8u) << "--finetune starts at iteration 1";

  struct Case {
    std::string flags, expected;
    int exit_code;
  };
  const Case cases[] = {
      {" --load " + ckpt + " --hidden-size 64", "model_config.hidden_size is 32, this run has 64 (--hidden-size)", 1},
      {" --load " + ckpt + " --lr 1e-3", "scheduler.max_lr", 1},
      {" --load " + ckpt + " --lr 1e-3", "--override-opt_param-scheduler", 1},
      {" --load " + ckpt + " --global-batch-size 16", "--global-batch-size", 1},
      {" --load " + ckpt + " --optimizer sgd", "holds AdamW state, the run uses SGD", 1},
      {" --finetune", "--finetune: needs --load", 2},
      {" --save-interval 2", "--save-interval: needs --save", 2},
  };
  for (const Case& c : cases) {
    CommandOutcome r = pretrain(1, c.flags);
    EXPECT_EQ(r.exit_code, c.exit_code) << c.flags << "\n" << r.output;
    EXPECT_NE(r.output.find(c.expected), std::string::npos) << c.flags << "\n" << r.output;
  }
  // This run's schedule wins when asked; the checkpoint's likewise.
  EXPECT_EQ(pretrain(1, " --load " + ckpt + " --lr 1e-3 --override-opt_param-scheduler").exit_code, 0);
  EXPECT_EQ(pretrain(1, " --load " + ckpt + " --lr 1e-3 --use-checkpoint-opt_param-scheduler").exit_code, 0);
  // A folder with nothing saved yet: start from scratch, as Megatron does.
  CommandOutcome empty = pretrain(1, " --load " + dir.file("nothing_here"));
  EXPECT_EQ(empty.exit_code, 0) << empty.output;
  EXPECT_NE(empty.output.find("does not exist; training starts from scratch"), std::string::npos) << empty.output;
}
