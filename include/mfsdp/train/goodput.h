// Goodput: what a restarted job lost. Rank 0 appends the job's progress to the file mfsdp-run
// names in MFSDP_PROGRESS_FILE, which mfsdp-run's end-of-job summary reads (docs/launcher.md,
// "Goodput"):
//   start <restart_count> <resumed_after_iteration> <unix_seconds>   when the training loop begins
//   iteration <n> <unix_seconds>                                     when iteration n is done (saved)
// and a restarted start reports, in its log and metrics, how many iterations the failure cost
// (the last one the progress file says was done, less the one it resumed after) and the time
// from the failure (MFSDP_PREVIOUS_FAILURE_TIME, set by mfsdp-run) to its loop's start.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace mfsdp {

class ProgressFile {
 public:
  // Writes only when `writer` (the job's rank 0) and MFSDP_PROGRESS_FILE is set. Reads, before
  // writing anything, the last iteration the file records.
  explicit ProgressFile(bool writer);
  void started(int restart, int64_t resumed_after);
  void finished(int64_t iteration);
  // The highest iteration the last earlier start recorded as done (nullopt: none, or no file).
  std::optional<int64_t> last_done_before() const { return last_done_before_; }

 private:
  void append(const std::string& line);
  std::string path_;
  bool writer_ = false;
  std::optional<int64_t> last_done_before_;
};

// What a restart cost, for the start-up log and the metrics file.
struct RestartCost {
  int restart = 0;
  int64_t resumed_after = 0;
  std::optional<int64_t> lost_iterations;       // done before the failure, to be done again
  std::optional<double> seconds_since_failure;  // MFSDP_PREVIOUS_FAILURE_TIME to now
  std::string text() const;                     // " restart 2: resumed after iteration 30; ..."
};
RestartCost restart_cost(int restart, int64_t resumed_after, const ProgressFile& progress);

// Seconds since the Unix epoch, with milliseconds (the progress file's clock).
double unix_seconds();

}  // namespace mfsdp
