// Crash-safe commits (docs/checkpoints.md, "Atomic saves"): a save that dies between any two
// file-system steps of its commit leaves `latest` naming a folder that reads whole, the old
// checkpoint or the new one, and the next save of that iteration recovers. The crash is injected
// through the CheckpointFileSystem seam (include/mfsdp/checkpoint/checkpoint.h): the step that should run
// throws instead, and nothing after it runs, as if the process had died there.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <stdexcept>
#include <string>

#include "checkpoint/checkpoint_files.h"
#include "harness/temp_dir.h"
#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/base/directory_tree.h"

namespace fs = std::filesystem;

namespace {

struct InjectedCrash : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Runs the real steps until step number `die_at` (0-based), which throws instead.
class DieAtStep : public mfsdp::CheckpointFileSystem {
 public:
  DieAtStep(int die_at, bool can_exchange) : die_at_(die_at), can_exchange_(can_exchange) {}

  void write_file_atomically(const std::string& path, const std::string& bytes) override {
    step("write " + path);
    CheckpointFileSystem::write_file_atomically(path, bytes);
  }
  void rename(const std::string& from, const std::string& to) override {
    step("rename " + from);
    CheckpointFileSystem::rename(from, to);
  }
  bool exchange(const std::string& a, const std::string& b) override {
    if (!can_exchange_) return false;  // as on a file system without RENAME_EXCHANGE
    step("exchange " + a);
    return exchanged_ = CheckpointFileSystem::exchange(a, b);
  }
  void remove_all(const std::string& path) override {
    step("remove " + path);
    CheckpointFileSystem::remove_all(path);
  }
  void sync_directory(const std::string& dir) override {
    step("sync " + dir);
    CheckpointFileSystem::sync_directory(dir);
  }

  int steps() const { return steps_; }
  bool exchanged() const { return exchanged_; }

 private:
  void step(const std::string& what) {
    if (steps_++ == die_at_) throw InjectedCrash("injected crash before: " + what);
  }
  int die_at_;
  bool can_exchange_;
  int steps_ = 0;
  bool exchanged_ = false;
};

std::string read_file(const fs::path& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_file(const fs::path& path, const std::string& text) { std::ofstream(path) << text; }

// SAVE/iter_N with `payload` (each file "a" and "b" holding it, so a half-moved folder shows).
void make_iteration(const fs::path& dir, const std::string& payload) {
  fs::create_directories(dir);
  write_file(dir / "a", payload);
  write_file(dir / "b", payload);
}

// What a reader finds for `latest`: its iteration and the payload of the folder it reads.
std::pair<int64_t, std::string> read_latest(const std::string& save) {
  auto latest = mfsdp::latest_checkpoint_iteration(save);
  if (!latest) return {-1, "no latest"};
  const fs::path dir = mfsdp::checkpoint::readable_iteration_dir(save, *latest);
  if (!fs::exists(dir)) return {*latest, "missing folder " + dir.string()};
  const std::string a = read_file(dir / "a"), b = read_file(dir / "b");
  return {*latest, a == b ? a : "torn: " + a + " / " + b};
}

struct Outcome {
  int steps = 0;             // steps of the commit that completed without a crash
  std::set<std::string> seen;  // "<latest> <payload>" after each crash
  bool exchanged = false;
};

// Commits iteration `iteration` (payload "new") over a save whose latest is `previous` (payload
// "old"), dying at every step in turn; after each crash checks what a reader finds and that the
// next save (payload "again") commits cleanly.
Outcome crash_at_every_step(const std::string& root, int64_t previous, int64_t iteration, bool can_exchange) {
  Outcome out;
  for (int die_at = 0;; ++die_at) {
    const std::string save = root + "/crash_" + std::to_string(die_at);
    make_iteration(mfsdp::checkpoint_iteration_dir(save, previous), "old");
    write_file(save + "/latest_checkpointed_iteration.txt", std::to_string(previous) + "\n");
    const std::string final_dir = mfsdp::checkpoint_iteration_dir(save, iteration);
    make_iteration(final_dir + ".tmp", "new");

    auto files = std::make_shared<DieAtStep>(die_at, can_exchange);
    mfsdp::set_checkpoint_file_system(files);
    bool crashed = false;
    try {
      mfsdp::checkpoint::commit_checkpoint(save, final_dir + ".tmp", final_dir, iteration);
    } catch (const InjectedCrash&) {
      crashed = true;
    }
    mfsdp::set_checkpoint_file_system(nullptr);
    out.exchanged = out.exchanged || files->exchanged();

    auto [latest, payload] = read_latest(save);
    const std::string state = std::to_string(latest) + " " + payload;
    SCOPED_TRACE("crash at step " + std::to_string(die_at) + ": " + state);
    EXPECT_TRUE(latest == previous || latest == iteration);
    EXPECT_TRUE(payload == "old" || payload == "new");
    if (!crashed) {
      EXPECT_EQ(state, std::to_string(iteration) + " new") << "a commit that completes names the new save";
      EXPECT_FALSE(fs::exists(final_dir + ".tmp"));
      EXPECT_FALSE(fs::exists(final_dir + ".old"));
      out.steps = files->steps();
      return out;
    }
    out.seen.insert(state);

    // The next save of that iteration (after the trainer's prepare_tmp_dir) recovers.
    mfsdp::remove_tree(final_dir + ".tmp");
    make_iteration(final_dir + ".tmp", "again");
    mfsdp::checkpoint::commit_checkpoint(save, final_dir + ".tmp", final_dir, iteration);
    EXPECT_EQ(read_latest(save), std::make_pair(iteration, std::string("again")));
    EXPECT_FALSE(fs::exists(final_dir + ".old"));
    EXPECT_EQ(read_file(fs::path(final_dir) / "a"), "again");
    if (die_at > 64) {
      ADD_FAILURE() << "the commit never completed";
      return out;
    }
  }
}

}  // namespace

TEST(CheckpointCommit, ReplacingAnIterationSurvivesACrashAtEveryStepWithExchange) {
  mfsdp::testing::TempDir tmp("checkpoint_commit");
  const std::string root = tmp.path().string();
  Outcome o = crash_at_every_step(root, 5, 5, /*can_exchange=*/true);
  EXPECT_GE(o.steps, 7) << "every step goes through the seam";
  EXPECT_TRUE(o.seen.count("5 old")) << "crashes before the swap read the old save";
  EXPECT_TRUE(o.seen.count("5 new")) << "crashes after the swap read the new save";
  std::cout << "RENAME_EXCHANGE used: " << (o.exchanged ? "yes" : "no (file system without it)") << "\n";
}

TEST(CheckpointCommit, ReplacingAnIterationSurvivesACrashAtEveryStepWithoutExchange) {
  // The old folder is moved aside before its successor takes its name: in between, readers use
  // iter_N.old (a reader that did not would find `latest` naming a missing folder).
  mfsdp::testing::TempDir tmp("checkpoint_commit");
  const std::string root = tmp.path().string();
  Outcome o = crash_at_every_step(root, 5, 5, /*can_exchange=*/false);
  EXPECT_GE(o.steps, 8);
  EXPECT_TRUE(o.seen.count("5 old"));
  EXPECT_TRUE(o.seen.count("5 new"));
}

TEST(CheckpointCommit, ANewIterationSurvivesACrashAtEveryStep) {
  mfsdp::testing::TempDir tmp("checkpoint_commit");
  const std::string root = tmp.path().string();
  Outcome o = crash_at_every_step(root, 4, 5, /*can_exchange=*/true);
  EXPECT_GE(o.steps, 5);
  EXPECT_TRUE(o.seen.count("4 old")) << "before `latest` is rewritten it names the previous save";
  EXPECT_TRUE(o.seen.count("5 new")) << "the rewrite of `latest` is the commit point";
}

// A save that fails (here: its metadata write, as on a full disk) removes its iter_N.tmp at once;
// whatever unfinished saves left behind anyway (a killed process: another iteration's .tmp folder,
// a half-written `latest`) goes at the start of the next save. Committed folders and files that
// only look similar stay.
TEST(CheckpointCommit, UnfinishedSavesAreCleanedUp) {
  mfsdp::testing::TempDir dir("mfsdp-unfinished");
  const std::string save = dir.file("save");
  const std::map<std::string, at::Tensor> weights = {{"w", at::ones({4})}};
  mfsdp::CheckpointInfo info;
  info.iteration = 2;
  mfsdp::set_checkpoint_file_system(std::make_shared<DieAtStep>(0, true));
  EXPECT_THROW(mfsdp::write_checkpoint(save, weights, info), InjectedCrash);
  mfsdp::set_checkpoint_file_system(nullptr);
  EXPECT_FALSE(fs::exists(save + "/iter_0000002.tmp")) << "a failed save keeps its bytes on the disk";

  make_iteration(save + "/iter_0000003.tmp", std::string(1 << 20, 'x'));  // a killed save
  write_file(save + "/latest_checkpointed_iteration.txt.tmp.4242", "3\n");
  make_iteration(save + "/iter_0000001", "committed");
  write_file(save + "/notes.tmp", "the user's");
  info.iteration = 4;
  mfsdp::write_checkpoint(save, weights, info);
  EXPECT_FALSE(fs::exists(save + "/iter_0000003.tmp"));
  EXPECT_FALSE(fs::exists(save + "/latest_checkpointed_iteration.txt.tmp.4242"));
  EXPECT_TRUE(fs::exists(save + "/iter_0000001/a"));
  EXPECT_TRUE(fs::exists(save + "/notes.tmp"));
  EXPECT_TRUE(fs::exists(save + "/iter_0000004/.metadata"));
  EXPECT_EQ(mfsdp::latest_checkpoint_iteration(save).value_or(-1), 4);
}
