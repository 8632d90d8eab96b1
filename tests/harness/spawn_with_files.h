// Starts a program with its stdout and stderr in files, for end-to-end tests of the tools that
// read a child's streams and exit status (and, with wait4, its resource use). Header-only and
// torch-free.
#pragma once

#include <fcntl.h>
#include <sys/types.h>
#include <unistd.h>

#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace mfsdp::testing {

// fork + execv(argv[0], argv) with stdout in `out_path` and stderr in `err_path`; `in_child`
// runs in the child just before exec (e.g. setrlimit). Returns the child's pid; the child exits
// 126 when a file cannot be opened and 127 when exec fails.
inline pid_t spawn_with_files(std::vector<std::string> argv, const std::string& out_path,
                              const std::string& err_path, const std::function<void()>& in_child = {}) {
  std::vector<char*> args;
  for (auto& s : argv) args.push_back(s.data());
  args.push_back(nullptr);
  const pid_t pid = fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    const int out = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int err = open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (out < 0 || err < 0) _exit(126);
    dup2(out, 1);
    dup2(err, 2);
    if (in_child) in_child();
    execv(args[0], args.data());
    _exit(127);
  }
  return pid;
}

}  // namespace mfsdp::testing
