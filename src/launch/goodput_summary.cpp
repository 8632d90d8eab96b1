// The goodput arithmetic over the progress file's lines (include/mfsdp/launch/goodput_summary.h).
#include "mfsdp/launch/goodput_summary.h"

#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <sstream>

namespace mfsdp::launch {
namespace {

struct Event {
  bool is_start = false;
  long restart = 0;    // start: its restart count
  long iteration = 0;  // start: resumed after this iteration; iteration: its number
  double time = 0;
};

// One line, or nothing when it is malformed (a cut line, stray text).
std::optional<Event> parse_line(const std::string& line) {
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

}  // namespace

GoodputSummary summarize_progress(const std::string& text, const JobTimes& job) {
  std::vector<Event> events;
  // Only whole lines: what follows the last '\n' may be cut short ("iteration 5 17" of "...170...").
  std::istringstream lines(text.substr(0, text.rfind('\n') + 1));
  for (std::string line; std::getline(lines, line);) {
    if (auto event = parse_line(line)) events.push_back(*event);
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

std::string format_goodput(const GoodputSummary& s) {
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
