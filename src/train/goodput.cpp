#include "mfsdp/train/goodput.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace mfsdp {

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

ProgressFile::ProgressFile(bool writer) {
  const char* path = std::getenv("MFSDP_PROGRESS_FILE");
  if (path == nullptr || *path == '\0') return;
  path_ = path;
  writer_ = writer;
  std::ifstream in(path_);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string kind;
    int64_t n = 0;
    double t = 0;
    // A line cut short by a rank's death reads as malformed and is skipped.
    if (!(fields >> kind >> n)) continue;
    // The last start's iterations: an earlier start's were lost, or redone, already.
    if (kind == "start") last_done_before_.reset();
    if (kind == "iteration" && fields >> t && (!last_done_before_ || n > *last_done_before_)) last_done_before_ = n;
  }
}

void ProgressFile::append(const std::string& line) {
  if (!writer_) return;
  // One write per line, appended and flushed at once: a reader sees whole lines (a crash can cut
  // only the last one).
  if (FILE* f = std::fopen(path_.c_str(), "a")) {
    std::fputs(line.c_str(), f);
    std::fclose(f);
  }
}

void ProgressFile::started(int restart, int64_t resumed_after) {
  char line[96];
  std::snprintf(line, sizeof line, "start %d %lld %.3f\n", restart, static_cast<long long>(resumed_after),
                unix_seconds());
  append(line);
}

void ProgressFile::finished(int64_t iteration) {
  char line[64];
  std::snprintf(line, sizeof line, "iteration %lld %.3f\n", static_cast<long long>(iteration), unix_seconds());
  append(line);
}

RestartCost restart_cost(int restart, int64_t resumed_after, const ProgressFile& progress) {
  RestartCost cost;
  cost.restart = restart;
  cost.resumed_after = resumed_after;
  if (progress.last_done_before())
    cost.lost_iterations = *progress.last_done_before() > resumed_after ? *progress.last_done_before() - resumed_after : 0;
  if (const char* failed = std::getenv("MFSDP_PREVIOUS_FAILURE_TIME")) {
    char* end = nullptr;
    const double at = std::strtod(failed, &end);
    if (end != failed && *end == '\0' && at > 0) cost.seconds_since_failure = unix_seconds() - at;
  }
  return cost;
}

std::string RestartCost::text() const {
  std::ostringstream out;
  out << " restart " << restart << ": resumed after iteration " << resumed_after;
  if (lost_iterations) out << "; " << *lost_iterations << " iteration(s) done before the failure are done again";
  if (seconds_since_failure) {
    char s[64];
    std::snprintf(s, sizeof s, "; %.2f s from the failure to this start's training loop", *seconds_since_failure);
    out << s;
  }
  return out.str();
}

}  // namespace mfsdp
