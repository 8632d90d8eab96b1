// Megatron's layer split over pipeline and virtual pipeline stages: the checks of
// TransformerConfig.__post_init__ and of validate_args (arguments.py) on the pipeline flags, then
// get_num_layers_to_build's count per chunk, laid out in the order get_transformer_layer_offset's
// offsets follow (chunk (v, s) is the (v * stages + s)-th slice).
#include "mfsdp/models/pipeline_split.h"

#include <stdexcept>
#include <string>

namespace mfsdp {
namespace {

[[noreturn]] void refuse_pipeline_split(const std::string& why) {
  throw std::invalid_argument("pipeline_split: " + why);
}

std::string str_of(int64_t v) { return std::to_string(v); }

// The flags a message names, spelled as Megatron's argparse spells them.
constexpr const char* kNumLayers = "--num-layers";
constexpr const char* kPipelineSize = "--pipeline-model-parallel-size";
constexpr const char* kVirtualSize =
    "--num-virtual-stages-per-pipeline-rank (--virtual-pipeline-model-parallel-size)";
constexpr const char* kFirstLayers = "--decoder-first-pipeline-num-layers";
constexpr const char* kLastLayers = "--decoder-last-pipeline-num-layers";
constexpr const char* kAccountEmbedding = "--account-for-embedding-in-pipeline-split";
constexpr const char* kAccountLoss = "--account-for-loss-in-pipeline-split";

// Layers per stage before the embedding / loss adjustment, for every stage; checks as Megatron does.
std::vector<int64_t> layers_per_stage(const PipelineSplitOptions& o) {
  const int64_t P = o.stages, V = o.virtual_stages, L = o.num_layers;
  const bool uneven = o.first_stage_layers.has_value() || o.last_stage_layers.has_value();
  const bool account = o.account_for_embedding || o.account_for_loss;
  std::vector<int64_t> per_stage(static_cast<size_t>(P), 0);

  if (uneven && account)
    // TransformerConfig: the first/last counts already place the embedding and the loss by hand.
    refuse_pipeline_split(std::string(kFirstLayers) + " / " + kLastLayers + " cannot be set together with " +
                          kAccountEmbedding + " / " + kAccountLoss +
                          " (Megatron's TransformerConfig refuses uneven first/last stages with a standalone "
                          "embedding or loss in the split)");

  if (uneven) {
    int64_t middle_layers = L, middle_stages = P;
    auto take = [&](const std::optional<int64_t>& count, const char* flag, const char* which) {
      if (!count) return;
      if (*count <= 0)
        refuse_pipeline_split(std::string(flag) + " " + str_of(*count) + ": the number of layers on the " + which +
                              " pipeline stage must be larger than 0");
      if (V > 1 && *count % V != 0)
        refuse_pipeline_split(std::string(flag) + " " + str_of(*count) + ": the layers of the " + which +
                              " stage must be divisible by the virtual pipeline degree " + kVirtualSize + " " +
                              str_of(V));
      middle_layers -= *count;
      middle_stages -= 1;
    };
    take(o.first_stage_layers, kFirstLayers, "first");
    take(o.last_stage_layers, kLastLayers, "last");
    // Megatron's own checks let P=1 with both counts through (the one stage would take the last
    // count, silently ignoring the first); a single stage cannot hold two different counts.
    if (middle_stages < 0)
      refuse_pipeline_split(std::string(kFirstLayers) + " and " + kLastLayers + " need " + kPipelineSize +
                            " of at least 2, found " + str_of(P));
    // Megatron checks only that middle layers and middle stages are both zero or both not;
    // first + last above num_layers would leave the middle stages a negative count.
    if (middle_layers < 0)
      refuse_pipeline_split(std::string(kFirstLayers) + " " + str_of(o.first_stage_layers.value_or(0)) + " + " +
                            kLastLayers + " " + str_of(o.last_stage_layers.value_or(0)) + " exceed " + kNumLayers +
                            " " + str_of(L));
    if ((middle_layers != 0) != (middle_stages != 0))
      refuse_pipeline_split("mismatch: " + str_of(middle_layers) + " middle layers remaining but " +
                            str_of(middle_stages) + " middle pipeline stages available (" + kNumLayers + " " +
                            str_of(L) + ", " + kPipelineSize + " " + str_of(P) + ", " + kFirstLayers + " " +
                            (o.first_stage_layers ? str_of(*o.first_stage_layers) : "unset") + ", " + kLastLayers +
                            " " + (o.last_stage_layers ? str_of(*o.last_stage_layers) : "unset") + ")");
    // Megatron's checks let this through, but get_transformer_layer_offset then divides by the zero
    // middle stages: Megatron cannot build it, so neither do we.
    if (V > 1 && middle_stages == 0)
      refuse_pipeline_split(std::string(kFirstLayers) + " and " + kLastLayers + " with no middle stage (" +
                            kPipelineSize + " " + str_of(P) + ") do not work with " + kVirtualSize + " " + str_of(V) +
                            ": Megatron's layer offset divides by the number of middle stages");
    int64_t per_middle = 0;
    if (middle_stages > 0) {
      if (middle_layers % middle_stages != 0)
        refuse_pipeline_split("the " + str_of(middle_layers) + " layers left after " + kFirstLayers + " / " +
                              kLastLayers + " must be divisible by the " + str_of(middle_stages) +
                              " middle stages of " + kPipelineSize + " " + str_of(P));
      per_middle = middle_layers / middle_stages;
      if (V > 1 && per_middle % V != 0)
        refuse_pipeline_split("the " + str_of(per_middle) + " layers on each middle pipeline stage must be divisible by " +
                              kVirtualSize + " " + str_of(V));
    }
    for (int64_t s = 0; s < P; ++s) per_stage[s] = per_middle;
    // With P = 1 only one of the two is set (refused above otherwise), and it equals num_layers.
    if (o.first_stage_layers) per_stage.front() = *o.first_stage_layers;
    if (o.last_stage_layers) per_stage.back() = *o.last_stage_layers;
    return per_stage;
  }

  // Even split; the embedding and the loss each count as one layer when accounted for.
  const int64_t counted = L + (o.account_for_embedding ? 1 : 0) + (o.account_for_loss ? 1 : 0);
  if (counted % P != 0) {
    std::string what = std::string(kNumLayers) + " " + str_of(L);
    if (account)
      what += std::string(" (") + str_of(counted) + " counting " +
              (o.account_for_embedding && o.account_for_loss ? std::string(kAccountEmbedding) + " and " + kAccountLoss
               : o.account_for_embedding                     ? std::string(kAccountEmbedding)
                                                             : std::string(kAccountLoss)) +
              ")";
    refuse_pipeline_split(what + " is not divisible by " + kPipelineSize + " " + str_of(P) +
                          "; for an uneven split set " + kFirstLayers + " / " + kLastLayers);
  }
  const int64_t per_rank = counted / P;
  if (V > 1 && per_rank % V != 0)
    refuse_pipeline_split("the " + str_of(per_rank) + " layers per pipeline stage (" + kNumLayers + " " + str_of(L) +
                          (account ? " with the embedding/loss counted" : "") + " over " + kPipelineSize + " " +
                          str_of(P) + ") are not divisible by " + kVirtualSize + " " + str_of(V) +
                          " (--num-layers-per-virtual-pipeline-stage must divide them)");
  for (auto& n : per_stage) n = per_rank;
  return per_stage;
}

}  // namespace

std::vector<PipelineChunk> pipeline_split(const PipelineSplitOptions& o) {
  if (o.stages < 1) refuse_pipeline_split(std::string(kPipelineSize) + " must be at least 1, found " + str_of(o.stages));
  if (o.virtual_stages < 1)
    refuse_pipeline_split(std::string(kVirtualSize) + " must be at least 1, found " + str_of(o.virtual_stages));
  // Megatron's TransformerConfig fails on zero layers (a division by num_layers).
  if (o.num_layers < 1) refuse_pipeline_split(std::string(kNumLayers) + " must be at least 1, found " + str_of(o.num_layers));
  // validate_args: the interleaved schedule needs more than one stage (more than two without
  // --overlap-p2p-communication, which is on by default and is the schedule's business, not the split's).
  if (o.virtual_stages > 1 && o.stages < 2)
    refuse_pipeline_split(std::string(kVirtualSize) + " " + str_of(o.virtual_stages) +
                          ": the interleaved schedule needs " + kPipelineSize + " greater than 1, found " +
                          str_of(o.stages));

  const std::vector<int64_t> per_stage = layers_per_stage(o);
  const int P = o.stages, V = o.virtual_stages;
  std::vector<PipelineChunk> chunks;
  chunks.reserve(static_cast<size_t>(P) * V);
  int64_t next_layer = 0;
  // Layers go round the stages once per virtual stage (get_transformer_layer_offset's
  // vp_stage * layers-per-round + the stages before this one within the round).
  for (int v = 0; v < V; ++v) {
    for (int s = 0; s < P; ++s) {
      PipelineChunk c;
      c.stage = s;
      c.virtual_stage = v;
      c.embedding = s == 0 && v == 0;
      c.output = s == P - 1 && v == V - 1;
      c.num_layers = per_stage[s] / V;  // divisibility was checked above
      // The embedding (loss) took one layer's place in the division but is not a decoder layer.
      if (o.account_for_embedding && c.embedding) c.num_layers -= 1;
      if (o.account_for_loss && c.output) c.num_layers -= 1;
      if (c.num_layers < 0)
        refuse_pipeline_split("not enough layers in stage " + std::to_string(s) + ", virtual stage " +
                              std::to_string(v) + " for the embedding and the loss it accounts for");
      c.first_layer = next_layer;
      next_layer += c.num_layers;
      chunks.push_back(c);
    }
  }
  return chunks;
}

std::vector<PipelineChunk> stage_chunks(const PipelineSplitOptions& options, int stage) {
  if (stage < 0 || stage >= options.stages)
    refuse_pipeline_split("stage " + std::to_string(stage) + " is outside [0, " + kPipelineSize + " " +
                          std::to_string(options.stages) + ")");
  std::vector<PipelineChunk> mine;
  for (const PipelineChunk& c : pipeline_split(options))
    if (c.stage == stage) mine.push_back(c);
  return mine;
}

}  // namespace mfsdp
