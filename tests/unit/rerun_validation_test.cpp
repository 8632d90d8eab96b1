// The rules of Megatron's result validation (include/mfsdp/train/rerun_validation.h), checked
// against values worked out by hand from megatron/core/rerun_state_machine.py: _compare_floats,
// is_unexpectedly_large (threshold 10, 100 samples) and RerunErrorInjector.
#include "mfsdp/train/rerun_validation.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace {

using namespace mfsdp;
const double kNan = std::numeric_limits<double>::quiet_NaN();
const double kInf = std::numeric_limits<double>::infinity();

TEST(ResultValidationRules, ComparesAsMegatronDoes) {
  EXPECT_EQ(compare_results(2.5, 2.5), 0);
  EXPECT_EQ(compare_results(kNan, kNan), 0);
  EXPECT_EQ(compare_results(kNan, 1.0), kInf);
  EXPECT_EQ(compare_results(1.0, kInf), kInf);
  EXPECT_EQ(compare_results(kInf, kNan), kInf);
  EXPECT_EQ(compare_results(kInf, kInf), 0);  // equal
  EXPECT_NEAR(compare_results(1.0, 1.1), 0.1 / 2.1 * 2, 1e-15);
  EXPECT_DOUBLE_EQ(compare_results(4.0, 2.0), 2.0 / 6.0 * 2);
}

TEST(ResultValidationRules, SpikeIsTenTimesTheLargestOfTheFirstHundred) {
  SpikeDetector d;
  for (int i = 0; i < 100; ++i) EXPECT_FALSE(d.is_spike(i == 50 ? -3.0 : 1.0 + i * 0.001)) << i;  // |-3| is the max
  EXPECT_EQ(d.seen(), 100);
  EXPECT_DOUBLE_EQ(d.reference(), 3.0);
  EXPECT_FALSE(d.is_spike(29.999));
  EXPECT_TRUE(d.is_spike(30.0));   // >= threshold x max
  EXPECT_TRUE(d.is_spike(-31.0));  // by magnitude
  EXPECT_FALSE(d.is_spike(kNan));  // the NaN check's, not the spike rule's
  EXPECT_FALSE(d.is_spike(kInf));
  EXPECT_FALSE(d.is_spike(2.0));
  EXPECT_DOUBLE_EQ(d.reference(), 3.0);  // no longer sampled
  SpikeDetector early;
  EXPECT_FALSE(early.is_spike(1.0));
  EXPECT_FALSE(early.is_spike(1000.0));  // within the first 100: part of the reference
}

TEST(ResultValidationRules, InjectorFailsAboutOneInRateAndOnlyOneAtATime) {
  ErrorInjector always(1, InjectedResult::kTransientError, 0, 7);
  EXPECT_TRUE(always.maybe_inject());
  EXPECT_FALSE(always.maybe_inject());  // one pending
  EXPECT_EQ(always.rerun_comparison(0.0), kInf);  // a transient error differs on its rerun
  EXPECT_FALSE(always.pending());
  EXPECT_EQ(always.rerun_comparison(0.25), 0.25);  // nothing injected: the measured comparison
  for (const InjectedResult same : {InjectedResult::kCorrectResult, InjectedResult::kPersistentError}) {
    ErrorInjector i(1, same, 3, 7);
    ASSERT_TRUE(i.maybe_inject());
    EXPECT_EQ(i.rerun_comparison(0.5), 0.0);  // matches on the same device
  }
  ErrorInjector never(0, InjectedResult::kTransientError, 0, 7);
  for (int k = 0; k < 100; ++k) EXPECT_FALSE(never.maybe_inject());
  int hits = 0;
  ErrorInjector quarter(4, InjectedResult::kTransientError, 1, 11);
  for (int k = 0; k < 4000; ++k)
    if (quarter.maybe_inject()) {
      ++hits;
      quarter.rerun_comparison(0);
    }
  EXPECT_GT(hits, 800);
  EXPECT_LT(hits, 1200);
}

TEST(ResultValidationRules, NamesAndExitCodesAreMegatrons) {
  EXPECT_EQ(rerun_mode_from_name("validate_results"), RerunMode::kValidateResults);
  EXPECT_EQ(rerun_mode_from_name("report_stats"), RerunMode::kReportStats);
  EXPECT_EQ(rerun_mode_from_name("disabled"), RerunMode::kDisabled);
  EXPECT_THROW(rerun_mode_from_name("report_determinism_stats"), std::invalid_argument);
  EXPECT_EQ(injected_result_from_name("persistent_error"), InjectedResult::kPersistentError);
  EXPECT_THROW(injected_result_from_name("transient"), std::invalid_argument);
  EXPECT_EQ(kExitResumeToDisambiguate, 16);
  EXPECT_EQ(kExitFailedOnResultValidation, 17);
  DeterminismStats stats;
  stats.record(0);
  stats.record(0.5);
  stats.record(0);
  EXPECT_EQ(stats.summary(), "loss of 3 rerun step(s): 1 differed, largest relative difference 0.5, mean 0.167");
}

}  // namespace
