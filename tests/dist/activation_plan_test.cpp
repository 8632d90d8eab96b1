// The activation plan (mfsdp/train/activation_plan.h) against what a forward keeps: a counting
// CPU allocator measures the bytes a Llama's decoder layers leave allocated after a training
// forward (4 layers minus 2 layers, so the embedding and final norm cancel), under no recompute,
// each selective module, their combination and full recompute (uniform and block), for shapes
// the formula was not fitted on (grouped-query, explicit head width, uneven MLP). A term dropped
// or miscounted in the formula misses by whole rows per token, far more than rounding.
#include "mfsdp/train/activation_plan.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

#include "harness/counting_allocator.h"
#include "mfsdp/models/llama.h"

namespace {

using mfsdp::RecomputeOptions;

struct Shape {
  int64_t hidden, ffn, heads, kv_heads, head_dim;  // head_dim 0: hidden / heads
};

int64_t kept_bytes(const Shape& s, int64_t layers, int64_t batch, int64_t seq, const RecomputeOptions& recompute) {
  mfsdp::LlamaConfig c;
  c.vocab_size = 64;
  c.hidden_size = s.hidden;
  c.intermediate_size = s.ffn;
  c.num_layers = layers;
  c.num_attention_heads = s.heads;
  c.num_key_value_heads = s.kv_heads;
  c.explicit_head_dim = s.head_dim;
  c.max_position_embeddings = seq;
  mfsdp::LlamaOptions o;
  o.init_seed = 3;
  o.recompute = recompute;
  mfsdp::LlamaForCausalLM model(c, o);
  const at::Tensor ids = at::randint(c.vocab_size, {batch, seq}, at::make_generator<at::CPUGeneratorImpl>(5));
  auto& counter = mfsdp::testing::counting_allocator();
  const int64_t before = counter.live.load();
  const at::Tensor hidden = model->model->forward(ids);
  return counter.live.load() - before;
}


TEST(ActivationPlan, EqualsWhatTheLayersKeep) {
  const std::vector<std::pair<std::string, RecomputeOptions>> modes = {
      {"none", {}},
      {"core_attn", RecomputeOptions::selective({"core_attn"})},
      {"layernorm", RecomputeOptions::selective({"layernorm"})},
      {"mlp", RecomputeOptions::selective({"mlp"})},
      {"core_attn layernorm mlp", RecomputeOptions::selective({"core_attn", "layernorm", "mlp"})},
      {"full uniform 1", RecomputeOptions::full_layers(RecomputeOptions::Method::kUniform, 1)},
      {"full uniform 2", RecomputeOptions::full_layers(RecomputeOptions::Method::kUniform, 2)},
      {"full block 1", RecomputeOptions::full_layers(RecomputeOptions::Method::kBlock, 1)}};
  for (const Shape& s : {Shape{48, 80, 6, 3, 0}, Shape{40, 72, 4, 1, 12}, Shape{64, 64, 8, 8, 0}}) {
    mfsdp::LayerActivationShape shape;
    shape.hidden = s.hidden;
    shape.ffn = s.ffn;
    shape.heads = s.heads;
    shape.kv_heads = s.kv_heads;
    shape.head_dim = s.head_dim > 0 ? s.head_dim : s.hidden / s.heads;
    const int64_t batch = 2, seq = 20;
    for (const auto& [name, recompute] : modes) {
      SCOPED_TRACE("hidden " + std::to_string(s.hidden) + ", " + name);
      const int64_t measured = kept_bytes(s, 4, batch, seq, recompute) - kept_bytes(s, 2, batch, seq, recompute);
      const int64_t planned = mfsdp::plan_activations(shape, 4, batch * seq, 4, recompute).kept_bytes -
                              mfsdp::plan_activations(shape, 2, batch * seq, 4, recompute).kept_bytes;
      EXPECT_EQ(planned, measured);
    }
  }
}

TEST(ActivationPlan, RecomputeKeepsLessAndHoldsOneCheckpointAgain) {
  mfsdp::LayerActivationShape shape{64, 128, 8, 2, 8};
  const int64_t tokens = 1000;
  const auto none = mfsdp::plan_activations(shape, 8, tokens, 4, {});
  const auto uniform = mfsdp::plan_activations(shape, 8, tokens, 4, RecomputeOptions::full_layers(RecomputeOptions::Method::kUniform, 2));
  const auto block = mfsdp::plan_activations(shape, 8, tokens, 4, RecomputeOptions::full_layers(RecomputeOptions::Method::kBlock, 3));
  // Uniform 2: 4 checkpoints of 64 elements a token; two whole layers again during a backward.
  EXPECT_EQ(uniform.kept_bytes, 4 * 64 * tokens * 4);
  EXPECT_EQ(uniform.recompute_bytes, 2 * none.kept_bytes / 8);
  // Block 3: three layers keep their input, five keep everything.
  EXPECT_EQ(block.kept_bytes, 3 * 64 * tokens * 4 + 5 * none.kept_bytes / 8);
  EXPECT_EQ(block.recompute_bytes, none.kept_bytes / 8);
}

}  // namespace
