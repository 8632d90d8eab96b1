// The trainers' configuration sections (src/train/config/sections.h): each section's own checks
// name the flag, its defaults derive as Megatron's do (values worked by hand), and each tool
// takes and lists exactly its sections.
#include <gtest/gtest.h>

#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "harness/expect_error.h"
#include "train/grpo.h"
#include "train/pretrain_args.h"
#include "train/sft.h"

namespace {

using mfsdp::testing::error_of;

std::vector<std::string> argv_of(std::initializer_list<std::string> flags) {
  std::vector<std::string> out = {"tool"};
  out.insert(out.end(), flags.begin(), flags.end());
  return out;
}

// The flag names of a --help text, in order, with the section heading each falls under.
std::vector<std::pair<std::string, std::string>> flags_by_heading(const std::string& usage) {
  std::vector<std::pair<std::string, std::string>> out;
  std::string heading;
  std::istringstream in(usage);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line.back() == ':' && line[0] != ' ') heading = line.substr(0, line.size() - 1);
    if (line.rfind("  --", 0) == 0) out.emplace_back(heading, line.substr(2, line.find(' ', 2) - 2));
  }
  return out;
}

TEST(ConfigSections, EachSectionChecksItsOwnValuesNamingTheFlag) {
  mfsdp::ModelSection model;
  model.num_attention_heads = 5;
  EXPECT_NE(error_of([&] { model.validate(); }).find("--hidden-size: 64 is not divisible by --num-attention-heads 5"),
            std::string::npos);
  mfsdp::DataSection data;
  data.seq_length = 0;
  EXPECT_NE(error_of([&] { data.validate(); }).find("--seq-length: must be >= 1"), std::string::npos);
  mfsdp::TrainingSection training;
  training.seed = -1;
  EXPECT_NE(error_of([&] { training.validate(); }).find("--seed"), std::string::npos);
  mfsdp::OptimizerSection optimizer;
  optimizer.lr = 1e-5;
  optimizer.min_lr = 1e-4;
  EXPECT_NE(error_of([&] { optimizer.validate(); }).find("--min-lr: is larger than --lr"), std::string::npos);
  mfsdp::CheckpointSection checkpoint;
  checkpoint.finetune = true;
  EXPECT_NE(error_of([&] { checkpoint.validate(); }).find("--finetune: needs --load"), std::string::npos);
  mfsdp::FsdpSection fsdp;
  fsdp.fsdp_double_buffer = fsdp.fsdp_trace_pool = true;
  EXPECT_NE(error_of([&] { fsdp.validate(); }).find("--fsdp-trace-pool"), std::string::npos);
  mfsdp::RuntimeSection runtime;
  runtime.distributed_timeout_minutes = 0;
  EXPECT_NE(error_of([&] { runtime.validate(); }).find("--distributed-timeout-minutes"), std::string::npos);
  mfsdp::LoggingSection logging;
  logging.eval_interval = 0;
  EXPECT_NE(error_of([&] { logging.validate(); }).find("--eval-interval: must be >= 1"), std::string::npos);
  mfsdp::ProfilingSection profiling;
  profiling.use_pytorch_profiler = true;
  EXPECT_NE(error_of([&] { profiling.validate(); }).find("--use-pytorch-profiler: needs --profile"), std::string::npos);
  mfsdp::PretrainingSection pretraining;
  pretraining.simulate_rank = 1;
  EXPECT_NE(error_of([&] { pretraining.validate(); }).find("--simulate-rank: needs --simulate-world-size"),
            std::string::npos);
}

TEST(ConfigSections, ModelDefaultsDeriveAsMegatronsDo) {
  mfsdp::ModelSection m;
  m.hidden_size = 4096;
  m.num_attention_heads = 32;
  m.num_query_groups = 8;  // ignored without --group-query-attention
  m.swiglu = true;
  m.recompute_granularity = "full";
  m.validate();
  EXPECT_EQ(m.num_query_groups, 32);
  EXPECT_EQ(m.ffn_hidden_size, 10880);  // int(4 x 4096 x 2/3 / 64) x 64 = int(170.67) x 64
  EXPECT_TRUE(m.recompute_activations);
  mfsdp::ModelSection gelu;
  gelu.hidden_size = 96;
  gelu.num_attention_heads = 4;
  gelu.validate();
  EXPECT_EQ(gelu.ffn_hidden_size, 384);  // 4 x hidden without --swiglu
}

TEST(ConfigSections, PretrainHelpListsEveryFlagOnceUnderItsSection) {
  const auto flags = flags_by_heading(mfsdp::pretrain_usage());
  std::vector<std::string> headings;
  std::set<std::string> names;
  for (const auto& [heading, name] : flags) {
    if (headings.empty() || headings.back() != heading) headings.push_back(heading);
    EXPECT_TRUE(names.insert(name).second) << name << " listed twice";
  }
  std::vector<std::string> want;
  for (mfsdp::Section s : mfsdp::all_sections()) want.push_back(mfsdp::section_title(s));
  EXPECT_EQ(headings, want);  // every section, in order, each flag under one heading
  auto heading_of = [&](const std::string& flag) {
    for (const auto& [heading, name] : flags)
      if (name == flag) return heading;
    return std::string("(none)");
  };
  EXPECT_EQ(heading_of("--lr"), mfsdp::section_title(mfsdp::Section::kOptimizer));
  EXPECT_EQ(heading_of("--data-path"), mfsdp::section_title(mfsdp::Section::kData));
  EXPECT_EQ(heading_of("--save"), mfsdp::section_title(mfsdp::Section::kCheckpoint));
  EXPECT_EQ(heading_of("--memory-plan"), mfsdp::section_title(mfsdp::Section::kPretraining));
  // Every flag the parser takes is listed, and no other.
  for (const auto& [heading, name] : flags) {
    const std::string err = error_of([&] { mfsdp::parse_pretrain_args(argv_of({name, "1"})); });
    EXPECT_NE(err.rfind(name + ": unknown flag", 0), 0u) << err;
  }
}

TEST(ConfigSections, SftAndGrpoTakeTheirSectionsOnly) {
  mfsdp::SftArgs sft;
  const mfsdp::ToolFlags sft_flags = mfsdp::sft_tool_flags(sft);
  const std::string sft_help = mfsdp::pretrain_usage(sft_flags);
  EXPECT_EQ(sft_help.find(mfsdp::section_title(mfsdp::Section::kData)), std::string::npos);
  EXPECT_EQ(sft_help.find(mfsdp::section_title(mfsdp::Section::kPretraining)), std::string::npos);
  EXPECT_NE(sft_help.find("SFT: the conversations and the loss:\n"), std::string::npos);
  for (const char* not_sft : {"--data-path", "--seq-length", "--vocab-size", "--sample-prompt", "--memory-plan"}) {
    EXPECT_EQ(sft_help.find(std::string("  ") + not_sft + " "), std::string::npos) << not_sft;
    EXPECT_EQ(error_of([&] { mfsdp::parse_pretrain_args(argv_of({not_sft, "1"}), sft_flags); })
                  .rfind(std::string(not_sft) + ": unknown flag", 0),
              0u)
        << not_sft;
  }
  EXPECT_NE(sft_help.find("  --global-batch-size VALUE"), std::string::npos);
  EXPECT_NE(sft_help.find("  --max-length VALUE"), std::string::npos);

  mfsdp::GrpoArgs grpo;
  const mfsdp::ToolFlags grpo_flags = mfsdp::grpo_tool_flags(grpo);
  const std::string grpo_help = mfsdp::pretrain_usage(grpo_flags);
  EXPECT_EQ(grpo_help.find("--global-batch-size"), std::string::npos);
  EXPECT_NE(grpo_help.find("  --micro-batch-size VALUE"), std::string::npos);
  const std::string replaced =
      error_of([&] { mfsdp::parse_pretrain_args(argv_of({"--global-batch-size", "8"}), grpo_flags); });
  EXPECT_NE(replaced.find("--global-batch-size: mfsdp-grpo does not take it: a step trains on --train-batch-size "
                          "prompts x --rollout-n responses"),
            std::string::npos)
      << replaced;
}

}  // namespace
