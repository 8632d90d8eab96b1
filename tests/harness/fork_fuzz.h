// A file fuzzer for readers of on-disk formats: mutates one file of a folder at a time and runs
// the reader in a forked child, so that a crash or a hang is counted instead of ending the test.
// Every mutated load must be refused (a std::exception) or return exactly the original values.
// Header-only, torch-free.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "harness/file_bytes.h"

namespace mfsdp::testing {

struct FuzzCounts {
  int mutations = 0;
  int refused = 0;   // an exception (with a message naming what is wrong)
  int original = 0;  // loaded, and the values equal the unmutated ones (the mutation hit no data)
  int silent = 0;    // loaded other values without an error: a corruption got through
  int crashed = 0;   // the reader died (signal, abort, an exception that is not std::exception)
  int hung = 0;      // no answer within the timeout
  std::string first_silent;  // which mutation, to reproduce it
  std::vector<std::string> harmless;  // the first few mutations that loaded the original values
};

// How a child reports: the load matched (0), an exception (10), other values (11).
enum : int { kLoadedOriginal = 0, kRefused = 10, kLoadedOther = 11, kOddException = 12 };

// Runs `load` in a child process: it returns true when what it read equals the original values.
inline int run_in_child(const std::function<bool()>& load, std::chrono::seconds timeout) {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    int code = kOddException;
    try {
      code = load() ? kLoadedOriginal : kLoadedOther;
    } catch (const std::exception&) {
      code = kRefused;
    } catch (...) {
    }
    ::_exit(code);
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return -1;  // hung
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  if (WIFSIGNALED(status)) return -2;  // crashed
  return WEXITSTATUS(status);
}

// One random mutation of `bytes` (which is not empty); `what` describes it.
inline std::string mutate(std::string bytes, std::mt19937& rng, std::string& what) {
  auto pick = [&](size_t n) { return n == 0 ? size_t{0} : static_cast<size_t>(rng() % n); };
  const size_t at = pick(bytes.size());
  const size_t run = 1 + pick(std::min<size_t>(64, bytes.size() - at));
  switch (rng() % 9) {
    case 0: {
      const int bit = static_cast<int>(rng() % 8);
      bytes[at] = static_cast<char>(bytes[at] ^ (1 << bit));
      what = "flip bit " + std::to_string(bit) + " of byte " + std::to_string(at);
      break;
    }
    case 1:
      bytes[at] = static_cast<char>(rng());
      what = "overwrite byte " + std::to_string(at);
      break;
    case 2:
      for (size_t k = 0; k < run; ++k) bytes[at + k] = static_cast<char>(rng());
      what = "overwrite bytes [" + std::to_string(at) + ", +" + std::to_string(run) + ")";
      break;
    case 3:
      for (size_t k = 0; k < run; ++k) bytes[at + k] = 0;
      what = "zero bytes [" + std::to_string(at) + ", +" + std::to_string(run) + ")";
      break;
    case 4:
      bytes.resize(at);
      what = "truncate to " + std::to_string(at) + " bytes";
      break;
    case 5:
      bytes.append(1 + pick(64), static_cast<char>(rng()));
      what = "append bytes";
      break;
    case 6:
      bytes.erase(at, run);
      what = "delete bytes [" + std::to_string(at) + ", +" + std::to_string(run) + ")";
      break;
    case 7:
      bytes.insert(at, run, static_cast<char>(rng()));
      what = "insert " + std::to_string(run) + " bytes at " + std::to_string(at);
      break;
    default: {  // copy a run over another place of the file: data in the wrong place, same size
      const size_t from = pick(bytes.size() - run + 1), to = pick(bytes.size() - run + 1);
      bytes.replace(to, run, bytes.substr(from, run));
      what = "copy bytes [" + std::to_string(from) + ", +" + std::to_string(run) + ") to " + std::to_string(to);
      break;
    }
  }
  return bytes;
}

// `rounds` mutations, each of one of `files` (chosen at random; restored afterwards), each
// loaded by `load` in a child. One round in 50 deletes the file instead.
inline FuzzCounts fuzz_files(const std::vector<std::string>& files, int rounds, unsigned seed,
                             const std::function<bool()>& load,
                             std::chrono::seconds timeout = std::chrono::seconds(20)) {
  std::vector<std::string> originals;
  for (const std::string& f : files) originals.push_back(slurp(f));
  std::mt19937 rng(seed);
  FuzzCounts c;
  for (int round = 0; round < rounds; ++round) {
    const size_t i = rng() % files.size();
    std::string what;
    if (rng() % 50 == 0 || originals[i].empty()) {
      std::filesystem::remove(files[i]);
      what = "delete the file";
    } else {
      const std::string m = mutate(originals[i], rng, what);
      if (m == originals[i]) continue;  // (a copy onto itself) not a mutation
      put(files[i], m);
    }
    ++c.mutations;
    switch (run_in_child(load, timeout)) {
      case kLoadedOriginal:
        if (c.original++ < 4) c.harmless.push_back(std::filesystem::path(files[i]).filename().string() + ": " + what);
        break;
      case kRefused: ++c.refused; break;
      case kLoadedOther:
        if (c.silent++ == 0) c.first_silent = files[i] + ": " + what + " (round " + std::to_string(round) + ")";
        break;
      case -1: ++c.hung; break;
      default: ++c.crashed; break;
    }
    put(files[i], originals[i]);
  }
  return c;
}

inline std::string describe(const FuzzCounts& c) {
  return std::to_string(c.mutations) + " mutations: " + std::to_string(c.refused) + " refused, " +
         std::to_string(c.original) + " loaded the original values, " + std::to_string(c.silent) + " silent, " +
         std::to_string(c.crashed) + " crashed, " + std::to_string(c.hung) + " hung";
}

// "e.g. x.bin: append bytes; ..." (what loaded the original values, for the log).
inline std::string harmless_examples(const FuzzCounts& c) {
  std::string s;
  for (const std::string& h : c.harmless) s += (s.empty() ? "  harmless, e.g.: " : "; ") + h;
  return s;
}

}  // namespace mfsdp::testing
