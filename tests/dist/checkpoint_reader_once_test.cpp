// A load opens its checkpoint once: the metadata (.metadata and its pickled "mfsdp_metadata", or
// metadata.json) is parsed once per rank per load, counted through the seam
// mfsdp::checkpoint_metadata_parse_count (include/mfsdp/checkpoint/checkpoint.h). The trainer's
// path (open_training_checkpoint, then load_training_checkpoint: model-config check, schedule and
// shards from one reader) and the library's (load_checkpoint from a reader or a path) are checked
// in real 2-rank runs; the loaded weights are compared with the unsharded model they were saved
// from, and the seam is shown to see a second open (the trainer's earlier way: a reader for the
// config check, then load_checkpoint of the path).
#include <torch/torch.h>

#include <functional>
#include <sstream>

#include "harness/dist_test.h"
#include "harness/expect_error.h"
#include "harness/uneven_net.h"
#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/fsdp/fully_shard.h"
#include "mfsdp/optim/optim.h"
#include "mfsdp/train/trainer_checkpoint.h"

namespace {

using mfsdp::testing::error_of;
using mfsdp::testing::expect_contains;
using Net = mfsdp::testing::UnevenNet;

constexpr int64_t kIteration = 3, kGlobalBatch = 4;

// How many times this process parsed a checkpoint's metadata while `fn` ran. A load through one
// reader is 1 on every rank (for the trainers' end-to-end checks too: wrap TrainingRun's start).
int64_t metadata_parses_during(const std::function<void()>& fn) {
  const int64_t before = mfsdp::checkpoint_metadata_parse_count();
  fn();
  return mfsdp::checkpoint_metadata_parse_count() - before;
}

Net make_net(uint64_t seed) {
  torch::manual_seed(seed);
  return Net();
}

struct Sharded {
  Net net;
  mfsdp::FsdpHandle root;
  std::unique_ptr<mfsdp::DistributedOptimizer> opt;
};

Sharded make_sharded(const std::shared_ptr<mfsdp::Communicator>& world, uint64_t seed) {
  Sharded m{make_net(seed), {}, nullptr};
  mfsdp::FullyShardOptions o;
  o.comm = world;
  for (auto& b : m.net->blocks) mfsdp::fully_shard(*b, o);
  m.root = mfsdp::fully_shard(*m.net, o);
  m.opt = mfsdp::make_adamw(m.root, mfsdp::AdamWOptions{});
  return m;
}

std::shared_ptr<mfsdp::Communicator> borrow(mfsdp::Communicator& comm) {
  return std::shared_ptr<mfsdp::Communicator>(&comm, [](mfsdp::Communicator*) {});
}

// The model of seed 42, as the trainer saves it (model config, schedule, progress), into
// SAVE/iter_0000003; returns SAVE.
std::string save_seed_42(const std::shared_ptr<mfsdp::Communicator>& world) {
  Sharded m = make_sharded(world, 42);
  const std::string save = mfsdp::testing::shared_temp_dir() + "/save";
  mfsdp::CheckpointInfo info;
  info.iteration = kIteration;
  info.consumed_samples = kIteration * kGlobalBatch;
  info.model_config = {{"hidden_size", 10}, {"num_hidden_layers", 2}};
  info.scheduler = {{"max_lr", 0.25}, {"min_lr", 0.0}, {"warmup_steps", 1}, {"decay_steps", 5}, {"style", "cosine"}};
  mfsdp::save_checkpoint(save, world, m.root, m.opt.get(), info);
  return save;
}

// The loaded model holds the weights of seed 42, which an unsharded model of that seed has.
void expect_seed_42(Sharded& m) {
  const Net reference = make_net(42);
  const auto full = m.root.full_state_dict(/*all_ranks=*/true);
  for (const auto& p : reference->named_parameters())
    EXPECT_TRUE(torch::equal(full.at(p.key()), p.value())) << p.key();
}

mfsdp::ModelConfig config_with_hidden_size(int64_t hidden) {
  mfsdp::ModelConfig config;
  config.hf = {{"hidden_size", hidden}, {"num_hidden_layers", 2}};
  return config;
}

}  // namespace

// --load SAVE through the trainer: one open, shared by the config check, the schedule and the shards.
MFSDP_DIST_TEST(CheckpointReaderOnce, TrainerLoadParsesTheMetadataOncePerRank, {2}) {
  auto world = borrow(comm);
  const std::string save = save_seed_42(world);
  Sharded m = make_sharded(world, 7);
  mfsdp::CheckpointSection checkpoint;
  checkpoint.load = save;
  checkpoint.use_checkpoint_opt_param_scheduler = true;
  mfsdp::TrainingSection training;
  training.global_batch_size = kGlobalBatch;
  mfsdp::LRSchedule schedule;
  std::ostringstream log;
  mfsdp::ResumePoint resume;
  const int64_t parses = metadata_parses_during([&] {
    const mfsdp::OpenedCheckpoint opened = mfsdp::open_training_checkpoint(checkpoint);
    ASSERT_NE(opened.reader, nullptr);
    EXPECT_EQ(opened.reader->dir(), mfsdp::checkpoint_iteration_dir(save, kIteration));
    resume = mfsdp::load_training_checkpoint(opened, checkpoint, training, config_with_hidden_size(10), world, m.root,
                                             *m.opt, schedule, log);
  });
  EXPECT_EQ(parses, 1) << "rank " << comm.rank();
  EXPECT_EQ(resume.iteration, kIteration);
  EXPECT_EQ(resume.consumed_samples, kIteration * kGlobalBatch);
  EXPECT_EQ(schedule.max_lr, 0.25);  // --use-checkpoint-opt_param-scheduler: the saved schedule
  EXPECT_EQ(schedule.style, "cosine");
  expect_seed_42(m);
  if (comm.rank() == 0) expect_contains(log.str(), {"loaded checkpoint", "resuming after iteration 3"});

  // --ckpt-step names the iteration; a model config that differs from the flags is refused
  // before any tensor is read, naming the checkpoint and the flag, still from one open.
  checkpoint.ckpt_step = kIteration;
  std::string error;
  EXPECT_EQ(metadata_parses_during([&] {
              const mfsdp::OpenedCheckpoint opened = mfsdp::open_training_checkpoint(checkpoint);
              error = error_of([&] {
                mfsdp::load_training_checkpoint(opened, checkpoint, training, config_with_hidden_size(12), world,
                                                m.root, *m.opt, schedule, log);
              });
            }),
            1);
  expect_contains(error, {mfsdp::checkpoint_iteration_dir(save, kIteration), "model_config.hidden_size is 10",
                          "this run has 12", "--hidden-size"});
}

// --load of a folder with no checkpoint: nothing is parsed, and the warning gives the reason the
// one resolution found.
MFSDP_DIST_TEST(CheckpointReaderOnce, TrainerLoadOfAnEmptyFolderOpensNothing, {2}) {
  auto world = borrow(comm);
  Sharded m = make_sharded(world, 7);
  mfsdp::CheckpointSection checkpoint;
  checkpoint.load = mfsdp::testing::shared_temp_dir();
  mfsdp::TrainingSection training;
  training.global_batch_size = kGlobalBatch;
  mfsdp::LRSchedule schedule;
  std::ostringstream log;
  mfsdp::ResumePoint resume{5, 5};
  EXPECT_EQ(metadata_parses_during([&] {
              const mfsdp::OpenedCheckpoint opened = mfsdp::open_training_checkpoint(checkpoint);
              EXPECT_EQ(opened.reader, nullptr);
              expect_contains(opened.missing, {"holds no checkpoint"});
              resume = mfsdp::load_training_checkpoint(opened, checkpoint, training, config_with_hidden_size(10),
                                                       world, m.root, *m.opt, schedule, log);
            }),
            0);
  EXPECT_EQ(resume.iteration, 0);
  if (comm.rank() == 0)
    expect_contains(log.str(), {"WARNING: --load " + checkpoint.load + " holds no checkpoint",
                                "training starts from scratch"});
  // A path that cannot be meant names the flag and the path.
  checkpoint.load = mfsdp::testing::shared_temp_dir();
  checkpoint.ckpt_step = 9;
  expect_contains(error_of([&] { mfsdp::open_training_checkpoint(checkpoint); }),
                  {"--load / --ckpt-step", checkpoint.load, "no checkpoint of step 9"});
}

// The library: load_checkpoint from a reader parses nothing more; from a path, once. The seam
// sees a second open, so the checks above fail for a load that opens the checkpoint twice (the
// trainer's earlier way: a reader for the config check, then load_checkpoint of the path).
MFSDP_DIST_TEST(CheckpointReaderOnce, LoadCheckpointParsesOnceFromAReaderOrAPath, {2}) {
  auto world = borrow(comm);
  const std::string save = save_seed_42(world);
  {
    Sharded m = make_sharded(world, 7);
    EXPECT_EQ(metadata_parses_during([&] {
                const mfsdp::CheckpointReader reader(save);
                const mfsdp::LoadedCheckpoint got = mfsdp::load_checkpoint(reader, world, m.root, m.opt.get());
                EXPECT_EQ(got.iteration, kIteration);
                EXPECT_EQ(got.path, reader.dir());
                EXPECT_TRUE(got.optimizer_loaded);
              }),
              1);
    expect_seed_42(m);
  }
  {
    Sharded m = make_sharded(world, 7);
    EXPECT_EQ(metadata_parses_during([&] { mfsdp::load_checkpoint(save, world, m.root, m.opt.get()); }), 1);
    expect_seed_42(m);
  }
  {
    Sharded m = make_sharded(world, 7);
    EXPECT_EQ(metadata_parses_during([&] {
                const mfsdp::CheckpointReader for_the_config(save);
                mfsdp::load_checkpoint(for_the_config.dir(), world, m.root, m.opt.get());
              }),
              2);
  }
  // A reader already names its iteration: an iteration in the options is refused, naming it.
  Sharded m = make_sharded(world, 7);
  const mfsdp::CheckpointReader reader(save);
  mfsdp::CheckpointLoadOptions options;
  options.iteration = kIteration;
  expect_contains(error_of([&] { mfsdp::load_checkpoint(reader, world, m.root, m.opt.get(), options); }),
                  {reader.dir(), "options.iteration"});
}
