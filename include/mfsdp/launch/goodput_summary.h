// The goodput summary mfsdp-run prints at the end of a job (docs/launcher.md, "Goodput"): how
// much of the wall time went into iterations the job kept, how much into iterations a restart
// threw away, and how much into restarting. Pure: it reads the progress file's text (what the
// job's rank 0 appended, MFSDP_PROGRESS_FILE) and the times the launcher recorded. Header-only
// and torch-free, so mfsdp-run and the tests use it without another library.
//
// The progress file, one line per event, fields separated by whitespace:
//   start <restart_count> <resumed_after_iteration> <unix_seconds>   the training loop begins
//   iteration <n> <unix_seconds>                                     iteration n (1-based) is done
// A rank may die mid-line: a line that does not parse is skipped, and so is a last line without
// its '\n'. Before the next start appends, the launcher ends such a cut line with kCutLineEnd,
// which keeps it unparsable ("iteration 5 17" + "#cut").
#pragma once

#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <sstream>
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

namespace goodput_detail {

struct Event {
  bool is_start = false;
  long restart = 0;    // start: its restart count
  long iteration = 0;  // start: resumed after this iteration; iteration: its number
  double time = 0;
};

// One line, or nothing when it is malformed (a cut line, stray text).
inline std::optional<Event> parse_line(const std::string& line) {
  std::istringstream fields(line);
  std::string kind, a, b, c, extra;
  fields >> kind >> a >> b >> c >> extra;
  auto integer = [](const std::string& text, long& out) {
    char* end = nullptr;
    out = std::strtol(text.c_str(), &end, 10);
    return !text.empty() && *end == '\0' && out >= 0;
  };
  auto seconds = [](const std::string& text, double& out) {
    char* end = nullptr;
    out = std::strtod(text.c_str(), &end);
    return !text.empty() && *end == '\0' && out == out;  // out == out: not NaN
  };
  Event event;
  if (kind == "start" && extra.empty() && integer(a, event.restart) && integer(b, event.iteration) &&
      seconds(c, event.time)) {
    event.is_start = true;
    return event;
  }
  if (kind == "iteration" && c.empty() && integer(a, event.iteration) && seconds(b, event.time))
    return event;
  return std::nullopt;
}

}  // namespace goodput_detail

// Definitions (docs/launcher.md, "Goodput"): an occurrence of iteration n in a start lasts from
// the previous line of that start (its `start` line for the first) to its own line; it is lost
// when a later start resumed after an iteration below n (it was redone), kept otherwise.
// Restarting, for each start k >= 1: from the launcher's failure time of start k-1 to start k's
// `start` line; a start that never reached its loop counts whole (to its own failure, or to the
// end of the job).
inline GoodputSummary summarize_progress(const std::string& text, const JobTimes& job) {
  using goodput_detail::Event;
  std::vector<Event> events;
  // Only whole lines: what follows the last '\n' may be cut short ("iteration 5 17" of "...170...").
  std::istringstream lines(text.substr(0, text.rfind('\n') + 1));
  for (std::string line; std::getline(lines, line);) {
    if (auto event = goodput_detail::parse_line(line)) events.push_back(*event);
  }
  GoodputSummary summary;
  summary.lines = static_cast<int>(events.size());
  summary.wall = job.end - job.begin;
  summary.starts = job.starts;

  // Iterations before the first `start` line belong to no start: skipped.
  std::map<long, double> loop_begin;  // restart count -> time of its `start` line
  struct Occurrence {
    size_t start_index;  // index in `starts` of its start
    long iteration;
    double duration;
  };
  std::vector<long> resumed_after;  // per `start` line, in file order
  std::vector<Occurrence> occurrences;
  double previous_time = 0;
  for (const Event& event : events) {
    if (event.is_start) {
      resumed_after.push_back(event.iteration);
      if (loop_begin.count(event.restart) == 0) loop_begin[event.restart] = event.time;
    } else if (!resumed_after.empty()) {
      occurrences.push_back({resumed_after.size() - 1, event.iteration, event.time - previous_time});
    }
    previous_time = event.time;
  }
  for (const Occurrence& occurrence : occurrences) {
    bool redone = false;
    for (size_t later = occurrence.start_index + 1; later < resumed_after.size(); ++later)
      redone = redone || resumed_after[later] < occurrence.iteration;
    if (redone) {
      ++summary.lost;
      summary.lost_time += occurrence.duration;
    } else {
      ++summary.kept;
      summary.productive += occurrence.duration;
    }
  }
  for (int k = 1; k < job.starts && static_cast<size_t>(k) <= job.failure_times.size(); ++k) {
    double until = job.end;
    if (auto begun = loop_begin.find(k); begun != loop_begin.end()) {
      until = begun->second;
    } else if (static_cast<size_t>(k) < job.failure_times.size()) {
      until = job.failure_times[k];
    }
    summary.restarting += until - job.failure_times[k - 1];
  }
  summary.goodput = summary.wall > 0 ? summary.productive / summary.wall : 0;
  return summary;
}

// "mfsdp-run: goodput: wall 93.1 s, 3 starts (2 restarts), 60 iterations kept, 7 lost and redone;
// productive 61.2 s (time in kept iterations), lost 6.8 s, restarting 11.0 s (failure to the next
// start's loop), goodput 65.7%"
inline std::string format_goodput(const GoodputSummary& s) {
  char text[512];
  std::snprintf(text, sizeof text,
                "mfsdp-run: goodput: wall %.1f s, %d %s (%d %s), %d %s kept, %d lost and redone; productive "
                "%.1f s (time in kept iterations), lost %.1f s, restarting %.1f s (failure to the next "
                "start's loop), goodput %.1f%%",
                s.wall, s.starts, s.starts == 1 ? "start" : "starts", s.starts - 1,
                s.starts - 1 == 1 ? "restart" : "restarts", s.kept, s.kept == 1 ? "iteration" : "iterations",
                s.lost, s.productive, s.lost_time, s.restarting, 100.0 * s.goodput);
  return text;
}

}  // namespace mfsdp::launch
