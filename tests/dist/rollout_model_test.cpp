// The rollout copy of a sharded policy (include/mfsdp/train/rollout_model.h): after an optimizer step it
// holds exactly FsdpHandle::full_state_dict's values (bit for bit), under every sharding
// strategy, and greedy generation from it equals generation from an unsharded model that took
// the same step. Real processes, 1 and 2 ranks.
#include <torch/torch.h>

#include "harness/dist_test.h"
#include "harness/tiny_llama.h"
#include "mfsdp/fsdp/fully_shard.h"
#include "mfsdp/models/batched_generate.h"
#include "mfsdp/models/llama.h"
#include "mfsdp/models/llama_hf_config.h"
#include "mfsdp/train/rollout_model.h"

namespace {

std::shared_ptr<mfsdp::Communicator> borrow(mfsdp::Communicator& comm) {
  return std::shared_ptr<mfsdp::Communicator>(&comm, [](mfsdp::Communicator*) {});
}

mfsdp::LlamaConfig config() { return mfsdp::testing::tiny_llama_config(); }

}  // namespace

MFSDP_DIST_TEST(RolloutModel, EqualsTheFullStateDictAfterAStep, {1, 2}) {
  for (const char* strategy : {"no_shard", "optim", "optim_grads", "optim_grads_params"}) {
    mfsdp::LlamaOptions options;
    options.init_seed = 3;
    mfsdp::LlamaForCausalLM plain(config(), options), policy(config(), options);
    mfsdp::FullyShardOptions o;
    o.comm = borrow(comm);
    o.strategy = mfsdp::parse_sharding_strategy(strategy);
    mfsdp::FsdpHandle root = mfsdp::shard_llama(policy, o);
    mfsdp::SGDOptions sgd;
    sgd.momentum = 0;
    auto optimizer = mfsdp::make_sgd(root, sgd);
    // Every rank trains on the same batch: the sharded step equals the plain one.
    at::Tensor ids = torch::arange(24, torch::kLong).remainder(40).view({2, 12});
    mfsdp::lm_loss(policy->call(ids.narrow(1, 0, 11)), ids.narrow(1, 1, 11)).backward();
    optimizer->step(0.5);
    root.zero_grad();
    mfsdp::lm_loss(plain->forward(ids.narrow(1, 0, 11)), ids.narrow(1, 1, 11)).backward();
    {
      torch::NoGradGuard no_grad;
      for (auto& p : plain->parameters()) p.sub_(p.grad() * 0.5);
    }

    mfsdp::RolloutModel rollout(mfsdp::llama_model_config(config()), comm.device());
    rollout.load_from(root);
    const auto full = root.full_state_dict(/*all_ranks=*/true);
    for (const auto& item : rollout.model().named_parameters())
      EXPECT_TRUE(torch::equal(item.value(), full.at(item.key()))) << strategy << " " << item.key();

    mfsdp::SamplingOptions greedy;
    greedy.greedy = true;
    greedy.max_new_tokens = 6;
    torch::NoGradGuard no_grad;
    const std::vector<std::vector<int64_t>> prompts = {{1, 2, 3}, {7, 8}};
    auto got = mfsdp::generate_batch(rollout.model(), prompts, {0, 0}, greedy);
    auto want = mfsdp::generate_batch(*plain, prompts, {0, 0}, greedy);
    EXPECT_EQ(got.tokens, want.tokens) << strategy;
    rollout.release();
    EXPECT_FALSE(rollout.loaded());
    EXPECT_THROW(rollout.model(), std::logic_error);
  }
}
