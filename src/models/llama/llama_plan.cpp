// The Llama family's parallel plan (include/mfsdp/models/llama.h, llama_parallel_plan):
// Megatron's layout of a GPT layer, by Hugging Face parameter and module names.
#include "mfsdp/models/llama.h"

#include <algorithm>
#include <string>

namespace mfsdp {

ParallelPlan llama_parallel_plan(const LlamaConfig& c, bool experts_apart, const std::vector<PipelineChunk>& chunks) {
  using Split = TensorParallelSplit;
  using Boundary = TensorParallelBoundary;
  ParallelPlan plan;
  // Routed experts first: their gate/up (w1/w3) column-parallel and down (w2) row-parallel under
  // expert tensor parallelism, as a dense MLP's.
  for (const char* column : {"gate_proj", "up_proj", "w1", "w3"})
    plan.experts.emplace_back(std::string("model.layers.*.experts.*.") + column + ".*", Split::kRows);
  plan.experts.emplace_back("model.layers.*.experts.*", Split::kColumns);
  // The vocabulary-parallel embedding and output layer; column-parallel q/k/v (weights and
  // Qwen2's biases: this rank's heads) and MLP gate/up (the dense MLP's and a shared expert's);
  // row-parallel o_proj and down_proj.
  plan.tensor_parallel = {{"model.embed_tokens.weight", Split::kRows}, {"lm_head.weight", Split::kRows}};
  // Multi-head latent attention: its query (or the query's up-projection) and the latent's
  // key/value up-projection give this rank's heads.
  const std::vector<const char*> attention_columns =
      c.mla ? std::vector<const char*>{"q_proj", "q_b_proj", "kv_b_proj"}
            : std::vector<const char*>{"q_proj", "k_proj", "v_proj"};
  for (const char* column : attention_columns)
    plan.tensor_parallel.emplace_back(std::string("model.layers.*.self_attn.") + column + ".*", Split::kRows);
  for (const char* column : {"gate_proj", "up_proj"})
    plan.tensor_parallel.emplace_back(std::string("model.layers.*.") + column + ".*", Split::kRows);
  plan.tensor_parallel.emplace_back("model.layers.*.self_attn.o_proj.weight", Split::kColumns);
  plan.tensor_parallel.emplace_back("model.layers.*.down_proj.weight", Split::kColumns);
  // A per-head norm sees only this rank's heads, and so do MLA's down-projections and their
  // norms (only this rank's heads read the latents); under sequence parallelism every norm sees
  // only this rank's positions, and so do the router and the shared expert's gate (MoE layers
  // route each rank's slice of the sequence), and MLA's o_proj bias (added after the region).
  plan.partial_gradients = {"model.layers.*.self_attn.q_norm.weight", "model.layers.*.self_attn.k_norm.weight",
                            "model.layers.*.self_attn.q_a_*", "model.layers.*.self_attn.kv_a_*"};
  plan.sequence_partial_gradients = {"*norm.weight", "model.layers.*.gate.weight",
                                     "model.layers.*.shared_expert_gate.weight",
                                     "model.layers.*.self_attn.o_proj.bias"};
  // The regions: each attention, dense MLP and shared expert; the embedding looks up its
  // vocabulary rows; the root's boundary is the output layer's input. Expert parallelism
  // reaches each MoE block.
  plan.boundaries = {{"", Boundary::kInput},
                     {"model.embed_tokens", Boundary::kVocabulary},
                     {"model.layers.*.self_attn", Boundary::kRegion}};
  const std::string moe = c.moe.mixtral_names ? "block_sparse_moe" : "mlp";
  const std::string shared = c.moe.shared_experts_name ? "shared_experts" : "shared_expert";
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string layer = "model.layers." + std::to_string(i) + ".";
    if (!c.moe.is_moe_layer(i)) {
      plan.boundaries.emplace_back(layer + "mlp", Boundary::kRegion);
      continue;
    }
    plan.expert_parallel.push_back(layer + moe);
    if (c.moe.shared_expert_intermediate_size > 0)
      plan.boundaries.emplace_back(layer + moe + "." + shared, Boundary::kRegion);
  }
  plan.context_parallel = {"model", "model.layers.*.self_attn"};

  // The forward enters the root, then embed_tokens (a unit when untied, not gathered for its
  // backward), every decoder layer (with its experts inside), lm_head (a unit when untied). The
  // root's own gradients (the final norm) are complete right after lm_head's backward when
  // untied; tied, the root also holds the embedding, whose gradient comes last.
  //
  // A pipeline chunk has the units of its own layers, and the embedding and lm_head only where it
  // holds them. With tied embeddings split over stages, each end's embedding weight is a unit of
  // its own (the last stage's computes the logits, so it is gathered for its backward): the two
  // copies then have the same flat layout, and their gradients are summed shard by shard.
  const bool untied = !c.tie_word_embeddings;
  bool first = chunks.empty(), last = chunks.empty();
  std::vector<int64_t> layers;
  for (const PipelineChunk& k : chunks) {
    first = first || k.embedding;
    last = last || k.output;
    for (int64_t i = k.first_layer; i < k.first_layer + k.num_layers; ++i) layers.push_back(i);
  }
  if (chunks.empty())
    for (int64_t i = 0; i < c.num_layers; ++i) layers.push_back(i);
  std::sort(layers.begin(), layers.end());
  const bool split_tied = !untied && !(first && last);
  plan.fsdp_units.push_back({""});
  if ((untied || split_tied) && first) plan.fsdp_units.push_back({"model.embed_tokens", -1, /*unshard_in_backward=*/false});
  for (int64_t i : layers) {
    const std::string layer = "model.layers." + std::to_string(i);
    plan.fsdp_units.push_back({layer, i});
    if (experts_apart && c.moe.is_moe_layer(i))
      plan.fsdp_units.push_back({layer + "." + moe + ".experts", i, /*unshard_in_backward=*/true, /*experts=*/true});
  }
  if (untied && last) plan.fsdp_units.push_back({"lm_head"});
  if (split_tied && last && !first) plan.fsdp_units.push_back({"model.embed_tokens"});
  // The root's own gradients (the final norm) are complete once the output layer's backward ran:
  // right after the first unit's when the output layer is a unit (it runs last in forward, first
  // in backward); else after the whole backward.
  const bool output_unit = last && (untied || split_tied);
  plan.root_gradients_after =
      output_unit && plan.fsdp_units.size() > 1 ? 1 : static_cast<int>(plan.fsdp_units.size()) - 1;
  // Several chunks (interleaving) run the units in no one order: unknown, planned from above.
  if (chunks.size() > 1) plan.root_gradients_after = -1;
  return plan;
}

}  // namespace mfsdp
