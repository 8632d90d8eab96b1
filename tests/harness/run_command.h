// Runs a shell command and captures its output, for end-to-end tests of the tools.
// Header-only and torch-free.
#pragma once

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

namespace mfsdp::testing {

struct CommandOutcome {
  int exit_code = -1;  // 128 + signal when killed by one
  std::string output;  // stdout and stderr together
};

inline CommandOutcome run_command(const std::string& command) {
  CommandOutcome r;
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (!pipe) return r;
  std::array<char, 4096> buf{};
  while (fgets(buf.data(), buf.size(), pipe)) r.output += buf.data();
  int status = pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

}  // namespace mfsdp::testing
