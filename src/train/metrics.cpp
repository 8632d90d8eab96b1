#include "mfsdp/train/metrics.h"

#include <sys/resource.h>
#ifdef MFSDP_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

namespace mfsdp {

MetricsWriter::MetricsWriter(const std::string& path, bool append) {
  if (path.empty()) return;
  if (const auto parent = std::filesystem::path(path).parent_path(); !parent.empty()) {
    std::error_code ec;  // a failure shows as the open's error below
    std::filesystem::create_directories(parent, ec);
  }
  out_.open(path, append ? std::ios::app : std::ios::trunc);
  if (!out_) throw std::runtime_error("--metrics-file: cannot open '" + path + "' for writing");
}

void MetricsWriter::write(const IterationRecord& r) {
  if (!out_.is_open()) return;
  nlohmann::json j = {{"iteration", r.iteration},         {"consumed_samples", r.consumed_samples},
                      {"lm_loss", r.lm_loss},             {"lr", r.lr},
                      {"grad_norm", r.grad_norm},         {"iter_time_s", r.iter_time_s},
                      {"tokens_per_sec", r.tokens_per_sec}, {"tflops_per_rank", r.tflops_per_rank},
                      {"mem_bytes", r.mem_bytes}};
  if (r.eval) j["eval"] = true;
  for (const auto& [key, value] : r.extra) j[key] = value;
  out_ << j.dump() << "\n";
  out_.flush();
}

int64_t peak_rss_bytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;  // Linux reports KiB
}

int64_t peak_memory_bytes(const c10::Device& device) {
#ifdef MFSDP_WITH_CUDA
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    return stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak;
  }
#endif
  return peak_rss_bytes();
}

void write_loss_curve_svg(const std::string& path, const std::vector<IterationRecord>& records,
                          const std::string& title) {
  CurvePoints train, eval;
  for (const auto& r : records)
    (r.eval ? eval : train).emplace_back(static_cast<double>(r.iteration), r.lm_loss);
  write_curve_svg(path, title, train, eval);
}

void write_curve_svg(const std::string& path, const std::string& title, const CurvePoints& train,
                     const CurvePoints& eval) {
  if (train.empty() && eval.empty()) return;
  double x_max = 1, y_min = 1e30, y_max = -1e30;
  for (const CurvePoints* series : {&train, &eval})
    for (const auto& [x, y] : *series) {
      if (!std::isfinite(y)) continue;
      x_max = std::max(x_max, x);
      y_min = std::min(y_min, y);
      y_max = std::max(y_max, y);
    }
  if (y_min > y_max) y_min = 0, y_max = 1;
  if (y_max - y_min < 1e-9) y_max = y_min + 1;
  const double w = 640, h = 400, left = 60, right = 20, top = 30, bottom = 40;
  auto px = [&](double x) { return left + x / x_max * (w - left - right); };
  auto py = [&](double y) { return top + (y_max - y) / (y_max - y_min) * (h - top - bottom); };
  std::ostringstream svg;
  svg << "<svg xmlns='http://www.w3.org/2000/svg' width='" << w << "' height='" << h << "'>\n"
      << "<rect width='100%' height='100%' fill='white'/>\n"
      << "<text x='" << w / 2 << "' y='20' text-anchor='middle' font-family='sans-serif' "
         "font-size='14'>" << title << "</text>\n"
      << "<line x1='" << left << "' y1='" << h - bottom << "' x2='" << w - right << "' y2='"
      << h - bottom << "' stroke='black'/>\n"
      << "<line x1='" << left << "' y1='" << top << "' x2='" << left << "' y2='" << h - bottom
      << "' stroke='black'/>\n";
  for (int k = 0; k <= 4; ++k) {
    double y = y_min + (y_max - y_min) * k / 4.0;
    svg << "<text x='" << left - 5 << "' y='" << py(y) + 4 << "' text-anchor='end' font-family='sans-serif' "
        << "font-size='11'>" << std::round(y * 1000) / 1000 << "</text>\n";
  }
  svg << "<text x='" << w - right << "' y='" << h - 10 << "' text-anchor='end' font-family='sans-serif' "
      << "font-size='11'>iteration " << x_max << "</text>\n";
  auto polyline = [&](const CurvePoints& pts, const char* color) {
    if (pts.empty()) return;
    svg << "<polyline fill='none' stroke='" << color << "' stroke-width='2' points='";
    for (const auto& [x, y] : pts)
      if (std::isfinite(y)) svg << px(x) << "," << py(y) << " ";
    svg << "'/>\n";
  };
  polyline(train, "#1f77b4");
  polyline(eval, "#d62728");
  svg << "<text x='" << w - right - 5 << "' y='" << top + 15 << "' text-anchor='end' font-family='sans-serif' "
      << "font-size='11' fill='#1f77b4'>train</text>\n";
  if (!eval.empty())
    svg << "<text x='" << w - right - 5 << "' y='" << top + 30 << "' text-anchor='end' "
        << "font-family='sans-serif' font-size='11' fill='#d62728'>validation</text>\n";
  svg << "</svg>\n";
  std::ofstream out(path, std::ios::trunc);
  if (!out) throw std::runtime_error("cannot write the loss curve to '" + path + "'");
  out << svg.str();
}

}  // namespace mfsdp
