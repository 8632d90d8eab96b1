// one_f_one_b and interleaved_one_f_one_b against sequences worked out by hand from Megatron's
// schedules.py (forward_backward_pipelining_without_interleaving;
// forward_backward_pipelining_with_interleaving with get_pp_rank_microbatches and
// get_schedule_table), their refusals, in_flight_peak, and a simulation of all stages together
// that checks the schedules complete without deadlock.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "mfsdp/train/pipeline_schedule.h"

namespace {

using mfsdp::PipelineAction;
using mfsdp::PipelineStep;

// "F3" / "B0" per action; with chunks (interleaved) "F3c1": forward of micro-batch 3 on chunk 1.
std::string spell(const std::vector<PipelineAction>& schedule, bool with_chunks) {
  std::string s;
  for (const PipelineAction& a : schedule) {
    if (!s.empty()) s += ' ';
    s += a.step == PipelineStep::kForward ? 'F' : 'B';
    s += std::to_string(a.micro_batch);
    if (with_chunks) s += "c" + std::to_string(a.chunk);
  }
  return s;
}

std::string one_f_one_b(int stages, int stage, int64_t micro_batches) {
  return spell(mfsdp::one_f_one_b(stages, stage, micro_batches), false);
}

std::string interleaved(int stages, int stage, int virtual_stages, int64_t micro_batches, int group = 0) {
  return spell(mfsdp::interleaved_one_f_one_b(stages, stage, virtual_stages, micro_batches, group), true);
}

// forward_backward_pipelining_without_interleaving: warm-up min(P - s - 1, m) forwards, then for
// i in [0, m - warm-up): forward i + warm-up, backward i; then the remaining backwards.
TEST(PipelineSchedule, OneFOneBTwoStagesEightMicroBatches) {
  EXPECT_EQ(one_f_one_b(2, 0, 8), "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7");
  EXPECT_EQ(one_f_one_b(2, 1, 8), "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7");
}

TEST(PipelineSchedule, OneFOneBFourStagesEightMicroBatches) {
  EXPECT_EQ(one_f_one_b(4, 0, 8), "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7");
  EXPECT_EQ(one_f_one_b(4, 1, 8), "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7");
  EXPECT_EQ(one_f_one_b(4, 2, 8), "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7");
  EXPECT_EQ(one_f_one_b(4, 3, 8), "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7");
}

TEST(PipelineSchedule, OneFOneBWithFewerMicroBatchesThanStages) {
  // The warm-up is capped at the micro-batches: everything forward, then everything backward.
  EXPECT_EQ(one_f_one_b(4, 0, 2), "F0 F1 B0 B1");
  EXPECT_EQ(one_f_one_b(4, 2, 2), "F0 F1 B0 B1");
  EXPECT_EQ(one_f_one_b(4, 3, 2), "F0 B0 F1 B1");
  EXPECT_EQ(one_f_one_b(1, 0, 3), "F0 B0 F1 B1 F2 B2");
  EXPECT_EQ(one_f_one_b(3, 0, 0), "");
  EXPECT_THROW(mfsdp::one_f_one_b(4, 4, 8), std::invalid_argument);
  EXPECT_THROW(mfsdp::one_f_one_b(4, -1, 8), std::invalid_argument);
  EXPECT_THROW(mfsdp::one_f_one_b(4, 0, -1), std::invalid_argument);
}

// forward_backward_pipelining_with_interleaving, P=2 V=2 m=4, group size 2 (the default P):
// get_schedule_table: (0,c0) (1,c0) (0,c1) (1,c1) (2,c0) (3,c0) (2,c1) (3,c1); backward step k is
// entry k with the chunk reversed. get_pp_rank_microbatches: warm-up (P - s - 1) * 2 + (V - 1) * 2:
// 4 on stage 0, 2 on stage 1, of 8 steps.
TEST(PipelineSchedule, InterleavedTwoStagesTwoChunksFourMicroBatches) {
  EXPECT_EQ(interleaved(2, 0, 2, 4),
            "F0c0 F1c0 F0c1 F1c1 "                          // warm-up
            "F2c0 B0c1 F3c0 B1c1 F2c1 B0c0 F3c1 B1c0 "      // steady
            "B2c1 B3c1 B2c0 B3c0");                         // cool-down
  EXPECT_EQ(interleaved(2, 1, 2, 4),
            "F0c0 F1c0 "
            "F0c1 B0c1 F1c1 B1c1 F2c0 B0c0 F3c0 B1c0 F2c1 B2c1 F3c1 B3c1 "
            "B2c0 B3c0");
}

// P=4 V=2 m=8, group size 4: table (0..3,c0) (0..3,c1) (4..7,c0) (4..7,c1); warm-up
// (3 - s) * 2 + 4: 10, 8, 6, 4 of 16 steps.
TEST(PipelineSchedule, InterleavedFourStagesTwoChunksEightMicroBatches) {
  EXPECT_EQ(interleaved(4, 0, 2, 8),
            "F0c0 F1c0 F2c0 F3c0 F0c1 F1c1 F2c1 F3c1 F4c0 F5c0 "
            "F6c0 B0c1 F7c0 B1c1 F4c1 B2c1 F5c1 B3c1 F6c1 B0c0 F7c1 B1c0 "
            "B2c0 B3c0 B4c1 B5c1 B6c1 B7c1 B4c0 B5c0 B6c0 B7c0");
  EXPECT_EQ(interleaved(4, 1, 2, 8),
            "F0c0 F1c0 F2c0 F3c0 F0c1 F1c1 F2c1 F3c1 "
            "F4c0 B0c1 F5c0 B1c1 F6c0 B2c1 F7c0 B3c1 F4c1 B0c0 F5c1 B1c0 F6c1 B2c0 F7c1 B3c0 "
            "B4c1 B5c1 B6c1 B7c1 B4c0 B5c0 B6c0 B7c0");
  EXPECT_EQ(interleaved(4, 2, 2, 8),
            "F0c0 F1c0 F2c0 F3c0 F0c1 F1c1 "
            "F2c1 B0c1 F3c1 B1c1 F4c0 B2c1 F5c0 B3c1 F6c0 B0c0 F7c0 B1c0 F4c1 B2c0 F5c1 B3c0 F6c1 B4c1 F7c1 B5c1 "
            "B6c1 B7c1 B4c0 B5c0 B6c0 B7c0");
  EXPECT_EQ(interleaved(4, 3, 2, 8),
            "F0c0 F1c0 F2c0 F3c0 "
            "F0c1 B0c1 F1c1 B1c1 F2c1 B2c1 F3c1 B3c1 F4c0 B0c0 F5c0 B1c0 F6c0 B2c0 F7c0 B3c0 "
            "F4c1 B4c1 F5c1 B5c1 F6c1 B6c1 F7c1 B7c1 "
            "B4c0 B5c0 B6c0 B7c0");
}

TEST(PipelineSchedule, InterleavedMicroBatchGroupSize) {
  // ModelParallelConfig.microbatch_group_size_per_vp_stage's own example, PP=2 VP=2, group 3, M=5:
  // forwards run micro-batches 0 1 2 0 1 2 3 4 3 4 on chunks 0 0 0 1 1 1 0 0 1 1.
  for (int stage = 0; stage < 2; ++stage) {
    std::vector<PipelineAction> forwards;
    for (const PipelineAction& a : mfsdp::interleaved_one_f_one_b(2, stage, 2, 5, 3))
      if (a.step == PipelineStep::kForward) forwards.push_back(a);
    EXPECT_EQ(spell(forwards, true), "F0c0 F1c0 F2c0 F0c1 F1c1 F2c1 F3c0 F4c0 F3c1 F4c1") << stage;
  }
  // Warm-up on stage 0: (2 - 0 - 1) * 2 + (2 - 1) * 3 = 5.
  EXPECT_EQ(interleaved(2, 0, 2, 5, 3),
            "F0c0 F1c0 F2c0 F0c1 F1c1 "
            "F2c1 B0c1 F3c0 B1c1 F4c0 B2c1 F3c1 B0c0 F4c1 B1c0 "
            "B2c0 B3c1 B4c1 B3c0 B4c0");
}

TEST(PipelineSchedule, InterleavedWarmUpCoversEverythingOnlyWhereTheFormulaSaysSo) {
  // Today's get_pp_rank_microbatches has no "m == P means all warm-up" rule: only ranks whose
  // (P - s - 1) * 2 + (V - 1) * P reaches m * V run all forwards first. P=4 V=2 m=4: stage 0:
  // 6 + 4 >= 8, all warm-up; stage 3: 4 < 8.
  EXPECT_EQ(interleaved(4, 0, 2, 4), "F0c0 F1c0 F2c0 F3c0 F0c1 F1c1 F2c1 F3c1 B0c1 B1c1 B2c1 B3c1 B0c0 B1c0 B2c0 B3c0");
  EXPECT_EQ(interleaved(4, 3, 2, 4), "F0c0 F1c0 F2c0 F3c0 F0c1 B0c1 F1c1 B1c1 F2c1 B2c1 F3c1 B3c1 B0c0 B1c0 B2c0 B3c0");
}

TEST(PipelineSchedule, OneVirtualStageIsTheNonInterleavedSchedule) {
  // validate_args turns a virtual size of 1 into None, and get_forward_backward_func then picks
  // forward_backward_pipelining_without_interleaving.
  for (int s = 0; s < 4; ++s)
    EXPECT_EQ(interleaved(4, s, 1, 8), spell(mfsdp::one_f_one_b(4, s, 8), true)) << s;
}

void expect_schedule_refused(int P, int s, int V, int64_t m, int group, const std::vector<std::string>& parts) {
  try {
    mfsdp::interleaved_one_f_one_b(P, s, V, m, group);
    ADD_FAILURE() << "accepted P=" << P << " V=" << V << " m=" << m << " group=" << group;
  } catch (const std::invalid_argument& e) {
    for (const std::string& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

TEST(PipelineSchedule, InterleavedRefusesWhatMegatronRefuses) {
  const std::vector<std::string> flags = {"--global-batch-size", "--micro-batch-size",
                                          "--virtual-pipeline-model-parallel-size"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.end(), flags.begin(), flags.end());
    return more;
  };
  // Group size (default P) above the micro-batches: fewer micro-batches than stages.
  expect_schedule_refused(4, 0, 2, 2, 0, with({"= 2", "multiple of the pipeline size"}));
  // The last group smaller than P: with the default group, m not a multiple of P.
  expect_schedule_refused(4, 0, 2, 6, 0, with({"last group of micro-batches (2)"}));
  expect_schedule_refused(2, 0, 2, 4, 3, with({"last group of micro-batches (1)", "--microbatch-group-size"}));
  // A group size below P.
  expect_schedule_refused(4, 1, 2, 8, 3, with({"--microbatch-group-size-per-virtual-pipeline-stage 3"}));
  // A remainder of at least P is allowed: P=2 group 3, m=5 leaves 2.
  EXPECT_NO_THROW(mfsdp::interleaved_one_f_one_b(2, 0, 2, 5, 3));
  // Virtual stages need more than one stage; and the stage must be one of them.
  expect_schedule_refused(1, 0, 2, 4, 0, {"--pipeline-model-parallel-size", "--virtual-pipeline-model-parallel-size"});
  EXPECT_THROW(mfsdp::interleaved_one_f_one_b(4, 4, 2, 8), std::invalid_argument);
  EXPECT_THROW(mfsdp::interleaved_one_f_one_b(4, 0, 0, 8), std::invalid_argument);
}

TEST(PipelineSchedule, InFlightPeak) {
  // 1F1B: stage s holds min(P - s, m) micro-batches at most; stage 0 min(P, m).
  for (int P : {1, 2, 4, 8})
    for (int64_t m : {1, 2, 4, 8, 16})
      for (int s = 0; s < P; ++s)
        EXPECT_EQ(mfsdp::in_flight_peak(mfsdp::one_f_one_b(P, s, m)), std::min<int64_t>(P - s, m))
            << "P=" << P << " s=" << s << " m=" << m;
  EXPECT_EQ(mfsdp::in_flight_peak(mfsdp::one_f_one_b(4, 0, 8)), 4);
  // Interleaved, counted in chunk activations: the warm-up plus the steady state's one more.
  EXPECT_EQ(mfsdp::in_flight_peak(mfsdp::interleaved_one_f_one_b(4, 0, 2, 8)), 11);
  EXPECT_EQ(mfsdp::in_flight_peak(mfsdp::interleaved_one_f_one_b(4, 3, 2, 8)), 5);
  EXPECT_EQ(mfsdp::in_flight_peak(mfsdp::interleaved_one_f_one_b(4, 0, 2, 4)), 8);  // all warm-up
  EXPECT_EQ(mfsdp::in_flight_peak({}), 0);
}

std::vector<PipelineAction> schedule_of(int P, int s, int V, int64_t m) {
  return V == 1 ? mfsdp::one_f_one_b(P, s, m) : mfsdp::interleaved_one_f_one_b(P, s, V, m);
}

TEST(PipelineSchedule, EveryStepRunsOnceForwardBeforeBackward) {
  for (int P : {1, 2, 3, 4, 8})
    for (int V : {1, 2, 3})
      for (int64_t m : {int64_t{P}, int64_t{2 * P}, int64_t{3 * P}, int64_t{5}}) {
        if (V > 1 && (P < 2 || m % P != 0)) continue;
        for (int s = 0; s < P; ++s) {
          std::map<std::pair<int64_t, int>, int> state;  // 1 after its forward, 2 after its backward
          for (const PipelineAction& a : schedule_of(P, s, V, m)) {
            ASSERT_TRUE(a.micro_batch >= 0 && a.micro_batch < m && a.chunk >= 0 && a.chunk < V);
            int& st = state[{a.micro_batch, a.chunk}];
            ASSERT_EQ(st, a.step == PipelineStep::kForward ? 0 : 1)
                << "P=" << P << " V=" << V << " m=" << m << " s=" << s << " mb=" << a.micro_batch << " c=" << a.chunk;
            ++st;
          }
          ASSERT_EQ(state.size(), static_cast<size_t>(m * V));
          for (const auto& [key, st] : state) EXPECT_EQ(st, 2);
        }
      }
}

// All stages' schedules run together: each rank runs its actions in order; a send never waits; an
// action waits for its input. The forward of micro-batch mb on global model chunk g = c * P + s
// needs the forward of (mb, g - 1) (done on stage (g - 1) % P); the backward of (mb, g) needs the
// backward of (mb, g + 1). Returns how many actions were left when no rank could move.
int64_t simulate(int P, int V, const std::vector<std::vector<PipelineAction>>& schedules) {
  const int G = P * V;
  std::set<std::pair<int64_t, int>> forward_done, backward_done;  // (micro-batch, global chunk)
  std::vector<size_t> next(P, 0);
  bool moved = true;
  while (moved) {
    moved = false;
    for (int s = 0; s < P; ++s) {
      // Run as far as this rank can before looking at the next one.
      while (next[s] < schedules[s].size()) {
        const PipelineAction& a = schedules[s][next[s]];
        const int g = a.chunk * P + s;
        const bool ready = a.step == PipelineStep::kForward
                               ? (g == 0 || forward_done.count({a.micro_batch, g - 1}) > 0)
                               : (g == G - 1 || backward_done.count({a.micro_batch, g + 1}) > 0);
        if (!ready) break;
        (a.step == PipelineStep::kForward ? forward_done : backward_done).insert({a.micro_batch, g});
        ++next[s];
        moved = true;
      }
    }
  }
  int64_t left = 0;
  for (int s = 0; s < P; ++s) left += static_cast<int64_t>(schedules[s].size() - next[s]);
  return left;
}

int64_t simulate(int P, int V, int64_t m) {
  std::vector<std::vector<PipelineAction>> schedules;
  for (int s = 0; s < P; ++s) schedules.push_back(schedule_of(P, s, V, m));
  return simulate(P, V, schedules);
}

TEST(PipelineSchedule, AllStagesTogetherCompleteWithoutDeadlock) {
  for (int P : {2, 4, 8})
    for (int V : {1, 2, 3})
      for (int64_t m : {int64_t{P}, int64_t{2 * P}, int64_t{3 * P}})
        EXPECT_EQ(simulate(P, V, m), 0) << "deadlock: P=" << P << " V=" << V << " m=" << m;
}

TEST(PipelineSchedule, SimulationCatchesADeadlock) {
  // The check above can fail: stage 0 of 2 waiting for micro-batch 1's backward before running its
  // forward (which stage 1 needs to produce that backward) never finishes.
  std::vector<std::vector<PipelineAction>> schedules = {mfsdp::one_f_one_b(2, 0, 2), mfsdp::one_f_one_b(2, 1, 2)};
  EXPECT_EQ(simulate(2, 1, schedules), 0);
  schedules[0] = {{PipelineStep::kForward, 0, 0}, {PipelineStep::kBackward, 1, 0}, {PipelineStep::kForward, 1, 0},
                  {PipelineStep::kBackward, 0, 0}};
  EXPECT_GT(simulate(2, 1, schedules), 0);
}

}  // namespace
