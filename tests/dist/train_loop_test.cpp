// The one training loop (include/mfsdp/train/train_loop.h) reads the steps' losses and gradient
// norms on the host only at log steps, or once per step for --check-for-nan-in-loss-and-grad
// (its flags, the loss and the norm in one copy), for mfsdp-pretrain, mfsdp-sft and mfsdp-grpo,
// on 1 and 2 ranks (real processes). The reads are counted at the seam every such read goes
// through (read_on_host). A loop that read each step's loss, or each micro-batch's, would count
// one or more per step and fail here: the expected counts do not grow with the steps.
// And a load parses the checkpoint's metadata once per rank: the model config, the trainer state,
// the shards and GRPO's reference policy all read the one reader (open_training_checkpoint).
#include <torch/torch.h>

#include <sstream>
#include <string>
#include <vector>

#include "harness/dist_test.h"
#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/data/tokenizer.h"
#include "mfsdp/train/grpo.h"
#include "mfsdp/train/sft.h"
#include "mfsdp/train/train_loop.h"
#include "mfsdp/train/trainer.h"

namespace {

constexpr int64_t kIters = 6, kLogInterval = 3;  // two log steps
constexpr int64_t kLogSteps = kIters / kLogInterval;

std::vector<std::string> model_flags(bool nan_check) {
  std::vector<std::string> f = {"--device", "cpu", "--num-layers", "2", "--hidden-size", "32",
                                "--num-attention-heads", "4", "--swiglu", "--ffn-hidden-size", "48",
                                "--micro-batch-size", "1", "--lr", "1e-3", "--seed", "3",
                                "--train-iters", std::to_string(kIters), "--log-interval", std::to_string(kLogInterval),
                                "--eval-interval", "1000", "--eval-iters", "0"};
  if (!nan_check) f.push_back("--no-check-for-nan-in-loss-and-grad");
  return f;
}

std::vector<std::string> with(std::vector<std::string> head, const std::vector<std::string>& tail) {
  head.insert(head.end(), tail.begin(), tail.end());
  return head;
}

std::shared_ptr<mfsdp::Communicator> borrow(mfsdp::Communicator& comm) {
  return std::shared_ptr<mfsdp::Communicator>(&comm, [](mfsdp::Communicator*) {});
}

int64_t pretrain_reads(mfsdp::Communicator& comm, bool nan_check, const std::vector<std::string>& extra = {}) {
  mfsdp::PretrainArgs a = mfsdp::parse_pretrain_args(
      with({"mfsdp-pretrain", "--mock-data", "--vocab-size", "64", "--make-vocab-size-divisible-by", "64",
            "--seq-length", "16", "--global-batch-size", "4"},
           with(model_flags(nan_check), extra)));
  mfsdp::validate_pretrain_args(a, comm.size(), 0);
  std::ostringstream log;
  const int64_t before = mfsdp::host_reads();
  const mfsdp::PretrainResult r = mfsdp::pretrain(a, borrow(comm), log);
  if (extra.empty()) EXPECT_EQ(r.iterations, kIters) << log.str();
  return mfsdp::host_reads() - before;
}

int64_t sft_reads(mfsdp::Communicator& comm, bool nan_check, const std::vector<std::string>& extra = {}) {
  mfsdp::SftArgs s = mfsdp::parse_sft_args(
      with({"mfsdp-sft", "--tokenizer-type", "ByteLevelTokenizer", "--make-vocab-size-divisible-by", "1",
            "--gen-task", "arith", "--gen-train-size", "32", "--gen-val-size", "0", "--max-length", "48",
            "--global-batch-size", "4"},
           with(model_flags(nan_check), extra)));
  mfsdp::validate_training_args(s.base, comm.size(), mfsdp::tokenizer_vocab_size({"ByteLevelTokenizer", "", "", ""}));
  std::ostringstream log;
  const int64_t before = mfsdp::host_reads();
  const mfsdp::SftResult r = mfsdp::run_sft(s, borrow(comm), log);
  if (extra.empty()) EXPECT_EQ(r.iterations, kIters) << log.str();
  return mfsdp::host_reads() - before;
}

int64_t grpo_reads(mfsdp::Communicator& comm, bool nan_check, const std::vector<std::string>& extra = {}) {
  mfsdp::GrpoArgs g = mfsdp::parse_grpo_args(
      with({"mfsdp-grpo", "--tokenizer-type", "ByteLevelTokenizer", "--make-vocab-size-divisible-by", "1",
            "--gen-task", "arith", "--gen-train-size", "32", "--gen-val-size", "0", "--max-prompt-length", "32",
            "--max-response-length", "4", "--train-batch-size", "2", "--rollout-n", "2"},
           with(model_flags(nan_check), extra)));
  mfsdp::validate_grpo_args(g, comm.size(), mfsdp::tokenizer_vocab_size({"ByteLevelTokenizer", "", "", ""}));
  std::ostringstream log;
  const int64_t before = mfsdp::host_reads();
  const mfsdp::GrpoResult r = mfsdp::run_grpo(g, borrow(comm), log);
  if (extra.empty()) EXPECT_EQ(r.iterations, kIters) << log.str();
  return mfsdp::host_reads() - before;
}

}  // namespace

MFSDP_DIST_TEST(TrainLoop, PretrainReadsLossesOnlyAtLogStepsOrOncePerStepForTheNanCheck, {1, 2}) {
  // A log step reads its window's losses and the last norm in one copy.
  EXPECT_EQ(pretrain_reads(comm, /*nan_check=*/false), kLogSteps);
  // The NaN check reads them with its flags every step; the log steps then read nothing more.
  EXPECT_EQ(pretrain_reads(comm, /*nan_check=*/true), kIters);
}

MFSDP_DIST_TEST(TrainLoop, SftReadsLossesOnlyAtLogStepsOrOncePerStepForTheNanCheck, {1, 2}) {
  // A log step: the window's values, then their sums over the data-parallel ranks.
  EXPECT_EQ(sft_reads(comm, /*nan_check=*/false), 2 * kLogSteps);
  EXPECT_EQ(sft_reads(comm, /*nan_check=*/true), kIters + kLogSteps);
}

MFSDP_DIST_TEST(TrainLoop, GrpoReadsItsUpdateOncePerStepAndNothingMore, {1, 2}) {
  // GRPO records verl's metrics every step: the update's sums and its optimizer steps' norms in
  // one copy per step (one optimizer step per iteration here: the batch is one mini-batch);
  // the log steps read the last step's loss and norm.
  EXPECT_EQ(grpo_reads(comm, /*nan_check=*/false), kIters + kLogSteps);
  // With the NaN check, its read per optimizer step too; the log steps then read nothing more.
  EXPECT_EQ(grpo_reads(comm, /*nan_check=*/true), 2 * kIters);
}

// Save, then load in each trainer: one metadata parse per rank per load (the SFT checkpoint is
// the GRPO policy's and, with --use-kl-loss, its reference's).
MFSDP_DIST_TEST(TrainLoop, ALoadParsesTheCheckpointMetadataOncePerRank, {1, 2}) {
  const std::string dir = mfsdp::testing::shared_temp_dir();
  pretrain_reads(comm, false, {"--save", dir + "/pretrain", "--save-interval", "1000"});
  int64_t before = mfsdp::checkpoint_metadata_parse_count();
  pretrain_reads(comm, false, {"--load", dir + "/pretrain", "--train-iters", std::to_string(kIters + 2), "--use-checkpoint-opt_param-scheduler"});
  EXPECT_EQ(mfsdp::checkpoint_metadata_parse_count() - before, 1) << "mfsdp-pretrain --load";

  sft_reads(comm, false, {"--save", dir + "/sft", "--save-interval", "1000"});
  before = mfsdp::checkpoint_metadata_parse_count();
  sft_reads(comm, false, {"--load", dir + "/sft", "--train-iters", std::to_string(kIters + 2), "--use-checkpoint-opt_param-scheduler"});
  EXPECT_EQ(mfsdp::checkpoint_metadata_parse_count() - before, 1) << "mfsdp-sft --load";

  before = mfsdp::checkpoint_metadata_parse_count();
  grpo_reads(comm, false, {"--load", dir + "/sft", "--finetune", "--use-kl-loss", "--train-iters", "1"});
  EXPECT_EQ(mfsdp::checkpoint_metadata_parse_count() - before, 1) << "mfsdp-grpo --load --finetune --use-kl-loss";
}
