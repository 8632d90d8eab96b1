// The trainers' configuration sections (include/mfsdp/train/config/sections.h): each section's own checks
// name the flag, its defaults derive as Megatron's do (values worked by hand), and each tool
// takes and lists exactly its sections.
#include <gtest/gtest.h>

#include <functional>
#include <set>
#include <stdexcept>
#include <sstream>
#include <string>
#include <vector>

#include "harness/expect_error.h"
#include "mfsdp/train/grpo.h"
#include "mfsdp/train/pretrain_args.h"
#include "mfsdp/train/sft.h"

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

// What the model would refuse only once it is built (the MoE layers are SwiGLU MLPs, a list of
// layers is one 0/1 per layer with at least one MoE layer) and what LibTorch would fail on at the
// first step (a capacity past int64) are refused by the section, naming the flag.
TEST(ConfigSections, MoeChecksNameTheFlag) {
  mfsdp::ModelSection model;
  model.num_layers = 2;
  model.swiglu = true;
  auto error = [&](std::function<void(mfsdp::MoeSection&)> set) {
    mfsdp::MoeSection moe;
    moe.num_experts = 4;
    set(moe);
    return error_of([&] { moe.validate(model); });
  };
  EXPECT_EQ(error([](mfsdp::MoeSection&) {}), "<no exception>");
  EXPECT_EQ(error([](mfsdp::MoeSection& m) { m.moe_layer_freq = "[1,0]"; }), "<no exception>");
  // Twice experts / top-k, which already keeps every token: at most --num-experts, so taken.
  EXPECT_EQ(error([](mfsdp::MoeSection& m) { m.moe_expert_capacity_factor = 4; }), "<no exception>");
  EXPECT_NE(error([](mfsdp::MoeSection& m) { m.moe_expert_capacity_factor = 1e300; })
                .find("--moe-expert-capacity-factor: must be at most --num-experts 4"),
            std::string::npos);
  EXPECT_NE(error([](mfsdp::MoeSection& m) { m.moe_layer_freq = "[0,0]"; })
                .find("--moe-layer-freq: [0,0] makes no layer an MoE layer"),
            std::string::npos);
  EXPECT_NE(error([](mfsdp::MoeSection& m) { m.moe_layer_freq = "[1]"; })
                .find("--moe-layer-freq: lists 1 layers, --num-layers is 2"),
            std::string::npos);
  EXPECT_NE(error([](mfsdp::MoeSection& m) { m.moe_layer_freq = "[]"; }).find("--moe-layer-freq: lists 0 layers"),
            std::string::npos);
  EXPECT_NE(error([](mfsdp::MoeSection& m) { m.num_experts = 4097; }).find("--num-experts: must be at most 4096"),
            std::string::npos);
  EXPECT_NE(error([](mfsdp::MoeSection& m) { m.moe_ffn_hidden_size = int64_t{1} << 40; })
                .find("--moe-ffn-hidden-size: must be at most 1048576"),
            std::string::npos);
  EXPECT_NE(error([](mfsdp::MoeSection& m) { m.moe_shared_expert_intermediate_size = int64_t{1} << 40; })
                .find("--moe-shared-expert-intermediate-size: must be at most 1048576"),
            std::string::npos);
  // Without --num-experts, the syntax of --moe-layer-freq and a capacity any model here can take.
  EXPECT_NE(error([](mfsdp::MoeSection& m) {
                  m.num_experts = 0;
                  m.moe_layer_freq = "";
                })
                .find("--moe-layer-freq: expected a positive integer"),
            std::string::npos);
  EXPECT_NE(error([](mfsdp::MoeSection& m) {
                  m.num_experts = 0;
                  m.moe_expert_capacity_factor = 1e18;
                })
                .find("--moe-expert-capacity-factor: must be at most 4096"),
            std::string::npos);
  model.swiglu = false;
  EXPECT_NE(error([](mfsdp::MoeSection&) {}).find("--num-experts: needs --swiglu"), std::string::npos);
}

// Megatron's --split weights: numbers separated by commas (or slashes, or spaces), nothing else;
// Megatron's own regex would read "-2147483649" as 2147483649.
// Megatron evaluates --moe-layer-freq as Python: the values Python gives for these expressions.
TEST(ConfigSections, MoeLayerFreqReadsMegatronsListExpressions) {
  auto pattern = [](const std::string& text) {
    mfsdp::MoeSection moe;
    moe.moe_layer_freq = text;
    return moe.moe_layer_pattern();
  };
  std::vector<int64_t> deepseek(3, 0);
  deepseek.resize(61, 1);
  EXPECT_EQ(pattern("([0]*3+[1]*58)"), deepseek);
  EXPECT_EQ(pattern("[0]*3 + 58*[1]"), deepseek);
  EXPECT_EQ(pattern("[1,0]*2"), (std::vector<int64_t>{1, 0, 1, 0}));
  EXPECT_EQ(pattern("([1] + [0, 0])*2"), (std::vector<int64_t>{1, 0, 0, 1, 0, 0}));
  EXPECT_EQ(pattern("[1, 0]"), (std::vector<int64_t>{1, 0}));
  EXPECT_EQ(pattern("[]*3"), (std::vector<int64_t>{}));
  EXPECT_EQ(pattern("4"), (std::vector<int64_t>{4}));
  for (const auto& [text, message] : std::vector<std::pair<std::string, std::string>>{
           {"([0]*3+[1]*58", "--moe-layer-freq: cannot read '([0]*3+[1]*58': expected ')'"},
           {"[0]*", "--moe-layer-freq: cannot read '[0]*': expected a count"},
           {"[0,2]*3", "--moe-layer-freq: a list holds 0 (dense) or 1 (MoE) per layer, found '2'"},
           {"[1]-[0]", "--moe-layer-freq: cannot read '[1]-[0]': unexpected '-[0]'"},
           {"[1]*99999999*99999999", "--moe-layer-freq: cannot read '[1]*99999999*99999999': lists more than 2^20 layers"},
       })
    EXPECT_NE(error_of([&] { pattern(text); }).find(message), std::string::npos) << text << ": " << error_of([&] { pattern(text); });
}

TEST(ConfigSections, SplitTakesNonNegativeWeightsOnly) {
  for (const char* good : {"969,30,1", "99,1", "0.9 0.1 0", "90/5/5", "1"}) {
    mfsdp::DataSection data;
    data.split = good;
    EXPECT_EQ(error_of([&] { data.validate(); }), "<no exception>") << good;
  }
  for (const auto& [bad, expected] : std::vector<std::pair<std::string, std::string>>{
           {"-2147483649", "--split: '-2147483649': '-' is not part of a weight"},
           {"1,-1", "'-' is not part of a weight"},
           {"1e3,1", "'e' is not part of a weight"},
           {"abc", "--split"},
           {"0,0,0", "must not all be 0"},
           {"1,1,1,1", "expected one to three weights"},
           {std::string(400, '9'), "is not a number"}}) {
    mfsdp::DataSection data;
    data.split = bad;
    EXPECT_NE(error_of([&] { data.validate(); }).find(expected), std::string::npos) << bad;
  }
}

// A section's flags write that section: the value as parsed, shown back as --help shows it.
TEST(ConfigSections, EachSectionsFlagsWriteItsOwnFields) {
  auto find = [](std::vector<mfsdp::ToolFlag>& flags, const std::string& name) -> mfsdp::ToolFlag& {
    for (auto& f : flags)
      if (f.name == name) return f;
    throw std::runtime_error(name + " not declared");
  };
  mfsdp::OptimizerSection optimizer;
  std::vector<mfsdp::ToolFlag> flags = optimizer.flags();
  EXPECT_EQ(find(flags, "--lr").show(), "0.0001");
  find(flags, "--lr").set("0.5");
  find(flags, "--lr-decay-style").set("cosine");
  EXPECT_EQ(optimizer.lr, 0.5);
  EXPECT_EQ(optimizer.lr_decay_style, "cosine");
  EXPECT_EQ(find(flags, "--lr-decay-style").choices, (std::vector<std::string>{"constant", "linear", "cosine"}));
  EXPECT_NE(error_of([&] { find(flags, "--adam-eps").set("1e-8x"); }).find("--adam-eps: expected a finite number"),
            std::string::npos);

  mfsdp::TrainingSection training;
  flags = training.flags();
  mfsdp::ToolFlag& no_check = find(flags, "--no-check-for-nan-in-loss-and-grad");
  EXPECT_FALSE(no_check.takes_value);
  EXPECT_EQ(no_check.show(), "off");
  no_check.set("");
  EXPECT_FALSE(training.check_for_nan_in_loss_and_grad);
  EXPECT_EQ(no_check.show(), "on");
  EXPECT_EQ(find(flags, "--check-for-nan-in-loss-and-grad").show(), "off");

  mfsdp::ProfilingSection profiling;
  flags = profiling.flags();
  mfsdp::ToolFlag& ranks = find(flags, "--profile-ranks");
  EXPECT_TRUE(ranks.many_values);
  ranks.set("0 2 5");
  EXPECT_EQ(profiling.profile_ranks, (std::vector<int64_t>{0, 2, 5}));
  EXPECT_EQ(ranks.show(), "0 2 5");
  EXPECT_THROW(find(flags, "--lr"), std::runtime_error);  // not the profiling section's
}

TEST(ConfigSections, ModelDefaultsDeriveAsMegatronsDo) {
  mfsdp::ModelSection m;
  m.hidden_size = 4096;
  m.num_attention_heads = 32;
  m.num_query_groups = 8;  // ignored without --group-query-attention
  m.swiglu = true;
  m.recompute_activations = true;  // Megatron's: --recompute-granularity selective, core_attn
  m.validate();
  EXPECT_EQ(m.num_query_groups, 32);
  EXPECT_EQ(m.ffn_hidden_size, 10880);  // int(4 x 4096 x 2/3 / 64) x 64 = int(170.67) x 64
  EXPECT_EQ(m.recompute_granularity, "selective");
  EXPECT_EQ(m.recompute_modules, (std::vector<std::string>{"core_attn"}));
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
