// Megatron's learning-rate schedule (OptimizerParamScheduler.get_lr with init_lr 0): linear
// warmup, then constant, linear or cosine decay to min_lr, then flat at min_lr.
#include <cmath>
#include <sstream>
#include <stdexcept>

#include "mfsdp/optim/optim.h"

namespace mfsdp {
namespace {

constexpr double kPi = 3.14159265358979323846;

template <typename T>
[[noreturn]] void fail(const char* field, const T& value, const char* expected) {
  std::ostringstream msg;
  msg << "LRSchedule." << field << " must be " << expected << ", got " << value;
  throw std::invalid_argument(msg.str());
}

// Checked on every call: the schedule is a plain struct that callers may change at any time, and
// the check costs a few comparisons.
void check(const LRSchedule& s) {
  if (s.style != "constant" && s.style != "linear" && s.style != "cosine") {
    fail("style", "'" + s.style + "'", "\"constant\", \"linear\" or \"cosine\"");
  }
  if (!(s.max_lr >= 0) || !std::isfinite(s.max_lr)) fail("max_lr", s.max_lr, "finite and >= 0");
  if (!(s.min_lr >= 0) || !std::isfinite(s.min_lr)) fail("min_lr", s.min_lr, "finite and >= 0");
  if (s.min_lr > s.max_lr) {
    std::ostringstream expected;
    expected << "<= max_lr (" << s.max_lr << ")";
    fail("min_lr", s.min_lr, expected.str().c_str());
  }
  if (s.warmup_steps < 0) fail("warmup_steps", s.warmup_steps, ">= 0");
  if (s.decay_steps < 0) fail("decay_steps", s.decay_steps, ">= 0");
  if (s.decay_steps > 0 && s.warmup_steps > s.decay_steps) {
    std::ostringstream expected;
    expected << "<= decay_steps (" << s.decay_steps << ")";
    fail("warmup_steps", s.warmup_steps, expected.str().c_str());
  }
}

}  // namespace

double LRSchedule::lr_at(int64_t step) const {
  check(*this);
  if (step < 0) {
    throw std::invalid_argument("LRSchedule::lr_at: step must be >= 0, got " +
                                std::to_string(step));
  }
  if (warmup_steps > 0 && step <= warmup_steps) {
    return max_lr * static_cast<double>(step) / static_cast<double>(warmup_steps);
  }
  if (style == "constant" || decay_steps == 0) return max_lr;
  if (step > decay_steps) return min_lr;
  // warmup_steps < step <= decay_steps here, so the ratio lies in [0, 1] and the divisor is > 0
  // (step 0 without warmup gives ratio 0).
  const double decay_ratio =
      static_cast<double>(step - warmup_steps) / static_cast<double>(decay_steps - warmup_steps);
  const double coeff =
      style == "linear" ? 1.0 - decay_ratio : 0.5 * (std::cos(kPi * decay_ratio) + 1.0);
  return min_lr + coeff * (max_lr - min_lr);
}

}  // namespace mfsdp
