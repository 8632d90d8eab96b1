// The activation plan (include/mfsdp/train/activation_plan.h): the measured per-token formula of
// a dense layer, recompute's effect on it, and --memory-plan's lines.
#include "mfsdp/train/activation_plan.h"

#include <algorithm>
#include <iomanip>
#include <sstream>
#include <string>

#include "mfsdp/models/chunked_output.h"
#include "mfsdp/train/parallel_dims.h"
#include "mfsdp/train/pretrain_args.h"

namespace mfsdp {

namespace {

struct LayerTerms {
  double always, core_attn, norms, mlp;
};

LayerTerms terms_of(const LayerActivationShape& s) {
  const double h = static_cast<double>(s.hidden) / static_cast<double>(std::max<int64_t>(s.hidden_split, 1));
  const double a = static_cast<double>(s.heads * s.head_dim), k = static_cast<double>(s.kv_heads * s.head_dim);
  // Core attention keeps a log-sum-exp per head: SDPA matches query heads to their key/value
  // group itself on the causal path the trainer runs (no mask), so no expanded copy of k and v.
  return {4 * h + 2 * a + 2 * k, static_cast<double>(s.heads), 2 * h + 2, 4 * static_cast<double>(s.ffn)};
}

double mib(double bytes) { return bytes / 1048576.0; }

}  // namespace

double layer_activation_elements(const LayerActivationShape& shape, const RecomputeOptions& recompute) {
  const LayerTerms t = terms_of(shape);
  const bool selective = recompute.granularity == RecomputeOptions::Granularity::kSelective;
  return t.always + (selective && recompute.core_attn ? 0 : t.core_attn) + (selective && recompute.layernorm ? 0 : t.norms) +
         (selective && recompute.mlp ? 0 : t.mlp);
}

ActivationPlan plan_activations(const LayerActivationShape& shape, int64_t layers, int64_t tokens,
                                int64_t element_bytes, const RecomputeOptions& recompute) {
  const double per_token = static_cast<double>(tokens * element_bytes);
  const double whole = layer_activation_elements(shape, RecomputeOptions{}) * per_token;
  ActivationPlan plan;
  if (recompute.granularity != RecomputeOptions::Granularity::kFull) {
    plan.kept_bytes = static_cast<int64_t>(layer_activation_elements(shape, recompute) * per_token) * layers;
    return plan;
  }
  // A checkpoint keeps its input, one hidden-sized row per token (split under sequence parallelism).
  const double input = static_cast<double>(shape.hidden) / static_cast<double>(std::max<int64_t>(shape.hidden_split, 1)) * per_token;
  const int64_t n = std::max<int64_t>(recompute.num_layers, 1);
  if (recompute.method == RecomputeOptions::Method::kUniform) {
    const int64_t checkpoints = (layers + n - 1) / n;
    plan.kept_bytes = static_cast<int64_t>(input) * checkpoints;
    plan.recompute_bytes = static_cast<int64_t>(whole) * std::min(n, layers);
  } else {
    const int64_t recomputed = std::min(n, layers);
    plan.kept_bytes = static_cast<int64_t>(input) * recomputed + static_cast<int64_t>(whole) * (layers - recomputed);
    plan.recompute_bytes = recomputed > 0 ? static_cast<int64_t>(whole) : 0;
  }
  return plan;
}

void print_activation_plan(const PretrainArgs& a, const ParallelDims& dims, const RecomputeOptions& recompute,
                           std::ostream& log) {
  const int64_t tokens = a.micro_batch_size * a.seq_length / std::max(dims.cp, 1);
  const int64_t element_bytes = a.bf16 ? 2 : 4;
  const int64_t tp = std::max(dims.tp, 1);
  std::ostringstream out;
  out << std::fixed << std::setprecision(1);
  if (a.num_experts > 0 || a.multi_latent_attention || dims.pp > 1) {
    out << " activations: not planned for "
        << (a.num_experts > 0 ? "MoE layers" : a.multi_latent_attention ? "multi-latent attention" : "pipeline stages")
        << " (the per-layer formula is the dense Llama layer's, docs/model.md)\n";
    log << out.str();
    return;
  }
  LayerActivationShape shape;
  shape.hidden = a.hidden_size;
  shape.ffn = a.ffn_hidden_size / tp;
  shape.heads = a.num_attention_heads / tp;
  shape.kv_heads = std::max<int64_t>(a.num_query_groups / tp, 1);
  shape.head_dim = a.kv_channels > 0 ? a.kv_channels : a.hidden_size / a.num_attention_heads;
  shape.hidden_split = a.sequence_parallel ? tp : 1;
  const ActivationPlan plan = plan_activations(shape, a.num_layers, tokens, element_bytes, recompute);
  const char* mode = recompute.granularity == RecomputeOptions::Granularity::kFull        ? "full recompute"
                     : recompute.granularity == RecomputeOptions::Granularity::kSelective ? "selective recompute"
                                                                                          : "no recompute";
  out << " activations of one micro-batch (" << tokens << " tokens on this rank, " << element_bytes
      << " B an element" << (a.bf16 ? ", the norms' fp32 statistics not counted" : "") << "; " << mode
      << "): decoder layers keep " << mib(static_cast<double>(plan.kept_bytes)) << " MiB ("
      << layer_activation_elements(shape, recompute.granularity == RecomputeOptions::Granularity::kFull ? RecomputeOptions{} : recompute)
      << " elements a token a layer" << (recompute.granularity == RecomputeOptions::Granularity::kFull ? " without recompute" : "")
      << ")";
  if (plan.recompute_bytes > 0) out << ", plus " << mib(static_cast<double>(plan.recompute_bytes)) << " MiB while a checkpoint is recomputed";
  const double vocab_rows = static_cast<double>(a.padded_vocab_size / tp);
  if (a.cross_entropy_loss_fusion) {
    const double chunk = static_cast<double>(a.cross_entropy_chunk_elements > 0 ? a.cross_entropy_chunk_elements : kDefaultChunkElements);
    out << "; the fused loss holds one chunk of "
        << static_cast<int64_t>(std::min(chunk, vocab_rows * static_cast<double>(tokens)))
        << " logits elements at a time (a few fp32 copies of it), not the full logits";
  } else {
    out << "; the full logits: " << mib(vocab_rows * static_cast<double>(tokens) * 4) << " MiB a fp32 copy (2-3 at once)";
  }
  if (tp > 1 || dims.cp > 1) out << " (under TP/CP scaled by the split: not measured)";
  out << "\n";
  log << out.str();
}

}  // namespace mfsdp
