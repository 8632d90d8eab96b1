// Asynchronous saves (AsyncCheckpointSaver, --async-save) in real 2-rank jobs, with the
// synchronous save_checkpoint as the independent reference: an asynchronous save is the same
// bytes as the synchronous one of the same state even though training changes the shards while
// it is written, it loads and resumes bit for bit; a write that fails on the writer thread is
// reported on every rank at the next save, naming the rank and the file, and commits nothing; a
// rank killed in the middle of its write leaves `latest` at the previous whole checkpoint, and
// the next save cleans up and commits.
#include <gtest/gtest-spi.h>
#include <torch/torch.h>

#include <atomic>
#include <csignal>
#include <filesystem>
#include <thread>

#include "harness/dist_test.h"
#include "harness/expect_error.h"
#include "harness/file_bytes.h"
#include "harness/temp_dir.h"
#include "harness/uneven_net.h"
#include "mfsdp/checkpoint/async_save.h"
#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/base/directory_tree.h"
#include "mfsdp/fsdp/fully_shard.h"
#include "mfsdp/optim/optim.h"

namespace {

using namespace torch;
using mfsdp::testing::error_of;
using mfsdp::testing::expect_contains;
namespace fs = std::filesystem;

using Net = mfsdp::testing::UnevenNet;

constexpr int64_t kGlobalBatch = 12;
constexpr double kLr = 0.05;

struct Sharded {
  Net net;
  mfsdp::FsdpHandle root;
  std::unique_ptr<mfsdp::DistributedOptimizer> opt;
};

Sharded make_sharded(const std::shared_ptr<mfsdp::Communicator>& world) {
  torch::manual_seed(42);
  Sharded m{Net(), {}, nullptr};
  mfsdp::FullyShardOptions o;
  o.comm = world;
  o.strategy = mfsdp::ShardingStrategy::kOptimGradsParams;
  for (auto& b : m.net->blocks) mfsdp::fully_shard(*b, o);
  m.root = mfsdp::fully_shard(*m.net, o);
  m.opt = mfsdp::make_adamw(m.root, mfsdp::AdamWOptions{});
  return m;
}

// Steps [first, first + steps) on this rank's rows of the global batch.
void train(mfsdp::Communicator& comm, Sharded& m, int first, int steps) {
  const int64_t rows = kGlobalBatch / comm.size();
  for (int step = first; step < first + steps; ++step) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + step);
    Tensor x = at::randn({kGlobalBatch, 7}, gen), y = at::randn({kGlobalBatch, 3}, gen);
    Tensor loss = torch::mse_loss(mfsdp::call(*m.net, x.narrow(0, comm.rank() * rows, rows), true),
                                  y.narrow(0, comm.rank() * rows, rows));
    loss.backward();
    m.opt->step(kLr);
    m.root.zero_grad();
  }
}

std::shared_ptr<mfsdp::Communicator> borrow(mfsdp::Communicator& comm) {
  return std::shared_ptr<mfsdp::Communicator>(&comm, [](mfsdp::Communicator*) {});
}

mfsdp::CheckpointInfo info_of(int64_t iteration) {
  mfsdp::CheckpointInfo info;
  info.iteration = iteration;
  info.consumed_samples = iteration * kGlobalBatch;
  return info;
}

// Every model and optimizer value of this rank, flattened, for exact comparisons.
std::vector<Tensor> state_of(const Sharded& m) {
  std::vector<Tensor> out;
  for (const auto& s : m.root.local_shards()) out.push_back(s.local.clone());
  for (const auto& [key, tensors] : m.opt->state())
    for (const auto& t : tensors) out.push_back(t.clone());
  return out;
}

bool same_bits(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!a[i].equal(b[i])) return false;
  return true;
}

std::string latest_text(const std::string& save) { return mfsdp::testing::slurp(save + "/latest_checkpointed_iteration.txt"); }

// Shard-file writes of one iteration on one rank fail after `after` of them went through, as a
// full disk or an I/O error would (the writer thread sees the error).
class FailingShardWrites : public mfsdp::CheckpointFileSystem {
 public:
  FailingShardWrites(std::string file, int after, bool kill) : file_(std::move(file)), after_(after), kill_(kill) {}
  void append_to_shard(int fd, const std::string& path, const char* data, size_t length) override {
    if (path.size() >= file_.size() && path.compare(path.size() - file_.size(), file_.size(), file_) == 0 &&
        seen_++ >= after_) {
      if (kill_) std::raise(SIGKILL);  // the rank dies in the middle of its file
      throw std::runtime_error("writing '" + path + "' failed: No space left on device (injected)");
    }
    CheckpointFileSystem::append_to_shard(fd, path, data, length);
  }

 private:
  std::string file_;
  int after_;
  bool kill_;
  int seen_ = 0;
};

// Shard-file writes wait until the test opens the gate: the writer thread provably runs after
// training has changed every shard.
class GatedShardWrites : public mfsdp::CheckpointFileSystem {
 public:
  void append_to_shard(int fd, const std::string& path, const char* data, size_t length) override {
    while (!open_.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    CheckpointFileSystem::append_to_shard(fd, path, data, length);
  }
  void open() { open_ = true; }

 private:
  std::atomic<bool> open_{false};
};

}  // namespace

// The same state saved both ways is the same bytes, although the asynchronous save's shards are
// trained on while its writer runs; it loads, and resuming from it continues bit for bit.
MFSDP_DIST_TEST(AsyncSave, IsTheSyncSaveByteForByteAndResumesBitExactly, {2}) {
  auto world = borrow(comm);
  const std::string dir = mfsdp::testing::shared_temp_dir();
  Sharded m = make_sharded(world);
  train(comm, m, 0, 2);
  const std::vector<Tensor> at_save = state_of(m);
  mfsdp::save_checkpoint(dir + "/sync", world, m.root, m.opt.get(), info_of(2));
  mfsdp::AsyncCheckpointSaver saver;
  auto gate = std::make_shared<GatedShardWrites>();
  mfsdp::set_checkpoint_file_system(gate);
  saver.save(dir + "/async", world, m.root, m.opt.get(), info_of(2));
  EXPECT_TRUE(saver.in_flight());
  EXPECT_GT(saver.staging_bytes(), 0);
  train(comm, m, 2, 2);  // changes every shard before the writer writes a byte
  gate->open();
  const std::vector<Tensor> after = state_of(m);
  // Megatron's per-iteration check: every rank gets the same answer, so they commit together.
  std::optional<int64_t> committed;
  while (!(committed = saver.try_finish(world))) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(*committed, 2);
  EXPECT_FALSE(saver.in_flight());
  EXPECT_FALSE(saver.finish(world).has_value()) << "nothing is left in flight";
  mfsdp::set_checkpoint_file_system(nullptr);
  comm.barrier();

  if (comm.rank() == 0) {
    EXPECT_EQ(latest_text(dir + "/async"), "2\n");
    const std::string a = dir + "/sync/iter_0000002", b = dir + "/async/iter_0000002";
    std::vector<std::string> names = mfsdp::list_directory(a);
    EXPECT_EQ(names, mfsdp::list_directory(b));
    EXPECT_EQ(names.size(), 4u) << "two rank files, .metadata, .checksums.json";
    for (const std::string& name : names)
      EXPECT_TRUE(mfsdp::testing::slurp(a + "/" + name) == mfsdp::testing::slurp(b + "/" + name))
          << name << " differs between the synchronous and the asynchronous save";
    mfsdp::CheckpointReader reader(dir + "/async");
    EXPECT_GT(reader.verify_checksums().first, 0);
  }
  comm.barrier();

  Sharded resumed = make_sharded(world);
  EXPECT_EQ(mfsdp::load_checkpoint(dir + "/async", world, resumed.root, resumed.opt.get()).iteration, 2);
  EXPECT_TRUE(same_bits(state_of(resumed), at_save)) << "the asynchronous save holds iteration 2's values";
  train(comm, resumed, 2, 2);
  EXPECT_TRUE(same_bits(state_of(resumed), after)) << "resuming from the asynchronous save is not bit-exact";
}

// A write that fails on rank 1's writer thread is not lost: the next save throws on every rank,
// naming rank 1 and its file, commits nothing and cleans up; the save after that commits.
MFSDP_DIST_TEST(AsyncSave, AFailedBackgroundWriteIsReportedAtTheNextSave, {2}) {
  auto world = borrow(comm);
  const std::string save = mfsdp::testing::shared_temp_dir() + "/ckpt";
  Sharded m = make_sharded(world);
  mfsdp::AsyncCheckpointSaver saver;
  train(comm, m, 0, 2);
  saver.save(save, world, m.root, m.opt.get(), info_of(2));
  train(comm, m, 2, 2);
  if (comm.rank() == 1)
    mfsdp::set_checkpoint_file_system(std::make_shared<FailingShardWrites>("iter_0000004.tmp/__1_0.distcp", 1, false));
  saver.save(save, world, m.root, m.opt.get(), info_of(4));  // commits 2; 4 starts and fails in the background
  EXPECT_EQ(latest_text(save), "2\n");
  train(comm, m, 4, 2);
  const std::string error = error_of([&] { saver.save(save, world, m.root, m.opt.get(), info_of(6)); });
  mfsdp::set_checkpoint_file_system(nullptr);
  if (comm.rank() == 0)
    expect_contains(error, {"save_checkpoint: writing shard files failed on rank 1", "iter_0000004.tmp/__1_0.distcp",
                            "No space left on device (injected)"});
  else
    expect_contains(error, {"iter_0000004.tmp/__1_0.distcp", "No space left on device (injected)"});
  EXPECT_FALSE(saver.in_flight()) << "the failed save is over; iteration 6 was not started";
  comm.barrier();
  EXPECT_EQ(latest_text(save), "2\n");
  EXPECT_FALSE(fs::exists(save + "/iter_0000004"));
  EXPECT_FALSE(fs::exists(save + "/iter_0000004.tmp")) << "a failed save keeps its bytes on the disk";
  comm.barrier();

  saver.save(save, world, m.root, m.opt.get(), info_of(6));
  EXPECT_EQ(saver.finish(world), 6);
  EXPECT_EQ(latest_text(save), "6\n");
  Sharded resumed = make_sharded(world);
  EXPECT_EQ(mfsdp::load_checkpoint(save, world, resumed.root, resumed.opt.get()).iteration, 6);
  EXPECT_TRUE(same_bits(state_of(resumed), state_of(m)));
}

namespace {

void save_then_die(mfsdp::Communicator& comm) {
  auto world = borrow(comm);
  const std::string save = mfsdp::testing::shared_temp_dir() + "/ckpt";
  Sharded m = make_sharded(world);
  mfsdp::AsyncCheckpointSaver saver;
  train(comm, m, 0, 2);
  saver.save(save, world, m.root, m.opt.get(), info_of(2));
  train(comm, m, 2, 2);
  if (comm.rank() == 1)
    mfsdp::set_checkpoint_file_system(std::make_shared<FailingShardWrites>("iter_0000004.tmp/__1_0.distcp", 1, true));
  saver.save(save, world, m.root, m.opt.get(), info_of(4));
  train(comm, m, 4, 1);
  saver.finish(world);  // rank 1 is gone: this cannot complete
  ADD_FAILURE() << "the save of iteration 4 completed although rank 1 was killed while writing it";
}

void resume_and_save(mfsdp::Communicator& comm) {
  auto world = borrow(comm);
  const std::string save = mfsdp::testing::shared_temp_dir() + "/ckpt";
  Sharded m = make_sharded(world);
  EXPECT_EQ(mfsdp::load_checkpoint(save, world, m.root, m.opt.get()).iteration, 2);
  train(comm, m, 2, 2);
  mfsdp::AsyncCheckpointSaver saver;
  saver.save(save, world, m.root, m.opt.get(), info_of(4));
  EXPECT_EQ(saver.finish(world), 4);
  EXPECT_EQ(latest_text(save), "4\n");
  EXPECT_FALSE(fs::exists(save + "/iter_0000004.tmp"));
}

}  // namespace

// A rank killed (SIGKILL, from inside its writer thread, in the middle of its file) leaves
// `latest` naming the previous checkpoint, whole and verified; the next job resumes from it and
// its first save removes the unfinished folder and commits.
TEST(AsyncSave, ARankKilledMidWriteLeavesLatestAtThePreviousWholeCheckpoint) {
  mfsdp::testing::TempDir base("mfsdp-async-kill");
  mfsdp::testing::DistOptions die = mfsdp::testing::short_timeout({2});
  die.phase = "die";
  die.shared_dir = base.path().string();
  mfsdp::testing::DistOptions resume = die;
  resume.phase = "resume";
  if (mfsdp::testing::is_rank_process()) {  // a rank of one of the two jobs
    mfsdp::testing::run_distributed(die, save_then_die);
    mfsdp::testing::run_distributed(resume, resume_and_save);
    return;
  }
  ::testing::TestPartResultArray failures;  // the first job must fail: rank 1 is killed
  {
    ::testing::ScopedFakeTestPartResultReporter intercept(
        ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &failures);
    mfsdp::testing::run_distributed(die, save_then_die);
  }
  ASSERT_EQ(failures.size(), 1);
  expect_contains(failures.GetTestPartResult(0).message(), {"rank 1 (pid", "was killed by signal"});
  const std::string save = base.file("ckpt");
  EXPECT_EQ(latest_text(save), "2\n");
  EXPECT_TRUE(fs::is_directory(save + "/iter_0000004.tmp")) << "rank 1 died before anything was committed";
  EXPECT_FALSE(fs::exists(save + "/iter_0000004"));
  mfsdp::CheckpointReader reader(save);
  EXPECT_EQ(reader.metadata()["iteration"], 2);
  EXPECT_GT(reader.verify_checksums().first, 0);

  mfsdp::testing::run_distributed(resume, resume_and_save);
}
