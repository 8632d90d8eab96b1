// Megatron-LM's split of the decoder layers over pipeline stages and virtual pipeline stages
// (model chunks): the number of layers each chunk builds (Megatron-Core's
// get_num_layers_to_build in transformer_block.py), where its layers start (get_transformer_layer_offset
// in transformer_layer.py), and the combinations Megatron refuses (TransformerConfig.__post_init__
// and the pipeline checks of megatron/training/arguments.py's validate_args). Pure logic: nothing
// here builds a module.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace mfsdp {

// Megatron's layer split over pipeline stages (and virtual stages).
struct PipelineSplitOptions {
  int64_t num_layers = 0;  // --num-layers
  int stages = 1;          // --pipeline-model-parallel-size
  // Model chunks per stage (--num-virtual-stages-per-pipeline-rank, formerly
  // --virtual-pipeline-model-parallel-size, or derived from --num-layers-per-virtual-pipeline-stage
  // by the caller, which also refuses that flag with the first/last counts below, as arguments.py
  // does: only the caller knows which flag set it). 1: no interleaving.
  int virtual_stages = 1;
  std::optional<int64_t> first_stage_layers;  // --decoder-first-pipeline-num-layers
  std::optional<int64_t> last_stage_layers;   // --decoder-last-pipeline-num-layers
  bool account_for_embedding = false;         // --account-for-embedding-in-pipeline-split
  bool account_for_loss = false;              // --account-for-loss-in-pipeline-split
};

// One model chunk: the decoder layers [first_layer, first_layer + num_layers) (global indices),
// and whether it holds the embedding (the first chunk of stage 0) and the output layer and loss
// (the last chunk of the last stage).
struct PipelineChunk {
  int stage = 0;
  int virtual_stage = 0;
  int64_t first_layer = 0;
  int64_t num_layers = 0;
  bool embedding = false;
  bool output = false;
};

// Every chunk of the model in Megatron's order of the layers: virtual stage v of stage s holds the
// (v * stages + s)-th slice of the layers, so the result is sorted by (virtual_stage, stage) and
// its first_layer values ascend with no gap. Megatron's rules:
//  - by default every stage gets num_layers / stages layers, and each of its chunks 1/virtual_stages
//    of them;
//  - first_stage_layers / last_stage_layers fix stage 0's / the last stage's count, the rest spread
//    evenly over the stages between (each count split evenly over the virtual stages);
//  - account_for_embedding / account_for_loss count the embedding / the loss as one layer each in
//    that division, and the first / last chunk builds one layer fewer (zero is allowed there).
// Throws std::invalid_argument naming the Megatron flags and the numbers for every combination
// Megatron refuses.
std::vector<PipelineChunk> pipeline_split(const PipelineSplitOptions& options);

// The chunks of `stage`, in virtual-stage order (throws std::invalid_argument for a stage outside
// [0, stages) and as pipeline_split does).
std::vector<PipelineChunk> stage_chunks(const PipelineSplitOptions& options, int stage);

}  // namespace mfsdp
