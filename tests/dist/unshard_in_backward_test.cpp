// set_unshard_in_backward(false) (FSDP2's knob for units whose backward reads no weight, such as
// an embedding): the unit is all-gathered for its forward only, and training is bit-identical to
// gathering it for backward too; untied Llama embeddings get it from their plan's FSDP units.
#include <torch/torch.h>

#include <algorithm>

#include "harness/dist_test.h"
#include "mfsdp/fsdp/fully_shard.h"
#include "mfsdp/models/llama.h"
#include "mfsdp/optim/optim.h"

namespace {

using namespace torch;
using mfsdp::ShardingStrategy;

constexpr int64_t V = 40, D = 12;

struct EmbedImpl : mfsdp::ShardedModule<EmbedImpl> {
  EmbedImpl() { table = register_module("table", nn::Embedding(V, D)); }
  Tensor forward(Tensor ids) { return table(ids); }
  nn::Embedding table{nullptr};
};
TORCH_MODULE(Embed);

struct BlockImpl : mfsdp::ShardedModule<BlockImpl> {
  BlockImpl() { fc = register_module("fc", nn::Linear(D, D)); }
  Tensor forward(Tensor x) { return x + torch::tanh(fc(x)); }
  nn::Linear fc{nullptr};
};
TORCH_MODULE(Block);

struct NetImpl : nn::Module {
  NetImpl() {
    embed = register_module("embed", Embed());
    b0 = register_module("b0", Block());
    b1 = register_module("b1", Block());
    head = register_module("head", nn::Linear(D, 3));
  }
  Tensor forward(Tensor ids) { return head(b1->call(b0->call(embed->call(ids)))); }
  Embed embed{nullptr};
  Block b0{nullptr}, b1{nullptr};
  nn::Linear head{nullptr};
};
TORCH_MODULE(Net);

std::shared_ptr<mfsdp::Communicator> borrow(mfsdp::Communicator& comm) {
  return std::shared_ptr<mfsdp::Communicator>(&comm, [](mfsdp::Communicator*) {});
}

struct Result {
  std::vector<double> numbers;       // losses, then every parameter's sum after training
  std::vector<std::string> events;   // of the last step
};

Result train(mfsdp::Communicator& comm, bool unshard_embed_in_backward) {
  torch::manual_seed(5);
  Net net;
  mfsdp::FullyShardOptions o;
  o.comm = borrow(comm);
  o.strategy = ShardingStrategy::kOptimGradsParams;
  auto embed = mfsdp::fully_shard(*net->embed, o);
  embed.set_unshard_in_backward(unshard_embed_in_backward);
  mfsdp::fully_shard(*net->b0, o);
  mfsdp::fully_shard(*net->b1, o);
  auto root = mfsdp::fully_shard(*net, o);
  auto opt = mfsdp::make_adamw(root, {});
  Result r;
  for (int step = 0; step < 4; ++step) {
    if (step == 3) root.record_events(true);
    for (int micro = 0; micro < 2; ++micro) {
      root.set_requires_gradient_sync(micro == 1);
      auto gen = at::make_generator<at::CPUGeneratorImpl>(100 * step + 10 * micro + comm.rank());
      Tensor ids = at::randint(V, {4, 5}, gen);
      Tensor loss = mfsdp::call(*net, ids).pow(2).mean();
      loss.backward();
      r.numbers.push_back(loss.item<double>());
    }
    opt->step(1e-2);
    root.zero_grad();
  }
  r.events = root.events();
  for (const auto& [name, value] : root.full_state_dict(/*all_ranks=*/true))
    r.numbers.push_back(value.sum().item<double>());
  return r;
}

long count(const std::vector<std::string>& events, const std::string& e) {
  return std::count(events.begin(), events.end(), e);
}

}  // namespace

MFSDP_DIST_TEST(UnshardInBackward, OffSkipsTheBackwardGatherAndChangesNoNumber, {1, 2, 3}) {
  const Result on = train(comm, true), off = train(comm, false);
  EXPECT_EQ(off.numbers, on.numbers);
  std::string trace;
  for (const auto& e : off.events) trace += e + " ";
  SCOPED_TRACE(trace);
  // Two micro-batches: gathered for both forwards (the second kept from the first's backward
  // when gathered there), for backward only when on.
  EXPECT_EQ(count(on.events, "embed:all_gather"), 3);
  EXPECT_EQ(count(off.events, "embed:all_gather"), 2);
  EXPECT_EQ(count(off.events, "embed:pre_backward"), 2);
  EXPECT_EQ(count(off.events, "embed:post_backward"), 2);
}

// The Llama plan turns it off for an untied embedding (its backward needs only the ids) and
// leaves a tied one (the root, whose weight lm_head reads in backward) alone; the trainer's
// losses are covered by the pretraining tests.
MFSDP_DIST_TEST(UnshardInBackward, UntiedLlamaEmbeddingIsNotGatheredForBackward, {2}) {
  for (bool tie : {false, true}) {
    mfsdp::LlamaConfig c;
    c.vocab_size = 64;
    c.hidden_size = 16;
    c.intermediate_size = 32;
    c.num_layers = 2;
    c.num_attention_heads = 2;
    c.num_key_value_heads = 2;
    c.max_position_embeddings = 16;
    c.tie_word_embeddings = tie;
    mfsdp::LlamaOptions lo;
    lo.init_seed = 1;
    mfsdp::LlamaForCausalLM model(c, lo);
    mfsdp::FullyShardOptions o;
    o.comm = borrow(comm);
    o.strategy = ShardingStrategy::kOptimGradsParams;
    auto root = mfsdp::shard_llama(model, o);
    root.record_events(true);
    Tensor ids = at::randint(c.vocab_size, {2, 8}, at::make_generator<at::CPUGeneratorImpl>(3));
    mfsdp::call(*model, ids).pow(2).mean().backward();
    const auto ev = root.events();
    if (!tie) {
      EXPECT_EQ(count(ev, "model.embed_tokens:all_gather"), 1);
      EXPECT_EQ(count(ev, "model.embed_tokens:pre_backward"), 1);
    } else {
      EXPECT_EQ(count(ev, "model.embed_tokens:all_gather"), 0) << "part of the root";
    }
  }
}
