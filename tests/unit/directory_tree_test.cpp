// mfsdp's folder walks (include/mfsdp/base/directory_tree.h) against what the tree holds by
// construction, and against find(1) for what a tree holds.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>

#include "harness/temp_dir.h"
#include "mfsdp/base/directory_tree.h"

namespace {

namespace fs = std::filesystem;
using mfsdp::testing::TempDir;

std::string read_text(const fs::path& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Files a, b/c, b/d/e (each holding its own name), the empty folder f, and the link g -> b.
void make_tree(const fs::path& root) {
  fs::create_directories(root / "b" / "d");
  fs::create_directories(root / "f");
  for (const std::string file : {"a", "b/c", "b/d/e"}) std::ofstream(root / file) << file;
  fs::create_symlink("b", root / "g");
}

// Every entry under `root` as "relative path:kind", from find(1), not from the code under test.
std::set<std::string> find_entries(const fs::path& root) {
  const std::string cmd = "cd '" + root.string() + "' && find . -mindepth 1 -printf '%P:%y\\n' > ../listing.txt";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream in(root.parent_path() / "listing.txt");
  std::set<std::string> out;
  for (std::string line; std::getline(in, line);) out.insert(line);
  return out;
}

TEST(DirectoryTree, ListsTheNamesSortedWithoutDotEntries) {
  TempDir dir("tree");
  make_tree(dir.path());
  EXPECT_EQ(mfsdp::list_directory(dir.path()), (std::vector<std::string>{"a", "b", "f", "g"}));
  EXPECT_EQ(mfsdp::list_directory(dir.path() / "b"), (std::vector<std::string>{"c", "d"}));
  EXPECT_TRUE(mfsdp::list_directory(dir.path() / "f").empty());
  try {
    mfsdp::list_directory(dir.path() / "missing");
    ADD_FAILURE() << "listing a missing folder did not throw";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find((dir.path() / "missing").string()), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("No such file or directory"), std::string::npos) << e.what();
  }
  EXPECT_THROW(mfsdp::list_directory(dir.path() / "a"), std::runtime_error);  // a file
}

TEST(DirectoryTree, RemovesEverythingUnderAFolderButNotWhatALinkPointsTo) {
  TempDir dir("tree");
  const fs::path root = dir.path() / "root";
  make_tree(root);
  fs::create_directories(dir.path() / "outside");
  std::ofstream(dir.path() / "outside" / "kept") << "kept";
  fs::create_symlink(dir.path() / "outside", root / "b" / "out");
  EXPECT_EQ(find_entries(root).size(), 8u);
  EXPECT_EQ(mfsdp::remove_tree(root.string()), 9u);  // the 8 entries and root itself
  EXPECT_FALSE(fs::exists(fs::symlink_status(root)));
  EXPECT_EQ(read_text(dir.path() / "outside" / "kept"), "kept");
  EXPECT_EQ(mfsdp::remove_tree(root.string()), 0u);  // already gone: nothing to do
  // A single file, and a link (removed itself, its target kept).
  fs::create_symlink(dir.path() / "outside" / "kept", dir.path() / "link");
  EXPECT_EQ(mfsdp::remove_tree((dir.path() / "link").string()), 1u);
  EXPECT_EQ(mfsdp::remove_tree((dir.path() / "outside" / "kept").string()), 1u);
  EXPECT_TRUE(mfsdp::list_directory(dir.path() / "outside").empty());
}

TEST(DirectoryTree, RemoveFailuresNameTheEntry) {
  TempDir dir("tree");
  make_tree(dir.path());
  const std::string under_a_file = (dir.path() / "a" / "x").string();  // lstat: not a directory
  std::error_code error;
  EXPECT_EQ(mfsdp::remove_tree(under_a_file, error), 0u);
  EXPECT_EQ(error, std::errc::not_a_directory) << error.message();
  try {
    mfsdp::remove_tree(under_a_file);
    ADD_FAILURE() << "removing a path under a file did not throw";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(under_a_file), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("Not a directory"), std::string::npos) << e.what();
  }
  EXPECT_EQ(read_text(dir.path() / "a"), "a");  // nothing else touched
}

TEST(DirectoryTree, CopiesTheTreeLikeCpRecursive) {
  TempDir dir("tree");
  make_tree(dir.path() / "from");
  mfsdp::copy_tree((dir.path() / "from").string(), (dir.path() / "new" / "to").string());
  EXPECT_EQ(find_entries(dir.path() / "new" / "to"), find_entries(dir.path() / "from"));
  EXPECT_EQ(read_text(dir.path() / "new" / "to" / "b" / "d" / "e"), "b/d/e");
  EXPECT_EQ(fs::read_symlink(dir.path() / "new" / "to" / "g"), "b");  // a link stays a link
  // Into an existing folder: files there are overwritten, others kept.
  fs::create_directories(dir.path() / "into");
  std::ofstream(dir.path() / "into" / "a") << "old";
  std::ofstream(dir.path() / "into" / "z") << "z";
  mfsdp::copy_tree((dir.path() / "from").string(), (dir.path() / "into").string());
  EXPECT_EQ(read_text(dir.path() / "into" / "a"), "a");
  EXPECT_EQ(read_text(dir.path() / "into" / "z"), "z");
  EXPECT_THROW(mfsdp::copy_tree((dir.path() / "missing").string(), (dir.path() / "x").string()), std::runtime_error);
}

}  // namespace
