#include "mfsdp/train/rerun_validation.h"

#include <cmath>
#include <cstdio>
#include <limits>

namespace mfsdp {

RerunMode rerun_mode_from_name(const std::string& name) {
  if (name == "disabled") return RerunMode::kDisabled;
  if (name == "validate_results") return RerunMode::kValidateResults;
  if (name == "report_stats") return RerunMode::kReportStats;
  throw std::invalid_argument("--rerun-mode: expected disabled, validate_results or report_stats, got '" + name + "'");
}

InjectedResult injected_result_from_name(const std::string& name) {
  if (name == "correct_result") return InjectedResult::kCorrectResult;
  if (name == "transient_error") return InjectedResult::kTransientError;
  if (name == "persistent_error") return InjectedResult::kPersistentError;
  throw std::invalid_argument("--error-injection-type: expected correct_result, transient_error or persistent_error, "
                              "got '" + name + "'");
}

double compare_results(double a, double b) {
  if (a == b || (std::isnan(a) && std::isnan(b))) return 0;
  if (std::isnan(a) || std::isnan(b) || std::isinf(a) || std::isinf(b)) return std::numeric_limits<double>::infinity();
  return std::fabs((a - b) / (a + b) * 2);
}

bool SpikeDetector::is_spike(double value) {
  value = std::fabs(value);
  if (std::isnan(value) || std::isinf(value)) return false;
  if (seen_ < samples_) {
    ++seen_;
    max_ = std::max(max_, value);
    return false;
  }
  return value >= max_ * threshold_;
}

bool ErrorInjector::maybe_inject() {
  if (rate_ <= 0 || pending_) return false;
  std::uniform_int_distribution<int64_t> draw(0, rate_ - 1);
  if ((draw(random_) + rank_) % rate_ != 0) return false;
  pending_ = type_;
  return true;
}

double ErrorInjector::rerun_comparison(double measured) {
  if (!pending_) return measured;
  const InjectedResult injected = *pending_;
  pending_.reset();
  return injected == InjectedResult::kTransientError ? std::numeric_limits<double>::infinity() : 0.0;
}

std::string ErrorInjector::description() const {
  if (!pending_) return "";
  switch (*pending_) {
    case InjectedResult::kCorrectResult: return "injected: --error-injection-type correct_result";
    case InjectedResult::kTransientError: return "injected: --error-injection-type transient_error";
    case InjectedResult::kPersistentError: return "injected: --error-injection-type persistent_error";
  }
  return "";
}

void DeterminismStats::record(double comparison) {
  ++count_;
  if (comparison != 0) ++differed_;
  max_ = std::max(max_, comparison);
  sum_ += comparison;
}

std::string DeterminismStats::summary() const {
  char text[160];
  std::snprintf(text, sizeof text, "loss of %lld rerun step(s): %lld differed, largest relative difference %.3g, mean %.3g",
                static_cast<long long>(count_), static_cast<long long>(differed_), max_,
                count_ > 0 ? sum_ / static_cast<double>(count_) : 0.0);
  return text;
}

}  // namespace mfsdp
