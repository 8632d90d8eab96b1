// TrainingRun::step (include/mfsdp/train/training_run.h) in real processes, 1 and 2 ranks:
// - --log-num-zeros-in-grad and --log-params-norm give, under every sharding strategy, the
//   numbers of a plain (unsharded) model taking the same SGD step on the same global batch, and
//   the closed form of the zero count (the embedding rows of token ids that are not in the batch);
// - the step's loss is the sum of what the micro-batches report (left on the device), the plain
//   model's loss of this rank's rows;
// - --check-for-nan-in-loss-and-grad stops every rank with the same error, naming the iteration,
//   the rank whose loss is NaN and the parameters whose reduced gradient shards hold NaN or Inf
//   (injected through the micro-batch function, after backward), before the optimizer step;
//   turned off, the same step goes through; and a checkpoint of NaN weights is refused before
//   anything is written.
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <set>
#include <sstream>

#include "harness/dist_test.h"
#include "mfsdp/models/llama.h"
#include "mfsdp/models/llama_hf_config.h"
#include "mfsdp/train/training_run.h"

namespace {

std::shared_ptr<mfsdp::Communicator> borrow(mfsdp::Communicator& comm) {
  return std::shared_ptr<mfsdp::Communicator>(&comm, [](mfsdp::Communicator*) {});
}

constexpr int64_t kVocab = 40, kHidden = 16, kSeq = 12;
constexpr double kLr = 0.5;

// Two rows of the global batch, one per rank (or two micro-batches on one rank): token ids
// below 20, so embedding rows 20..39 get no gradient.
at::Tensor row(int64_t r) { return (torch::arange(kSeq + 1, torch::kLong) * (r + 1)).remainder(20).view({1, kSeq + 1}); }

mfsdp::PretrainArgs args_for(const std::string& strategy, int world) {
  mfsdp::PretrainArgs a;
  a.num_layers = 2;
  a.hidden_size = kHidden;
  a.num_attention_heads = 4;
  a.group_query_attention = true;
  a.num_query_groups = 2;
  a.ffn_hidden_size = 24;
  a.seq_length = kSeq;
  a.vocab_size = kVocab;
  a.make_vocab_size_divisible_by = 8;
  a.untie_embeddings_and_output_weights = true;
  a.micro_batch_size = 1;
  a.global_batch_size = 2;
  a.train_iters = 1;
  a.lr = kLr;
  a.lr_decay_style = "constant";
  a.optimizer = "sgd";
  a.sgd_momentum = 0;
  a.weight_decay = 0;
  a.clip_grad = 0;
  a.seed = 3;
  a.mock_data = true;
  a.data_parallel_sharding_strategy = strategy;
  a.log_params_norm = true;
  a.log_num_zeros_in_grad = true;
  mfsdp::validate_training_args(a, world, 0);
  return a;
}

// The loss of global row `r` on the sharded model, scaled so the step's gradient is that of
// the mean over the two rows (1/dp in the reduction, 1/micro-batches here).
at::Tensor micro_loss(mfsdp::TrainingRun& run, int64_t r, int64_t micro_batches) {
  const at::Tensor ids = row(r);
  return mfsdp::lm_loss(run.model()->call(ids.narrow(1, 0, kSeq)), ids.narrow(1, 1, kSeq)) /
         static_cast<double>(micro_batches);
}

std::map<std::string, at::Tensor> weights(mfsdp::TrainingRun& run) {
  std::map<std::string, at::Tensor> out;
  for (auto& [name, t] : run.root().full_state_dict(/*all_ranks=*/true)) out[name] = t.clone();
  return out;
}

void expect_same_weights(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) EXPECT_TRUE(torch::equal(t, b.at(name))) << name << " changed";
}

// Sets element `index` (of the whole parameter) of `name`'s reduced gradient to `value` on the
// ranks whose shard holds it.
void poison_grad(mfsdp::TrainingRun& run, const std::string& name, int64_t index, double value) {
  const auto shards = run.root().optimizer_shards();
  for (const mfsdp::LocalShard& s : run.root().local_shards()) {
    if (s.name != name) continue;
    int64_t numel = 1;
    for (int64_t d : s.global_shape) numel *= d;
    const int64_t at = index < 0 ? numel + index : index;
    if (at >= s.offset && at < s.offset + s.local.numel()) {
      torch::NoGradGuard no_grad;
      shards[static_cast<size_t>(s.shard_index)].main_grad[s.shard_offset + at - s.offset].fill_(value);
    }
  }
}

}  // namespace

MFSDP_DIST_TEST(TrainingRun, NormsAndZerosEqualAPlainModelsStep, {1, 2}) {
  const int world = comm.size(), rank = comm.rank();
  const int64_t micro_batches = 2 / world;
  for (const char* strategy : {"no_shard", "optim", "optim_grads", "optim_grads_params"}) {
    const mfsdp::PretrainArgs a = args_for(strategy, world);
    std::ostringstream log;
    mfsdp::TrainingRun run(a, mfsdp::model_config_from_args(a, a, a.seq_length, a.padded_vocab_size), borrow(comm), log, /*per_token_loss=*/false);
    double reported = 0;  // what the micro-batches report, summed here as the step must
    const auto stats = run.step(1, micro_batches, [&](int64_t m) {
      at::Tensor loss = micro_loss(run, world == 1 ? m : rank, micro_batches);
      loss.backward();
      reported += loss.item<double>();
      return loss.detach();
    });

    // The same step on one plain model: mean loss of both rows, p -= lr * grad.
    mfsdp::LlamaOptions options;
    options.init_seed = static_cast<uint64_t>(a.seed);
    mfsdp::LlamaForCausalLM plain(mfsdp::llama_config_of(mfsdp::model_config_from_args(a, a, a.seq_length, a.padded_vocab_size)), options);
    at::Tensor loss = at::zeros({}, at::kFloat);
    double row_loss[2];
    for (int64_t r = 0; r < 2; ++r) {
      const at::Tensor l = mfsdp::lm_loss(plain->forward(row(r).narrow(1, 0, kSeq)), row(r).narrow(1, 1, kSeq));
      row_loss[r] = l.item<double>();
      loss = loss + l / 2.0;
    }
    loss.backward();
    const double plain_loss_of_rank = world == 1 ? (row_loss[0] + row_loss[1]) / 2 : row_loss[rank];
    int64_t zeros = 0;
    double squares = 0;
    {
      torch::NoGradGuard no_grad;
      for (auto& p : plain->parameters()) {
        zeros += p.grad().numel() - at::count_nonzero(p.grad()).item<int64_t>();
        p.sub_(p.grad() * kLr);
        squares += p.to(at::kDouble).square().sum().item<double>();
      }
    }
    // Closed form: the embedding rows of ids absent from both rows' inputs (every other
    // gradient element is some non-zero float).
    std::set<int64_t> ids;
    for (int64_t r = 0; r < 2; ++r)
      for (int64_t i = 0; i < kSeq; ++i) ids.insert(row(r)[0][i].item<int64_t>());
    const int64_t closed_form = (kVocab - static_cast<int64_t>(ids.size())) * kHidden;

    EXPECT_EQ(stats.num_zeros_in_grad, closed_form) << strategy << " world " << world;
    EXPECT_EQ(stats.loss_value(), reported) << strategy << " world " << world;
    // This rank's rows' mean loss (rows m, or row `rank`) on the plain model, before its step.
    EXPECT_NEAR(stats.loss_value(), plain_loss_of_rank, 1e-5) << strategy << " world " << world;
    EXPECT_EQ(zeros, closed_form) << strategy;
    EXPECT_NEAR(stats.params_norm, std::sqrt(squares), 1e-6 * std::sqrt(squares)) << strategy << " world " << world;
    // What the log line and the metrics record carry.
    const std::string text = run.norms_log_text(stats);
    EXPECT_NE(text.find(" | num zeros: " + std::to_string(closed_form)), std::string::npos) << text;
    EXPECT_NE(text.find(" | params norm: "), std::string::npos) << text;
    mfsdp::IterationRecord record;
    run.add_norms(record, stats);
    ASSERT_EQ(record.extra.size(), 2u);
    EXPECT_EQ(record.extra[0].first, "num_zeros_in_grad");
    EXPECT_EQ(record.extra[1].first, "params_norm");
  }
}

MFSDP_DIST_TEST(TrainingRun, NanLossOnOneRankStopsEveryRankBeforeTheStep, {1, 2}) {
  const int world = comm.size(), rank = comm.rank();
  const mfsdp::PretrainArgs a = args_for("optim_grads_params", world);
  std::ostringstream log;
  mfsdp::TrainingRun run(a, mfsdp::model_config_from_args(a, a, a.seq_length, a.padded_vocab_size), borrow(comm), log, false);
  const auto before = weights(run);
  std::string error;
  try {
    run.step(1, 2 / world, [&](int64_t m) {
      at::Tensor loss = micro_loss(run, world == 1 ? m : rank, 2 / world);
      loss.backward();
      // The last rank's last micro-batch reports NaN (its gradients stay finite).
      return rank == world - 1 && m == 2 / world - 1 ? at::full({}, std::nan(""), loss.options()) : loss.detach();
    });
  } catch (const mfsdp::NonFiniteError& e) {
    error = e.what();
  }
  const std::string expected =
      "iteration 1: the loss is NaN or Inf on rank " + std::to_string(world - 1) + " of " + std::to_string(world);
  EXPECT_EQ(error.rfind(expected, 0), 0u) << error;
  EXPECT_EQ(error.find("gradients"), std::string::npos) << error;
  EXPECT_NE(error.find("--check-for-nan-in-loss-and-grad"), std::string::npos) << error;
  expect_same_weights(before, weights(run));
}

MFSDP_DIST_TEST(TrainingRun, NonFiniteGradientsAreNamedByParameter, {1, 2}) {
  const int world = comm.size(), rank = comm.rank();
  for (const char* strategy : {"no_shard", "optim_grads_params"}) {
    const mfsdp::PretrainArgs a = args_for(strategy, world);
    std::ostringstream log;
    mfsdp::TrainingRun run(a, mfsdp::model_config_from_args(a, a, a.seq_length, a.padded_vocab_size), borrow(comm), log, false);
    const auto before = weights(run);
    auto micro_batch = [&](int64_t m) {
      at::Tensor loss = micro_loss(run, world == 1 ? m : rank, 2 / world);
      loss.backward();
      if (m == 2 / world - 1) {
        // On the rank whose shard holds the element (every rank under no_shard).
        poison_grad(run, "model.layers.1.mlp.down_proj.weight", -1, std::nan(""));
        poison_grad(run, "lm_head.weight", 0, INFINITY);
      }
      return loss.detach();
    };
    std::string error;
    try {
      run.step(1, 2 / world, micro_batch);
    } catch (const mfsdp::NonFiniteError& e) {
      error = e.what();
    }
    EXPECT_EQ(error.rfind("iteration 1: the gradients are not finite (grad norm ", 0), 0u) << strategy << ": " << error;
    EXPECT_NE(error.find("in the shards of 2 parameters: model.layers.1.mlp.down_proj.weight (1 NaN, 0 Inf of " +
                         std::to_string(kHidden * 24) + "), lm_head.weight (0 NaN, 1 Inf of " +
                         std::to_string(kVocab * kHidden) + ")"),
              std::string::npos)
        << strategy << ": " << error;
    EXPECT_EQ(error.find("the loss is"), std::string::npos) << error;
    expect_same_weights(before, weights(run));

    // --no-check-for-nan-in-loss-and-grad: the step goes through (and poisons the weights).
    mfsdp::PretrainArgs unchecked = a;
    unchecked.check_for_nan_in_loss_and_grad = false;
    mfsdp::TrainingRun off(unchecked, mfsdp::model_config_from_args(unchecked, unchecked, unchecked.seq_length, unchecked.padded_vocab_size), borrow(comm), log, false);
    auto off_batch = [&](int64_t m) {
      at::Tensor loss = micro_loss(off, world == 1 ? m : rank, 2 / world);
      loss.backward();
      if (m == 2 / world - 1) poison_grad(off, "model.layers.1.mlp.down_proj.weight", -1, std::nan(""));
      return loss.detach();
    };
    const auto stats = off.step(1, 2 / world, off_batch);
    EXPECT_TRUE(std::isnan(stats.grad_norm_value())) << strategy;
    EXPECT_TRUE(weights(off).at("model.layers.1.mlp.down_proj.weight").isnan().any().item<bool>()) << strategy;
  }
}

MFSDP_DIST_TEST(TrainingRun, NoCheckpointOfNonFiniteWeights, {1, 2}) {
  const int world = comm.size();
  mfsdp::PretrainArgs a = args_for("optim_grads_params", world);
  const std::string dir = mfsdp::testing::shared_temp_dir() + "/ckpt";
  a.save = dir;
  a.save_interval = 1;
  a.train_iters = 2;
  std::ostringstream log;
  mfsdp::TrainingRun run(a, mfsdp::model_config_from_args(a, a, a.seq_length, a.padded_vocab_size), borrow(comm), log, false);
  // One weight element turns NaN (as an overflowing step would leave it), on the rank holding it.
  for (const mfsdp::LocalShard& s : run.root().local_shards())
    if (s.name == "model.norm.weight" && s.offset == 0 && s.local.numel() > 0) {
      torch::NoGradGuard no_grad;
      s.local[0].fill_(std::nan(""));
    }
  std::string error;
  try {
    run.after_iteration(1);
  } catch (const mfsdp::NonFiniteError& e) {
    error = e.what();
  }
  EXPECT_EQ(error.rfind("iteration 1: the weights are not finite after the optimizer step in the shards of 1 "
                        "parameter: model.norm.weight (1 NaN, 0 Inf of " + std::to_string(kHidden) + ")", 0),
            0u)
      << error;
  comm.barrier();
  EXPECT_FALSE(std::filesystem::exists(dir)) << "a checkpoint was written";
}

// Under expert parallelism each rank holds other experts: a NaN in rank 1's expert is reported
// under that expert's name, not under the expert rank 0 holds at the same place in its list.
MFSDP_DIST_TEST(TrainingRun, NonFiniteExpertGradientsNameTheirOwnExpert, {2}) {
  const int rank = comm.rank();
  mfsdp::PretrainArgs a = args_for("optim_grads_params", 2);
  a.swiglu = true;
  a.num_experts = 4;
  a.moe_router_topk = 2;
  a.moe_ffn_hidden_size = 8;
  a.expert_model_parallel_size = 2;
  mfsdp::validate_training_args(a, 2, 0);
  std::ostringstream log;
  mfsdp::TrainingRun run(a, mfsdp::model_config_from_args(a, a, a.seq_length, a.padded_vocab_size), borrow(comm), log, false);
  const std::string poisoned = "model.layers.1.block_sparse_moe.experts.3.w2.weight";  // rank 1's (Mixtral's names)
  bool held = false;
  for (const mfsdp::LocalShard& s : run.root().local_shards()) held = held || s.name == poisoned;
  EXPECT_EQ(held, rank == 1);
  auto micro_batch = [&](int64_t) {
    at::Tensor loss = micro_loss(run, rank, 1);
    loss.backward();
    poison_grad(run, poisoned, 0, std::nan(""));
    return loss.detach();
  };
  std::string error;
  try {
    run.step(1, 1, micro_batch);
  } catch (const mfsdp::NonFiniteError& e) {
    error = e.what();
  }
  EXPECT_NE(error.find("in the shards of 1 parameter: " + poisoned + " (1 NaN, 0 Inf of " +
                       std::to_string(kHidden * 8) + ")"),
            std::string::npos)
      << error;
}
