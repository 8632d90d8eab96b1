// pipeline_split against splits worked out by hand from Megatron-Core's get_num_layers_to_build
// (transformer_block.py: how many layers a chunk builds) and get_transformer_layer_offset
// (transformer_layer.py: where they start), and its refusals against the checks of
// TransformerConfig.__post_init__ and validate_args (arguments.py).
#include <gtest/gtest.h>

#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "mfsdp/models/pipeline_split.h"

namespace {

using mfsdp::PipelineChunk;
using mfsdp::PipelineSplitOptions;

PipelineSplitOptions split_of(int64_t layers, int stages, int virtual_stages = 1) {
  PipelineSplitOptions o;
  o.num_layers = layers;
  o.stages = stages;
  o.virtual_stages = virtual_stages;
  return o;
}

// "first_layer+num_layers" per chunk in pipeline_split's order, e.g. "0+4 4+4".
std::string layout(const std::vector<PipelineChunk>& chunks) {
  std::string s;
  for (const PipelineChunk& c : chunks)
    s += (s.empty() ? "" : " ") + std::to_string(c.first_layer) + "+" + std::to_string(c.num_layers);
  return s;
}

// Every substring must be in the message of the std::invalid_argument pipeline_split throws.
void expect_refused(const PipelineSplitOptions& o, const std::vector<std::string>& parts) {
  try {
    mfsdp::pipeline_split(o);
    ADD_FAILURE() << "pipeline_split accepted a split Megatron refuses (expected: " << parts.front() << ")";
  } catch (const std::invalid_argument& e) {
    for (const std::string& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

TEST(PipelineSplit, EvenSplitEightLayersTwoStages) {
  // get_num_layers_to_build: 8 / 2 = 4 per stage; get_transformer_layer_offset: pp_rank * 4.
  const auto chunks = mfsdp::pipeline_split(split_of(8, 2));
  ASSERT_EQ(chunks.size(), 2u);
  EXPECT_EQ(layout(chunks), "0+4 4+4");
  EXPECT_EQ(chunks[0].stage, 0);
  EXPECT_EQ(chunks[1].stage, 1);
  EXPECT_TRUE(chunks[0].embedding);
  EXPECT_FALSE(chunks[0].output);
  EXPECT_FALSE(chunks[1].embedding);
  EXPECT_TRUE(chunks[1].output);
}

TEST(PipelineSplit, InterleavedEightLayersFourStagesTwoVirtual) {
  // get_num_layers_to_build: 8 / 4 = 2 per stage, / 2 = 1 per chunk; offset =
  // vp_stage * (8 / 2) + pp_rank * 1: virtual stage 0 holds layers 0..3, virtual stage 1 4..7.
  const PipelineSplitOptions o = split_of(8, 4, 2);
  const auto chunks = mfsdp::pipeline_split(o);
  EXPECT_EQ(layout(chunks), "0+1 1+1 2+1 3+1 4+1 5+1 6+1 7+1");
  for (size_t i = 0; i < chunks.size(); ++i) {
    EXPECT_EQ(chunks[i].stage, static_cast<int>(i % 4)) << i;
    EXPECT_EQ(chunks[i].virtual_stage, static_cast<int>(i / 4)) << i;
    EXPECT_EQ(chunks[i].embedding, i == 0) << i;
    EXPECT_EQ(chunks[i].output, i == 7) << i;
  }
  const auto stage1 = mfsdp::stage_chunks(o, 1);
  EXPECT_EQ(layout(stage1), "1+1 5+1");
  EXPECT_EQ(stage1[0].virtual_stage, 0);
  EXPECT_EQ(stage1[1].virtual_stage, 1);
}

TEST(PipelineSplit, MegatronsOwnInterleavingExamples) {
  // The comment in get_num_layers_to_build: 8 layers, 2 stages, 4 model chunks:
  //   Stage 0: [0] [2] [4] [6]   Stage 1: [1] [3] [5] [7]
  EXPECT_EQ(layout(mfsdp::stage_chunks(split_of(8, 2, 4), 0)), "0+1 2+1 4+1 6+1");
  EXPECT_EQ(layout(mfsdp::stage_chunks(split_of(8, 2, 4), 1)), "1+1 3+1 5+1 7+1");
  // 8 layers, 2 stages, 2 virtual stages:  Stage 0: [0, 1] [4, 5]   Stage 1: [2, 3] [6, 7]
  EXPECT_EQ(layout(mfsdp::stage_chunks(split_of(8, 2, 2), 0)), "0+2 4+2");
  EXPECT_EQ(layout(mfsdp::stage_chunks(split_of(8, 2, 2), 1)), "2+2 6+2");
}

TEST(PipelineSplit, FirstAndLastStageCountsSpreadTheRestOverTheMiddle) {
  // get_num_layers_to_build, uneven branch: the middle stages share num_layers - first - last;
  // get_transformer_layer_offset: first + middle_rank * per-middle-stage.
  PipelineSplitOptions o = split_of(10, 3);
  o.first_stage_layers = 1;
  o.last_stage_layers = 3;
  EXPECT_EQ(layout(mfsdp::pipeline_split(o)), "0+1 1+6 7+3");  // 10 - 1 - 3 = 6 on the one middle stage

  o = split_of(16, 4);
  o.first_stage_layers = 2;
  o.last_stage_layers = 2;
  EXPECT_EQ(layout(mfsdp::pipeline_split(o)), "0+2 2+6 8+6 14+2");  // 12 over 2 middle stages

  o = split_of(10, 4);
  o.first_stage_layers = 1;  // only the first: the 3 other stages (the last among them) share 9
  EXPECT_EQ(layout(mfsdp::pipeline_split(o)), "0+1 1+3 4+3 7+3");

  o = split_of(10, 3);
  o.last_stage_layers = 4;  // only the last: stages 0 and 1 share 6
  EXPECT_EQ(layout(mfsdp::pipeline_split(o)), "0+3 3+3 6+4");

  o = split_of(10, 2);
  o.first_stage_layers = 3;
  o.last_stage_layers = 7;  // no middle stage and no middle layer: allowed
  EXPECT_EQ(layout(mfsdp::pipeline_split(o)), "0+3 3+7");

  o = split_of(5, 1);
  o.first_stage_layers = 5;  // one stage: its count must be every layer
  EXPECT_EQ(layout(mfsdp::pipeline_split(o)), "0+5");
}

TEST(PipelineSplit, FirstAndLastStageCountsWithVirtualStages) {
  // Megatron supports uneven first/last with virtual stages (TransformerConfig checks each count
  // divides by the virtual size). 16 layers, P=4, V=2, first=2, last=2: per chunk first 1,
  // middle 6 / 2 = 3, last 1. get_transformer_layer_offset: a round is 1 + 12 / 2 + 1 = 8 layers;
  // offset(v, s>0) = v * 8 + 1 + (s - 1) * 3, offset(v, 0) = v * 8.
  PipelineSplitOptions o = split_of(16, 4, 2);
  o.first_stage_layers = 2;
  o.last_stage_layers = 2;
  EXPECT_EQ(layout(mfsdp::pipeline_split(o)), "0+1 1+3 4+3 7+1 8+1 9+3 12+3 15+1");
  EXPECT_EQ(layout(mfsdp::stage_chunks(o, 3)), "7+1 15+1");

  // Only the last count: stages 0 and 1 share 26 - 2 = 24, 12 each, 6 per chunk; the last stage
  // 1 per chunk. A round is 0 + 24 / 2 + 1 = 13; offset(v, s) = v * 13 + s * 6.
  o = split_of(26, 3, 2);
  o.last_stage_layers = 2;
  EXPECT_EQ(layout(mfsdp::pipeline_split(o)), "0+6 6+6 12+1 13+6 19+6 25+1");
}

TEST(PipelineSplit, AccountForEmbeddingAndLossCountEachAsOneLayer) {
  // get_num_layers_to_build: (6 + 1 + 1) / 4 = 2 per stage; the first stage builds one fewer
  // (embedding), the last one fewer (loss). Offset: pp_rank * 2 - 1 past the first stage.
  PipelineSplitOptions o = split_of(6, 4);
  o.account_for_embedding = true;
  o.account_for_loss = true;
  EXPECT_EQ(layout(mfsdp::pipeline_split(o)), "0+1 1+2 3+2 5+1");

  o = split_of(7, 4);
  o.account_for_embedding = true;  // (7 + 1) / 4 = 2: only stage 0 builds one fewer
  EXPECT_EQ(layout(mfsdp::pipeline_split(o)), "0+1 1+2 3+2 5+2");

  o = split_of(7, 4);
  o.account_for_loss = true;  // the loss only: the last stage builds one fewer, offsets unshifted
  EXPECT_EQ(layout(mfsdp::pipeline_split(o)), "0+2 2+2 4+2 6+1");

  // With virtual stages: (14 + 2) / 4 = 4 per stage, 2 per chunk; offset = v * 16 / 2 + s * 2,
  // minus 1 for every chunk but the first. The embedding's chunk is (s 0, v 0), the loss's (s 3, v 1).
  o = split_of(14, 4, 2);
  o.account_for_embedding = true;
  o.account_for_loss = true;
  EXPECT_EQ(layout(mfsdp::pipeline_split(o)), "0+1 1+2 3+2 5+2 7+2 9+2 11+2 13+1");
}

TEST(PipelineSplit, ZeroLayerChunksWhereMegatronAllowsThem) {
  // (6 + 2) / 8 = 1 per stage: the embedding and the loss fill the first and last stages, which
  // build no decoder layer (get_num_layers_to_build asserts only >= 0).
  PipelineSplitOptions o = split_of(6, 8);
  o.account_for_embedding = true;
  o.account_for_loss = true;
  const auto chunks = mfsdp::pipeline_split(o);
  EXPECT_EQ(layout(chunks), "0+0 0+1 1+1 2+1 3+1 4+1 5+1 6+0");
  EXPECT_TRUE(chunks.front().embedding);
  EXPECT_TRUE(chunks.back().output);

  o = split_of(2, 2, 2);
  o.account_for_embedding = true;
  o.account_for_loss = true;  // (2 + 2) / 2 / 2 = 1 per chunk
  EXPECT_EQ(layout(mfsdp::pipeline_split(o)), "0+0 0+1 1+1 2+0");
}

TEST(PipelineSplit, OneStageHoldsEverything) {
  PipelineSplitOptions o = split_of(5, 1);
  auto chunks = mfsdp::pipeline_split(o);
  ASSERT_EQ(chunks.size(), 1u);
  EXPECT_EQ(layout(chunks), "0+5");
  EXPECT_TRUE(chunks[0].embedding);
  EXPECT_TRUE(chunks[0].output);
  o.account_for_embedding = true;
  o.account_for_loss = true;  // 7 / 1, less the embedding and the loss: the 5 decoder layers
  EXPECT_EQ(layout(mfsdp::pipeline_split(o)), "0+5");
}

TEST(PipelineSplit, ChunksTileTheLayersInMegatronsOrder) {
  // Whatever the options, the chunks come as (v * stages + s) and their layers follow one another.
  for (int P : {1, 2, 3, 4, 8})
    for (int V : {1, 2, 3})
      for (int64_t L = 1; L <= 48; ++L)
        for (int flags = 0; flags < 4; ++flags) {
          PipelineSplitOptions o = split_of(L, P, V);
          o.account_for_embedding = flags & 1;
          o.account_for_loss = flags & 2;
          std::vector<PipelineChunk> chunks;
          try {
            chunks = mfsdp::pipeline_split(o);
          } catch (const std::invalid_argument&) {
            continue;
          }
          ASSERT_EQ(chunks.size(), static_cast<size_t>(P * V));
          int64_t next = 0;
          for (size_t i = 0; i < chunks.size(); ++i) {
            EXPECT_EQ(chunks[i].virtual_stage * P + chunks[i].stage, static_cast<int>(i));
            EXPECT_EQ(chunks[i].first_layer, next);
            EXPECT_GE(chunks[i].num_layers, 0);
            next += chunks[i].num_layers;
          }
          EXPECT_EQ(next, L) << "L=" << L << " P=" << P << " V=" << V << " flags=" << flags;
        }
}

TEST(PipelineSplit, RefusesLayersNotDivisibleByStages) {
  // validate_args: "Number of layers should be divisible by the pipeline-model-parallel size".
  expect_refused(split_of(7, 2), {"--num-layers 7", "--pipeline-model-parallel-size 2"});
  PipelineSplitOptions o = split_of(6, 4);
  o.account_for_embedding = true;  // 6 + 1 = 7 over 4
  expect_refused(o, {"--num-layers 6", "--account-for-embedding-in-pipeline-split", "--pipeline-model-parallel-size 4"});
  o = split_of(8, 4);
  o.account_for_loss = true;  // 8 + 1 = 9 over 4
  expect_refused(o, {"--account-for-loss-in-pipeline-split", "--pipeline-model-parallel-size 4"});
}

TEST(PipelineSplit, RefusesStageLayersNotDivisibleByVirtualStages) {
  // get_num_layers_to_build's assert / validate_args' "number of layers per pipeline stage must be
  // divisible number of layers per virtual pipeline stage": 12 / 4 = 3 layers over 2 chunks.
  expect_refused(split_of(12, 4, 2), {"--num-virtual-stages-per-pipeline-rank", "parallel-size) 2", "--pipeline-model-parallel-size 4"});
  PipelineSplitOptions o = split_of(10, 4, 2);
  o.account_for_embedding = true;
  o.account_for_loss = true;  // (10 + 2) / 4 = 3 over 2 chunks
  expect_refused(o, {"--num-virtual-stages-per-pipeline-rank", "3 layers per pipeline stage"});
}

TEST(PipelineSplit, RefusesFirstOrLastCountsWithAccountForFlags) {
  // TransformerConfig: the uneven first/last counts cannot be set with the account-for flags.
  PipelineSplitOptions o = split_of(8, 2);
  o.first_stage_layers = 3;
  o.account_for_embedding = true;
  expect_refused(o, {"--decoder-first-pipeline-num-layers", "--account-for-embedding-in-pipeline-split"});
  o = split_of(8, 2);
  o.last_stage_layers = 3;
  o.account_for_loss = true;
  expect_refused(o, {"--decoder-last-pipeline-num-layers", "--account-for-loss-in-pipeline-split"});
}

TEST(PipelineSplit, RefusesBadFirstAndLastCounts) {
  // TransformerConfig: each count larger than 0 ...
  PipelineSplitOptions o = split_of(8, 2);
  o.first_stage_layers = 0;
  expect_refused(o, {"--decoder-first-pipeline-num-layers 0", "larger than 0"});
  o = split_of(8, 2);
  o.last_stage_layers = -1;
  expect_refused(o, {"--decoder-last-pipeline-num-layers -1", "larger than 0"});
  // ... divisible by the virtual size ...
  o = split_of(16, 4, 2);
  o.first_stage_layers = 3;
  o.last_stage_layers = 3;
  expect_refused(o, {"--decoder-first-pipeline-num-layers 3", "--num-virtual-stages-per-pipeline-rank"});
  o.first_stage_layers = 2;
  expect_refused(o, {"--decoder-last-pipeline-num-layers 3", "--num-virtual-stages-per-pipeline-rank"});
  // ... middle layers iff middle stages ...
  o = split_of(10, 2);
  o.first_stage_layers = 4;
  o.last_stage_layers = 4;  // 2 layers left, no middle stage
  expect_refused(o, {"mismatch", "2 middle layers", "0 middle pipeline stages"});
  o = split_of(10, 3);
  o.first_stage_layers = 5;
  o.last_stage_layers = 5;  // a middle stage, no layer left
  expect_refused(o, {"mismatch", "0 middle layers", "1 middle pipeline stages"});
  // ... the middle layers divisible by the middle stages, then by the virtual size.
  o = split_of(10, 4);
  o.first_stage_layers = 1;
  o.last_stage_layers = 2;  // 7 over 2
  expect_refused(o, {"7 layers", "--decoder-first-pipeline-num-layers", "--pipeline-model-parallel-size 4"});
  o = split_of(10, 4, 2);
  o.first_stage_layers = 2;
  o.last_stage_layers = 2;  // 6 over 2 middle stages = 3 per stage, over 2 chunks
  expect_refused(o, {"3 layers on each middle pipeline stage", "--num-virtual-stages-per-pipeline-rank", "parallel-size) 2"});
}

TEST(PipelineSplit, RefusesWhatMegatronCannotBuild) {
  // first + last above num_layers: Megatron's checks miss it, the middle stage would get -2.
  PipelineSplitOptions o = split_of(6, 3);
  o.first_stage_layers = 4;
  o.last_stage_layers = 4;
  expect_refused(o, {"--decoder-first-pipeline-num-layers 4", "--decoder-last-pipeline-num-layers 4", "--num-layers 6"});
  // Both counts on one stage.
  o = split_of(6, 1);
  o.first_stage_layers = 3;
  o.last_stage_layers = 3;
  expect_refused(o, {"--decoder-first-pipeline-num-layers", "--pipeline-model-parallel-size"});
  // Both counts, no middle stage, virtual stages: get_transformer_layer_offset divides by zero.
  o = split_of(4, 2, 2);
  o.first_stage_layers = 2;
  o.last_stage_layers = 2;
  expect_refused(o, {"--decoder-first-pipeline-num-layers", "no middle stage", "--num-virtual-stages-per-pipeline-rank"});
  // validate_args: the interleaved schedule needs more than one stage.
  expect_refused(split_of(8, 1, 2), {"--num-virtual-stages-per-pipeline-rank", "--pipeline-model-parallel-size"});
  // TransformerConfig divides by num_layers.
  expect_refused(split_of(0, 1), {"--num-layers", "found 0"});
  expect_refused(split_of(8, 0), {"--pipeline-model-parallel-size"});
  expect_refused(split_of(8, 2, 0), {"--num-virtual-stages-per-pipeline-rank"});
  EXPECT_THROW(mfsdp::stage_chunks(split_of(8, 2), 2), std::invalid_argument);
  EXPECT_THROW(mfsdp::stage_chunks(split_of(8, 2), -1), std::invalid_argument);
}

}  // namespace
