// Megatron's result validation (its rerun state machine, --rerun-mode, --check-for-spiky-loss,
// --error-injection-rate/-type): a step whose loss fails a check (NaN or Inf under
// --check-for-nan-in-loss-and-grad; a spike under --check-for-spiky-loss) is run again from the
// same weights, data and generator states before the optimizer steps, and the two results tell a
// transient fault of the device from a real divergence. The pieces here are the rules; the
// trainer's step applies them (TrainingRun::validate_step, docs/pretrain.md, "Result validation").
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>

namespace mfsdp {

enum class RerunMode {
  kDisabled,         // a NaN stops training (fatal checks), a spike is a warning
  kValidateResults,  // a failed check reruns the step (Megatron's default)
  kReportStats,      // every step runs twice; the differences are reported
};
// "disabled", "validate_results", "report_stats" (--rerun-mode); else std::invalid_argument.
RerunMode rerun_mode_from_name(const std::string& name);

// --error-injection-type: what an injected unexpected result turns out to be on its rerun.
enum class InjectedResult { kCorrectResult, kTransientError, kPersistentError };
InjectedResult injected_result_from_name(const std::string& name);

// Megatron's exit codes: resume elsewhere to disambiguate (16); failed on result validation (17),
// which a scheduler reads as "exclude this node".
constexpr int kExitResumeToDisambiguate = 16;
constexpr int kExitFailedOnResultValidation = 17;

// Thrown by the step when validation ends the job; the trainer's main exits with `exit_code`.
class ResultValidationExit : public std::runtime_error {
 public:
  ResultValidationExit(int exit_code, const std::string& what) : std::runtime_error(what), exit_code(exit_code) {}
  int exit_code;
};

// Megatron's comparison of an initial result with its rerun's: 0 when equal (NaN and NaN too),
// infinity when one is NaN or Inf and the other not, else |a - b| / ((a + b) / 2).
double compare_results(double initial, double rerun);

// Megatron's is_unexpectedly_large (SPIKY_LOSS_FACTOR 10, 100 samples): the largest |value| of
// the first `samples` values is the reference, and a later value of at least `threshold` times it
// is a spike. NaN and Inf are never spikes (the NaN check's).
class SpikeDetector {
 public:
  explicit SpikeDetector(double threshold = 10, int samples = 100) : threshold_(threshold), samples_(samples) {}
  bool is_spike(double value);
  double reference() const { return max_; }
  int seen() const { return seen_; }

 private:
  double threshold_;
  int samples_;
  int seen_ = 0;
  double max_ = 0;
};

// Megatron's RerunErrorInjector: with rate N, a validation is made to fail with chance 1 / N
// ((uniform 0..N-1 + rank) % N == 0), at most one pending at a time; its rerun then compares as
// the injected type says (a transient error differs, a correct result or a persistent error
// matches: only a rerun on another device, which a restart here is not, tells those two apart).
class ErrorInjector {
 public:
  ErrorInjector(int64_t rate, InjectedResult type, int rank, uint64_t seed)
      : rate_(rate), type_(type), rank_(rank), random_(seed) {}
  bool maybe_inject();
  bool pending() const { return pending_.has_value(); }
  // The comparison the rerun reports: `measured` when nothing was injected.
  double rerun_comparison(double measured);
  std::string description() const;  // of the pending injection

 private:
  int64_t rate_;
  InjectedResult type_;
  int rank_;
  std::mt19937_64 random_;
  std::optional<InjectedResult> pending_;
};

// --rerun-mode report_stats: the comparisons of every step with its rerun.
class DeterminismStats {
 public:
  void record(double comparison);
  int64_t count() const { return count_; }
  // "loss of 12 reruns: 0 differed, largest relative difference 0, mean 0".
  std::string summary() const;

 private:
  int64_t count_ = 0, differed_ = 0;
  double max_ = 0, sum_ = 0;
};

}  // namespace mfsdp
