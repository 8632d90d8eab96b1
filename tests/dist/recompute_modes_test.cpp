// Activation recompute as Megatron defines it (RecomputeOptions, include/mfsdp/fsdp/recompute.h):
// every mode gives the loss and gradients of no recompute, and really recomputes. A small Llama
// (grouped-query attention), an MoE Llama (shared expert with its gate, balancing losses in the
// gradient) and an MLA Llama, on 1 rank and sharded over 2 ranks with fully_shard (real
// processes). Gradients are compared through one SGD step at lr 1 (new weights = old - grad),
// read back whole with full_state_dict. "Really recomputes" is measured: the CPU bytes still
// allocated after the forward (the autograd graph's saved tensors, through a counting CPU
// allocator) fall below those of no recompute. MoE router statistics are counted once.
#include <torch/torch.h>

#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <map>
#include <string>
#include <vector>

#include "harness/counting_allocator.h"
#include "harness/dist_test.h"
#include "mfsdp/fsdp/fully_shard.h"
#include "mfsdp/fsdp/recompute.h"
#include "mfsdp/models/llama.h"
#include "mfsdp/optim/optim.h"

namespace {

using mfsdp::RecomputeOptions;

using mfsdp::testing::CountingCpuAllocator;
using mfsdp::testing::counting_allocator;

std::shared_ptr<mfsdp::Communicator> borrow(mfsdp::Communicator& comm) {
  return std::shared_ptr<mfsdp::Communicator>(&comm, [](mfsdp::Communicator*) {});
}

enum class Kind { kDense, kMoe, kMla };

mfsdp::LlamaConfig config_of(Kind kind) {
  mfsdp::LlamaConfig c;
  c.vocab_size = 96;
  c.hidden_size = 32;
  c.intermediate_size = 64;
  c.num_layers = 4;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;  // grouped-query: core attention expands the keys and values
  c.max_position_embeddings = 32;
  if (kind == Kind::kMoe) {
    c.moe.num_experts = 4;
    c.moe.top_k = 2;
    c.moe.ffn_hidden_size = 24;
    c.moe.shared_expert_intermediate_size = 16;
    c.moe.shared_expert_gate = true;
    c.moe.moe_layers = {false, true, true, true};  // one dense layer: "mlp" and "moe" both apply
  }
  if (kind == Kind::kMla) {
    mfsdp::MlaConfig m;
    m.hidden_size = c.hidden_size;
    m.num_heads = c.num_attention_heads;
    m.q_lora_rank = 12;
    m.kv_lora_rank = 10;
    m.qk_nope_head_dim = 6;
    m.qk_rope_head_dim = 4;
    m.v_head_dim = 8;
    m.rope_theta = c.rope_theta;
    c.mla = m;
  }
  return c;
}

struct Outcome {
  double loss = 0;
  std::map<std::string, at::Tensor> weights;  // after one SGD step at lr 1
  int64_t kept_bytes = 0;                     // CPU bytes still allocated after the forward
  std::vector<int64_t> tokens_per_expert;     // summed over the MoE layers
};

Outcome run(mfsdp::Communicator& comm, Kind kind, const RecomputeOptions& recompute) {
  CountingCpuAllocator& counter = counting_allocator();
  const mfsdp::LlamaConfig c = config_of(kind);
  mfsdp::LlamaOptions o;
  o.init_seed = 7;
  o.recompute = recompute;
  o.moe.aux_loss_coeff = 0.01;  // the balancing losses reach the gradient inside the MoE block
  o.moe.z_loss_coeff = 0.001;
  mfsdp::LlamaForCausalLM model(c, o);
  mfsdp::FullyShardOptions so;
  so.comm = borrow(comm);
  auto root = mfsdp::shard_llama(model, so);
  auto sgd = mfsdp::make_sgd(root, mfsdp::SGDOptions{});
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + comm.rank());
  const at::Tensor ids = at::randint(c.vocab_size, {2, 12}, gen), labels = at::randint(c.vocab_size, {2, 12}, gen);
  Outcome out;
  const int64_t before = counter.live.load();
  at::Tensor loss = mfsdp::lm_loss(mfsdp::call(*model, ids), labels);
  out.kept_bytes = counter.live.load() - before;
  out.loss = loss.item<double>();
  loss.backward();
  sgd->step(1.0);
  out.weights = root.full_state_dict(/*all_ranks=*/true);
  for (auto& [layer, stats] : model->take_router_stats()) {
    out.tokens_per_expert.resize(stats.tokens_per_expert.size());
    for (size_t e = 0; e < stats.tokens_per_expert.size(); ++e) out.tokens_per_expert[e] += stats.tokens_per_expert[e];
  }
  return out;
}


void check_modes(mfsdp::Communicator& comm, Kind kind, const std::vector<std::vector<std::string>>& selective) {
  const Outcome none = run(comm, kind, {});
  std::vector<std::pair<std::string, RecomputeOptions>> modes;
  for (const auto& modules : selective) {
    std::string name = "selective";
    for (const auto& m : modules) name += " " + m;
    modes.emplace_back(name, RecomputeOptions::selective(modules));
  }
  modes.emplace_back("full uniform 1", RecomputeOptions::full_layers(RecomputeOptions::Method::kUniform, 1));
  modes.emplace_back("full uniform 2", RecomputeOptions::full_layers(RecomputeOptions::Method::kUniform, 2));
  modes.emplace_back("full block 1", RecomputeOptions::full_layers(RecomputeOptions::Method::kBlock, 1));
  for (const auto& [name, options] : modes) {
    SCOPED_TRACE(name + ", " + std::to_string(comm.size()) + " rank(s)");
    const Outcome r = run(comm, kind, options);
    EXPECT_NEAR(r.loss, none.loss, 1e-6);
    ASSERT_EQ(r.weights.size(), none.weights.size());
    for (const auto& [param, w] : none.weights) {
      const double diff = (r.weights.at(param) - w).abs().max().item<double>();
      EXPECT_LE(diff, 1e-6) << param;
    }
    // Recomputed, not kept: fewer bytes left allocated by the forward.
    EXPECT_LT(r.kept_bytes, none.kept_bytes) << "kept " << r.kept_bytes << " bytes, without recompute "
                                             << none.kept_bytes;
    EXPECT_EQ(r.tokens_per_expert, none.tokens_per_expert) << "router statistics counted once per forward";
  }
}

}  // namespace

MFSDP_DIST_TEST(RecomputeModes, DenseLlamaMatchesNoRecompute, {1, 2}) {
  check_modes(comm, Kind::kDense, {{"core_attn"}, {"layernorm"}, {"mlp"}, {"core_attn", "layernorm", "mlp"}});
}

MFSDP_DIST_TEST(RecomputeModes, MoeLlamaMatchesNoRecompute, {1, 2}) {
  check_modes(comm, Kind::kMoe,
              {{"moe"}, {"moe_act"}, {"shared_experts"}, {"mlp"}, {"core_attn", "layernorm", "moe_act", "shared_experts"},
               {"core_attn", "mlp", "moe"}});
}

MFSDP_DIST_TEST(RecomputeModes, MlaLlamaMatchesNoRecompute, {1, 2}) {
  check_modes(comm, Kind::kMla, {{"mla_up_proj"}, {"core_attn"}, {"mla_up_proj", "core_attn", "layernorm", "mlp"}});
}

// Block recomputes only the first N layers of the chunk (Megatron's _checkpointed_forward): the
// bytes given back grow by one layer's per N, and N = all layers keeps what uniform 1 keeps. A
// block that recomputed the wrong count of layers fails here.
MFSDP_DIST_TEST(RecomputeModes, BlockRecomputesOnlyTheFirstLayers, {1}) {
  const Outcome none = run(comm, Kind::kDense, {});
  const Outcome block1 = run(comm, Kind::kDense, RecomputeOptions::full_layers(RecomputeOptions::Method::kBlock, 1));
  const Outcome block2 = run(comm, Kind::kDense, RecomputeOptions::full_layers(RecomputeOptions::Method::kBlock, 2));
  const Outcome block4 = run(comm, Kind::kDense, RecomputeOptions::full_layers(RecomputeOptions::Method::kBlock, 4));
  const Outcome uniform1 = run(comm, Kind::kDense, RecomputeOptions::full_layers(RecomputeOptions::Method::kUniform, 1));
  // Each layer recomputed gives back the same bytes (the layers are alike): linear in N.
  const int64_t per_layer = none.kept_bytes - block1.kept_bytes;
  EXPECT_GT(per_layer, 0);
  EXPECT_EQ(none.kept_bytes - block2.kept_bytes, 2 * per_layer);
  EXPECT_EQ(none.kept_bytes - block4.kept_bytes, 4 * per_layer);
  EXPECT_EQ(block4.kept_bytes, uniform1.kept_bytes);
}
