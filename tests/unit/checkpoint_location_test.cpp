// locate_checkpoint (include/mfsdp/checkpoint/checkpoint.h), the one rule for what a checkpoint path names,
// on real checkpoints written by write_checkpoint in both formats: every kind of path, what is
// found or why nothing is, and the errors that name the path. The tools that apply it are
// tested end to end in tests/e2e/load_paths_test.cpp.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "harness/temp_dir.h"
#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/checkpoint/tensor_source.h"

namespace fs = std::filesystem;
using mfsdp::testing::TempDir;

namespace {

void save(const std::string& dir, int64_t iteration, mfsdp::CheckpointFormat format) {
  mfsdp::CheckpointInfo info;
  info.iteration = iteration;
  mfsdp::write_checkpoint(dir, {{"w", at::arange(6, at::kFloat) + static_cast<double>(iteration)}}, info, format);
}

// The error locate_checkpoint throws, which must name every `needles`.
void expect_invalid(const std::string& path, std::optional<int64_t> step, std::initializer_list<std::string> needles) {
  try {
    mfsdp::locate_checkpoint(path, step);
    ADD_FAILURE() << path << ": no error";
  } catch (const std::invalid_argument& e) {
    for (const std::string& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(CheckpointLocation, EveryKindOfPath) {
  TempDir dir("mfsdp-location");
  for (auto format : {mfsdp::CheckpointFormat::kFsdpDtensor, mfsdp::CheckpointFormat::kMfsdp}) {
    const std::string s = dir.file(format == mfsdp::CheckpointFormat::kMfsdp ? "earlier" : "dcp");
    save(s, 2, format);
    save(s, 5, format);
    // A save folder: its latest iteration, or the asked one.
    EXPECT_EQ(mfsdp::locate_checkpoint(s).dir, s + "/iter_0000005");
    EXPECT_EQ(mfsdp::locate_checkpoint(s, 2).dir, s + "/iter_0000002");
    // An iteration folder is itself, with or without a trailing slash, and its own step.
    EXPECT_EQ(mfsdp::locate_checkpoint(s + "/iter_0000002").dir, s + "/iter_0000002");
    EXPECT_EQ(mfsdp::locate_checkpoint(s + "/iter_0000002/").dir, s + "/iter_0000002/");
    EXPECT_EQ(mfsdp::locate_checkpoint(s + "/iter_0000002/", 2).dir, s + "/iter_0000002/");
    EXPECT_TRUE(mfsdp::is_checkpoint(s + "/iter_0000002"));
    EXPECT_TRUE(mfsdp::is_checkpoint(s));
    // The reader opens the same folder every tool does.
    EXPECT_EQ(mfsdp::CheckpointReader(s + "/iter_0000002").read("model.w")[0].item<float>(), 2.0f);
    EXPECT_EQ(mfsdp::CheckpointReader(s).read("model.w")[0].item<float>(), 5.0f);
    expect_invalid(s, 3, {s, "no checkpoint of step 3", "iter_0000003", "does not exist"});
    expect_invalid(s + "/iter_0000002", 5, {"iteration 2", "step 5 needs the save folder"});
  }
  // A folder a PyTorch dcp.save wrote has no latest file and any name: .metadata marks it.
  const std::string bare = dir.file("any_name");
  fs::rename(dir.file("dcp/iter_0000002"), bare);
  EXPECT_EQ(mfsdp::locate_checkpoint(bare).dir, bare);
  expect_invalid(bare, 2, {bare, "step 2 needs the save folder"});

  // Nothing there: not found, saying why.
  EXPECT_FALSE(mfsdp::locate_checkpoint(dir.file("missing")).found());
  EXPECT_EQ(mfsdp::locate_checkpoint(dir.file("missing")).reason, "does not exist");
  fs::create_directories(dir.file("empty/iter_0000001"));  // an iteration folder with no checkpoint in it
  EXPECT_FALSE(mfsdp::is_checkpoint(dir.file("empty")));
  EXPECT_NE(mfsdp::locate_checkpoint(dir.file("empty")).reason.find("holds no checkpoint"), std::string::npos);
  expect_invalid(dir.file("empty"), 1, {"no checkpoint of step 1", "holds no .metadata or metadata.json"});
  try {
    mfsdp::resolve_checkpoint_dir(dir.file("empty"));
    ADD_FAILURE() << "resolve_checkpoint_dir of an empty folder";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(dir.file("empty") + "' holds no checkpoint"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("save folder"), std::string::npos) << e.what();
  }

  // What cannot be meant is an error naming the path.
  expect_invalid(dir.file("dcp/latest_checkpointed_iteration.txt"), std::nullopt, {"is a file, not a folder"});
  EXPECT_FALSE(mfsdp::is_checkpoint(dir.file("dcp/latest_checkpointed_iteration.txt")));
  std::ofstream(dir.file("empty/latest_checkpointed_iteration.txt")) << "seven\n";
  expect_invalid(dir.file("empty"), std::nullopt, {"should hold an iteration number, found 'seven'"});
  std::ofstream(dir.file("empty/latest_checkpointed_iteration.txt")) << "1\n";
  expect_invalid(dir.file("empty"), std::nullopt, {"names iteration 1", "holds no .metadata or metadata.json"});
  expect_invalid(dir.file("dcp"), -2, {"the step must be >= 0"});
}

TEST(CheckpointLocation, AnInterruptedCommitsAsideFolderIsRead) {
  // A commit that could not swap folders atomically moves the old one to iter_N.old first
  // (docs/checkpoints.md, "Atomic saves"); until the new one is in place readers use the old.
  TempDir dir("mfsdp-location");
  const std::string s = dir.file("save");
  save(s, 4, mfsdp::CheckpointFormat::kFsdpDtensor);
  fs::rename(s + "/iter_0000004", s + "/iter_0000004.old");
  EXPECT_EQ(mfsdp::locate_checkpoint(s).dir, s + "/iter_0000004.old");
  EXPECT_EQ(mfsdp::locate_checkpoint(s, 4).dir, s + "/iter_0000004.old");
}
