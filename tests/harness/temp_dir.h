// A fresh directory under the system temp dir, removed with everything in it at scope exit.
// Torch-free (mfsdp_data's remove_tree removes it), for every kind of test.
#pragma once

#include <stdlib.h>

#include <filesystem>
#include <stdexcept>
#include <string>
#include <system_error>

#include "mfsdp/base/directory_tree.h"

namespace mfsdp::testing {

class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "mfsdp") {
    std::string pattern = (std::filesystem::temp_directory_path() / (prefix + "-XXXXXX")).string();
    if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed for " + pattern);
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ignored;
    mfsdp::remove_tree(path_.string(), ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  // Path of `name` inside the directory.
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

}  // namespace mfsdp::testing
