// The model Megatron's flags describe: --swiglu and --ffn-hidden-size mean what they mean in
// Megatron-LM, checked against Megatron's own numbers, not against mfsdp's code:
//   - the MLP width without --ffn-hidden-size (megatron/training/arguments.py): 4 x hidden, or
//     with --swiglu int(4 x hidden x 2/3 / 64) x 64 (known values below, worked by hand);
//   - the parameter count (megatron/training/theoretical_memory_usage.py,
//     compute_weight_and_optimizer_memory): that formula counts LayerNorms, weight and bias, so
//     the RMSNorms here (weight only) have half its norm terms; the rest is its formula as it is.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "mfsdp/models/llama.h"
#include "mfsdp/models/llama_hf_config.h"
#include "mfsdp/train/pretrain_args.h"
#include "mfsdp/train/training_run.h"

namespace {

mfsdp::PretrainArgs args_from(std::vector<std::string> extra) {
  std::vector<std::string> argv = {"mfsdp-pretrain", "--num-layers", "3", "--num-attention-heads", "4",
                                   "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "1",
                                   "--mock-data", "--vocab-size", "1000", "--make-vocab-size-divisible-by", "128"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  mfsdp::PretrainArgs a = mfsdp::parse_pretrain_args(argv);
  mfsdp::validate_training_args(a, /*dp=*/1, /*tokenizer_vocab=*/0);
  return a;
}

int64_t ffn_of(int64_t hidden, bool swiglu) {
  std::vector<std::string> flags = {"--hidden-size", std::to_string(hidden)};
  if (swiglu) flags.push_back("--swiglu");
  return args_from(flags).ffn_hidden_size;
}

// Megatron's compute_weight_and_optimizer_memory, less the LayerNorm biases RMSNorm lacks.
double megatron_parameter_count(const mfsdp::PretrainArgs& a) {
  const double h = static_cast<double>(a.hidden_size), layers = static_cast<double>(a.num_layers);
  const double query_projection_to_hidden = (h / a.num_attention_heads) * a.num_attention_heads / h;
  const double gated_linear_multiplier = a.swiglu ? 3.0 / 2.0 : 1.0;
  const double transformer = 2 * layers * h * h *
                             ((1 + static_cast<double>(a.num_query_groups) / a.num_attention_heads) *
                                  query_projection_to_hidden +
                              (static_cast<double>(a.ffn_hidden_size) / h) * gated_linear_multiplier +
                              2 / h + 1 / (layers * h));
  const double layernorm_biases = 2 * layers * h + h;  // two per layer and the final one
  const double embedding = h * static_cast<double>(a.padded_vocab_size);
  return transformer - layernorm_biases + (a.untie_embeddings_and_output_weights ? 2 : 1) * embedding;
}

int64_t built_parameter_count(const mfsdp::PretrainArgs& a) {
  mfsdp::LlamaOptions options;
  options.deferred_init = true;  // full shapes, no storage
  options.init_seed = 0;
  mfsdp::LlamaForCausalLM model(mfsdp::llama_config_of(mfsdp::model_config_from_args(a, a, a.seq_length, a.padded_vocab_size)), options);
  int64_t n = 0;
  for (const auto& p : model->parameters()) n += p.numel();
  return n;
}

TEST(MegatronModelFlags, MlpWidthWithoutFfnHiddenSizeIsMegatrons) {
  EXPECT_EQ(ffn_of(4096, /*swiglu=*/false), 16384);
  EXPECT_EQ(ffn_of(4096, /*swiglu=*/true), 10880);   // 10922.67 / 64 = 170.67 -> 170 x 64
  EXPECT_EQ(ffn_of(5120, /*swiglu=*/true), 13632);   // 13653.33 / 64 = 213.33 -> 213 x 64
  EXPECT_EQ(ffn_of(128, /*swiglu=*/true), 320);      // 341.33 / 64 = 5.33 -> 5 x 64
  EXPECT_EQ(ffn_of(48, /*swiglu=*/true), 128);       // 128 / 64 = 2 exactly
  EXPECT_EQ(args_from({"--hidden-size", "64", "--swiglu", "--ffn-hidden-size", "100"}).ffn_hidden_size, 100);
  try {
    ffn_of(32, /*swiglu=*/true);  // 85.33 / 64 -> 64; 16 gives 0
    ffn_of(16, /*swiglu=*/true);
    FAIL() << "a SwiGLU hidden size of 16 has no Megatron default width";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("--ffn-hidden-size"), std::string::npos) << e.what();
  }
}

TEST(MegatronModelFlags, ParameterCountIsMegatronsFormula) {
  const std::vector<std::vector<std::string>> cases = {
      {"--hidden-size", "64"},
      {"--hidden-size", "64", "--swiglu"},
      {"--hidden-size", "64", "--swiglu", "--untie-embeddings-and-output-weights"},
      {"--hidden-size", "128", "--group-query-attention", "--num-query-groups", "2"},
      {"--hidden-size", "128", "--swiglu", "--group-query-attention", "--num-query-groups", "1", "--ffn-hidden-size",
       "200", "--untie-embeddings-and-output-weights"},
  };
  for (const auto& flags : cases) {
    const mfsdp::PretrainArgs a = args_from(flags);
    std::string shown;
    for (const auto& f : flags) shown += f + " ";
    EXPECT_EQ(static_cast<double>(built_parameter_count(a)), megatron_parameter_count(a)) << shown;
  }
}

// The size flags that reach the model through its config.json (the MoE sizes, the head width)
// are bounded where the model's reader bounds them: the largest value the flags take makes a
// model config the reader accepts, and a larger one is refused by the flags, naming the flag
// (not the config.json field).
TEST(MegatronModelFlags, SizeBoundsAreTheModelsAndNameTheFlag) {
  const std::vector<std::string> moe = {"--hidden-size", "64", "--swiglu", "--num-experts", "4",
                                        "--moe-router-topk", "2"};
  const std::vector<std::string> dense = {"--hidden-size", "64"};
  struct Case {
    std::vector<std::string> base;
    std::string flag;
    int64_t most;
  };
  const std::vector<Case> cases = {
      {{"--hidden-size", "64", "--swiglu", "--moe-router-topk", "2"}, "--num-experts", 4096},
      {moe, "--moe-ffn-hidden-size", int64_t{1} << 20},
      {moe, "--moe-shared-expert-intermediate-size", int64_t{1} << 20},
      {dense, "--kv-channels", int64_t{1} << 17},
      {{"--hidden-size", "64", "--kv-channels", "2"}, "--num-attention-heads", 64},
  };
  for (const Case& c : cases) {
    std::vector<std::string> flags = c.base;
    flags.insert(flags.end(), {c.flag, std::to_string(c.most)});
    const mfsdp::PretrainArgs a = args_from(flags);
    EXPECT_NO_THROW(mfsdp::llama_config_of(mfsdp::model_config_from_args(a, a, a.seq_length, a.padded_vocab_size))) << c.flag << " " << c.most;
    flags.back() = std::to_string(c.most + 2);  // still even, as --kv-channels must be
    try {
      args_from(flags);
      ADD_FAILURE() << c.flag << " " << c.most + 2 << " was taken";
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()).rfind(c.flag + ": must be at most", 0), 0u) << e.what();
    }
  }
}

// Without --swiglu the MLP is Megatron's: down_proj(gelu(up_proj(x))), the erf GeLU, no gate.
TEST(MegatronModelFlags, WithoutSwigluTheMlpIsGelu) {
  const mfsdp::PretrainArgs a = args_from({"--hidden-size", "64"});
  mfsdp::LlamaConfig c = mfsdp::llama_config_of(mfsdp::model_config_from_args(a, a, a.seq_length, a.padded_vocab_size));
  EXPECT_FALSE(c.swiglu);
  torch::manual_seed(3);
  mfsdp::LlamaMLP mlp(c, /*deferred=*/false);
  for (auto& p : mlp->parameters()) p.data().normal_(0, 0.1);
  EXPECT_FALSE(mlp->gate_proj);
  at::Tensor x = at::randn({2, 5, 64});
  at::Tensor up = at::matmul(x, mlp->up_proj->weight.t());
  at::Tensor gelu = 0.5 * up * (1 + at::erf(up / std::sqrt(2.0)));
  at::Tensor expected = at::matmul(gelu, mlp->down_proj->weight.t());
  EXPECT_TRUE(at::allclose(mlp(x), expected, 1e-5, 1e-6));
}

}  // namespace
