// LibTorch's wheels export the std::filesystem they link statically (pytorch/pytorch#133437;
// CMakeLists.txt names libstdc++ first in every program because of it). Where LibTorch's copy is
// the first definition in the process, libstdc++'s own remove_all builds a directory iterator with
// LibTorch's code and walks it with its own: on Ubuntu 24.04 every remove_all of a non-empty folder
// and every directory iteration crashed. These tests pin the binding and the behaviour.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <string>

#include "harness/temp_dir.h"

namespace {

namespace fs = std::filesystem;

// The iterator entry points that both libraries define (the C++11-ABI spellings).
const char* const kSymbols[] = {
    "_ZNSt10filesystem7__cxx1118directory_iteratorC1ERKNS0_4pathENS_17directory_optionsEPSt10error_code",
    "_ZNSt10filesystem7__cxx1118directory_iterator9incrementERSt10error_code",
    "_ZNSt10filesystem7__cxx1128recursive_directory_iteratorC1ERKNS0_4pathENS_17directory_optionsEPSt10error_code",
    "_ZNSt10filesystem7__cxx1128recursive_directory_iterator9incrementERSt10error_code",
    "_ZNSt10filesystem10remove_allERKNS_7__cxx114pathERSt10error_code",
};

std::string library_of(void* address) {
  Dl_info info{};
  if (address == nullptr || dladdr(address, &info) == 0 || info.dli_fname == nullptr) return "(none)";
  return info.dli_fname;
}

TEST(LibstdcxxBinding, FilesystemResolvesToLibstdcxxEvenWhereLibTorchExportsIt) {
  ASSERT_EQ(torch::ones({2}).sum().item<float>(), 2.0f);  // LibTorch is loaded and in use
  void* torch_cpu = dlopen("libtorch_cpu.so", RTLD_NOW | RTLD_NOLOAD);
  ASSERT_NE(torch_cpu, nullptr) << "libtorch_cpu.so is not loaded in this process";
  int exported_by_torch = 0;
  for (const char* symbol : kSymbols) {
    if (dlsym(torch_cpu, symbol) != nullptr && library_of(dlsym(torch_cpu, symbol)).find("libtorch") != std::string::npos)
      ++exported_by_torch;
    const std::string first = library_of(dlsym(RTLD_DEFAULT, symbol));
    EXPECT_NE(first.find("libstdc++"), std::string::npos)
        << symbol << ": the process's first definition is in " << first << ", not libstdc++";
  }
  dlclose(torch_cpu);
  // Nothing to protect against when this LibTorch exports none of them; say so in the log.
  std::cout << "libtorch_cpu.so exports " << exported_by_torch << " of " << std::size(kSymbols)
            << " of these symbols\n";
}

TEST(LibstdcxxBinding, IteratesAndRemovesANonEmptyTree) {
  mfsdp::testing::TempDir dir("libstdcxx");
  std::set<std::string> made;
  for (const std::string sub : {"a", "a/b", "a/b/c", "d"}) {
    fs::create_directories(dir.path() / sub);
    std::ofstream(dir.path() / sub / "file") << sub;
    made.insert(sub);
    made.insert(sub + "/file");
  }
  std::set<std::string> top, all;
  for (const auto& entry : fs::directory_iterator(dir.path())) top.insert(entry.path().filename().string());
  for (const auto& entry : fs::recursive_directory_iterator(dir.path()))
    all.insert(fs::relative(entry.path(), dir.path()).string());
  EXPECT_EQ(top, (std::set<std::string>{"a", "d"}));
  EXPECT_EQ(all, made);
  std::error_code error;
  EXPECT_EQ(fs::remove_all(dir.path() / "a", error), 6u) << error.message();
  EXPECT_FALSE(fs::exists(dir.path() / "a"));
  EXPECT_TRUE(fs::exists(dir.path() / "d" / "file"));
}

}  // namespace
