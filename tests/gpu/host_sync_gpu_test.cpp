// Host syncs of a training step on CUDA (ctest label gpu): TrainingRun::step
// (include/mfsdp/train/training_run.h) keeps the micro-batches' losses on the device, so
//   - no micro-batch holds the host: nothing from its data copy and forward to the end of its
//     backward waits for the device (a wait there empties the launch queue every micro-batch);
//   - a step waits once with --check-for-nan-in-loss-and-grad (the loss and the gradient norm
//     read with its flags in one copy) and never without it (the clip factor is applied on the
//     device; the loop reads the losses and the norm at log steps, include/mfsdp/train/train_loop.h),
//     the same with 2 micro-batches as with 4.
// The waits are counted as c10 reports them in its sync debug mode ("called a synchronizing
// CUDA operation": stream synchronizations and blocking copies made through c10). On a machine
// without a GPU the test skips, naming what is missing.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <cmath>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "harness/dist_test.h"
#include "mfsdp/models/lm_loss.h"
#include "mfsdp/train/training_run.h"
#include "harness/require_gpu.h"

namespace {

constexpr int64_t kSeq = 16, kVocab = 64, kSteps = 4;

// Counts c10's sync warnings while alive (this thread; the autograd engine replays its threads'
// warnings here when backward() returns); other warnings go to the handler before it.
class SyncCounter : public c10::WarningHandler {
 public:
  SyncCounter() : previous_(c10::WarningUtils::get_warning_handler()) {
    c10::WarningUtils::set_warning_handler(this);
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_WARN);
  }
  ~SyncCounter() override {
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
    c10::WarningUtils::set_warning_handler(previous_);
  }
  void process(const c10::Warning& w) override {
    if (w.msg().find("called a synchronizing CUDA operation") != std::string::npos)
      ++syncs;
    else
      previous_->process(w);
  }
  int64_t syncs = 0;

 private:
  c10::WarningHandler* previous_;
};

mfsdp::PretrainArgs args_for(int64_t micro_batches, bool nan_check) {
  mfsdp::PretrainArgs a;
  a.num_layers = 2;
  a.hidden_size = 32;
  a.num_attention_heads = 4;
  a.ffn_hidden_size = 48;
  a.swiglu = true;
  a.seq_length = kSeq;
  a.vocab_size = kVocab;
  a.make_vocab_size_divisible_by = 64;
  a.micro_batch_size = 2;
  a.global_batch_size = 2 * micro_batches;
  a.train_iters = kSteps;
  a.lr = 1e-3;
  a.seed = 5;
  a.mock_data = true;
  a.check_for_nan_in_loss_and_grad = nan_check;  // clip_grad 1.0 and Adam: the defaults
  mfsdp::validate_training_args(a, 1, 0);
  return a;
}

// The syncs of each step after the first (which allocates the optimizer state and the caching
// allocator's blocks); a failure for every micro-batch that waited for the device.
std::vector<int64_t> syncs_per_step(mfsdp::Communicator& comm, int64_t micro_batches, bool nan_check) {
  const mfsdp::PretrainArgs a = args_for(micro_batches, nan_check);
  std::ostringstream log;
  mfsdp::TrainingRun run(a, mfsdp::model_config_from_args(a, a, a.seq_length, a.padded_vocab_size),
                         std::shared_ptr<mfsdp::Communicator>(&comm, [](mfsdp::Communicator*) {}), log,
                         /*per_token_loss=*/false);
  const at::Device device = comm.device();
  std::vector<int64_t> out;
  SyncCounter counter;
  for (int64_t it = 1; it <= kSteps; ++it) {
    const int64_t before_step = counter.syncs;
    const auto stats = run.step(it, micro_batches, [&](int64_t m) {
      const int64_t before = counter.syncs;
      const at::Tensor ids =
          mfsdp::to_device(at::randint(kVocab, {a.micro_batch_size, kSeq + 1}, at::kLong), device);
      at::Tensor loss = mfsdp::lm_loss(run.model()->call(ids.narrow(1, 0, kSeq)), ids.narrow(1, 1, kSeq)) /
                        static_cast<double>(micro_batches);
      loss.backward();
      EXPECT_EQ(counter.syncs - before, 0)
          << "micro-batch " << m << " of step " << it << " (" << micro_batches << " micro-batches) waited for the "
          << "device between its data copy and the end of its backward";
      return loss.detach();
    });
    if (it > 1) out.push_back(counter.syncs - before_step);
    EXPECT_TRUE(std::isfinite(stats.loss_value())) << stats.loss_value();
  }
  return out;
}

TEST(HostSyncGpu, MicroBatchesDoNotWaitAndAStepWaitsOnlyForTheNanCheck) {
  MFSDP_REQUIRE_GPU();
  mfsdp::testing::DistOptions o;
  o.backend = "nccl";
  o.world_sizes = {1};
  mfsdp::testing::run_distributed(o, [](mfsdp::Communicator& comm) {
    ASSERT_TRUE(comm.device().is_cuda());
    for (bool nan_check : {true, false}) {
      const std::vector<int64_t> two = syncs_per_step(comm, 2, nan_check), four = syncs_per_step(comm, 4, nan_check);
      EXPECT_EQ(two, four) << "with the NaN check " << (nan_check ? "on" : "off")
                           << ": the syncs per step grow with the micro-batches";
      ASSERT_EQ(two.size(), static_cast<size_t>(kSteps - 1));
      // With the NaN check, its one fused read; without it, none.
      for (int64_t syncs : two) EXPECT_EQ(syncs, nan_check ? 1 : 0) << "with the NaN check " << (nan_check ? "on" : "off");
    }
  });
}

}  // namespace
