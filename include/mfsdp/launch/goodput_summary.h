// The goodput summary mfsdp-run prints at the end of a job (docs/launcher.md, "Goodput"): how
// much of the wall time went into iterations the job kept, how much into iterations a restart
// threw away, and how much into restarting. Pure: it reads the progress file's text (what the
// job's rank 0 appended, MFSDP_PROGRESS_FILE) and the times the launcher recorded. Torch-free
// (mfsdp-run links only mfsdp_launch); the code is src/launch/goodput_summary.cpp.
//
// The progress file, one line per event, fields separated by whitespace:
//   start <restart_count> <resumed_after_iteration> <unix_seconds>   the training loop begins
//   iteration <n> <unix_seconds>                                     iteration n (1-based) is done
// A rank may die mid-line: a line that does not parse is skipped, and so is a last line without
// its '\n'. Before the next start appends, the launcher ends such a cut line with kCutLineEnd,
// which keeps it unparsable ("iteration 5 17" + "#cut").
#pragma once

#include <string>
#include <vector>

namespace mfsdp::launch {

inline constexpr const char* kCutLineEnd = "#cut\n";

// What the launcher knows about the job itself.
struct JobTimes {
  double begin = 0;  // unix seconds of the first start
  double end = 0;    // unix seconds now, at the end of the job
  int starts = 0;    // starts of the job's ranks (restarts + 1); 0 before the first
  // failure_times[k]: unix seconds at which the launcher learned that start k failed.
  std::vector<double> failure_times;
};

struct GoodputSummary {
  double wall = 0;         // JobTimes::end - begin
  int starts = 0;          // JobTimes::starts
  int kept = 0;            // iterations whose last occurrence no later start went back before
  int lost = 0;            // occurrences of iterations a later start redid (resumed before them)
  double productive = 0;   // seconds in kept iterations
  double lost_time = 0;    // seconds in lost iterations
  double restarting = 0;   // seconds from each failure to the next start's loop
  double goodput = 0;      // productive / wall, in [0, 1] (0 when wall is 0)
  int lines = 0;           // lines of the progress file that parsed
};

// Definitions (docs/launcher.md, "Goodput"): an occurrence of iteration n in a start lasts from
// the previous line of that start (its `start` line for the first) to its own line; it is lost
// when a later start resumed after an iteration below n (it was redone), kept otherwise.
// Restarting, for each start k >= 1: from the launcher's failure time of start k-1 to start k's
// `start` line; a start that never reached its loop counts whole (to its own failure, or to the
// end of the job). Never fails: lines that do not parse, and iterations before the first `start`
// line (they belong to no start), are skipped.
GoodputSummary summarize_progress(const std::string& text, const JobTimes& job);

// "mfsdp-run: goodput: wall 93.1 s, 3 starts (2 restarts), 60 iterations kept, 7 lost and redone;
// productive 61.2 s (time in kept iterations), lost 6.8 s, restarting 11.0 s (failure to the next
// start's loop), goodput 65.7%"
std::string format_goodput(const GoodputSummary& summary);

}  // namespace mfsdp::launch
