// Megatron's pipeline schedules as lists of actions: forward_backward_pipelining_without_interleaving
// and forward_backward_pipelining_with_interleaving (get_pp_rank_microbatches, get_schedule_table,
// and the chunk lookups of its get_model_chunk_id / get_microbatch_id_in_model_chunk).
#include "mfsdp/train/pipeline_schedule.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

namespace mfsdp {
namespace {

void check_stage_of(const char* who, int stages, int stage, int64_t micro_batches) {
  if (stages < 1)
    throw std::invalid_argument(std::string(who) + ": --pipeline-model-parallel-size must be at least 1, found " +
                                std::to_string(stages));
  if (stage < 0 || stage >= stages)
    throw std::invalid_argument(std::string(who) + ": stage " + std::to_string(stage) + " is outside [0, " +
                                std::to_string(stages) + ")");
  if (micro_batches < 0)
    throw std::invalid_argument(std::string(who) + ": the number of micro-batches must not be negative, found " +
                                std::to_string(micro_batches));
}

}  // namespace

std::vector<PipelineAction> one_f_one_b(int stages, int stage, int64_t micro_batches) {
  check_stage_of("one_f_one_b", stages, stage, micro_batches);
  // Each later stage starts its first backward one forward sooner: the last starts at once.
  const int64_t warmup = std::min<int64_t>(stages - stage - 1, micro_batches);
  std::vector<PipelineAction> out;
  out.reserve(static_cast<size_t>(2 * micro_batches));
  for (int64_t i = 0; i < warmup; ++i) out.push_back({PipelineStep::kForward, i, 0});
  for (int64_t i = 0; i < micro_batches - warmup; ++i) {
    out.push_back({PipelineStep::kForward, i + warmup, 0});
    out.push_back({PipelineStep::kBackward, i, 0});
  }
  for (int64_t i = micro_batches - warmup; i < micro_batches; ++i) out.push_back({PipelineStep::kBackward, i, 0});
  return out;
}

std::vector<PipelineAction> interleaved_one_f_one_b(int stages, int stage, int virtual_stages, int64_t micro_batches,
                                                    int microbatch_group_size) {
  check_stage_of("interleaved_one_f_one_b", stages, stage, micro_batches);
  if (virtual_stages < 1)
    throw std::invalid_argument(
        "interleaved_one_f_one_b: --num-virtual-stages-per-pipeline-rank (--virtual-pipeline-model-parallel-size) "
        "must be at least 1, found " + std::to_string(virtual_stages));
  // arguments.py turns a virtual size of 1 into none, and get_forward_backward_func then picks the
  // non-interleaved schedule (whose warm-up is not the interleaved formula with V = 1).
  if (virtual_stages == 1) return one_f_one_b(stages, stage, micro_batches);
  if (stages < 2)
    throw std::invalid_argument(
        "interleaved_one_f_one_b: --num-virtual-stages-per-pipeline-rank (--virtual-pipeline-model-parallel-size) " +
        std::to_string(virtual_stages) + " needs --pipeline-model-parallel-size greater than 1, found " +
        std::to_string(stages));
  const int64_t P = stages, V = virtual_stages, M = micro_batches;
  const int64_t N = microbatch_group_size == 0 ? P : microbatch_group_size;  // ModelParallelConfig's default
  const std::string setting =
      " (micro-batches M = --global-batch-size / (--micro-batch-size x data-parallel size) = " + std::to_string(M) +
      ", --pipeline-model-parallel-size " + std::to_string(P) +
      ", --num-virtual-stages-per-pipeline-rank (--virtual-pipeline-model-parallel-size) " + std::to_string(V) +
      ", --microbatch-group-size-per-virtual-pipeline-stage " + std::to_string(N) + ")";
  // forward_backward_pipelining_with_interleaving's two checks. With the default group size they
  // say M must be a multiple of the pipeline size (and at least it).
  if (N > M || N < P)
    throw std::invalid_argument(
        "interleaved_one_f_one_b: the number of contiguous micro-batches in a virtual pipeline stage must lie in "
        "[pipeline size, micro-batches]; with the default group size the micro-batches must be a multiple of "
        "the pipeline size" + setting);
  const int64_t last_group = M % N;
  if (last_group > 0 && last_group < P)
    throw std::invalid_argument(
        "interleaved_one_f_one_b: the last group of micro-batches (" + std::to_string(last_group) +
        ") is smaller than the pipeline size, which leaves dependency bubbles; the micro-batches must be a "
        "multiple of the group size, or leave a remainder of at least the pipeline size" + setting);

  // get_schedule_table: for each group of N micro-batches (the last group takes the rest), chunk 0
  // runs the group, then chunk 1 runs it, and so on.
  std::vector<std::pair<int64_t, int>> table;
  table.reserve(static_cast<size_t>(M * V));
  for (int64_t lo = 0; lo < M; lo += N) {
    const int64_t hi = lo + N >= M ? M : lo + N;
    for (int c = 0; c < V; ++c)
      for (int64_t m = lo; m < hi; ++m) table.emplace_back(m, c);
  }
  const int64_t total = M * V;
  // get_pp_rank_microbatches: every rank first fills chunks 0..V-2 for one group, and earlier stages
  // run two more forwards per stage behind them so the backwards coming back find work to overlap.
  int64_t warmup = (P - stage - 1) * 2 + (V - 1) * N;
  if (warmup >= total) warmup = total;
  auto forward = [&](int64_t k) { return PipelineAction{PipelineStep::kForward, table[k].first, table[k].second}; };
  // Backward step k walks the same table with the chunks reversed: gradients enter at the last chunk.
  auto backward = [&](int64_t k) {
    return PipelineAction{PipelineStep::kBackward, table[k].first, static_cast<int>(V - 1 - table[k].second)};
  };
  std::vector<PipelineAction> out;
  out.reserve(static_cast<size_t>(2 * total));
  for (int64_t k = 0; k < warmup; ++k) out.push_back(forward(k));
  for (int64_t k = 0; k < total - warmup; ++k) {
    out.push_back(forward(k + warmup));
    out.push_back(backward(k));
  }
  for (int64_t k = total - warmup; k < total; ++k) out.push_back(backward(k));
  return out;
}

int64_t in_flight_peak(const std::vector<PipelineAction>& schedule) {
  int64_t live = 0, peak = 0;
  for (const PipelineAction& a : schedule) {
    live += a.step == PipelineStep::kForward ? 1 : -1;
    peak = std::max(peak, live);
  }
  return peak;
}

}  // namespace mfsdp
