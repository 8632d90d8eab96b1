// Each section's own checks (include/mfsdp/train/config/sections.h). The messages name the flag, as
// Megatron's argparse errors do, and each check says why the value cannot train.
#include "mfsdp/train/config/sections.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <tuple>

#include "mfsdp/data/gpt_dataset.h"
#include "mfsdp/models/model_spec.h"
#include "train/tool_flags.h"

namespace mfsdp {
namespace {

std::string number(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

void at_least(const char* flag, double v, double min) {
  if (!(v >= min)) flag_error(flag, "must be >= " + number(min) + ", got " + number(v));
}

void positive(const char* flag, int64_t v) {
  if (v < 1) flag_error(flag, "must be >= 1, got " + std::to_string(v));
}

void at_most(const char* flag, int64_t v, int64_t max) {
  if (v > max) flag_error(flag, "must be at most " + std::to_string(max) + ", got " + std::to_string(v));
}

// Learning rates and the like become fp32 scalars of the optimizer's kernels.
void fits_fp32(const char* flag, double v) {
  if (v > std::numeric_limits<float>::max())
    flag_error(flag, number(v) + " is beyond fp32's range (at most " + number(std::numeric_limits<float>::max()) + ")");
}

// Where the run will write `path` (a folder with `folder`, else a file): what exists of it must
// be of that kind, and its nearest existing folder writable, so that a run does not train for
// hours and then fail to save. Checks only: nothing is created here.
void check_output_path(const char* flag, const std::string& path, bool folder) {
  if (path.empty()) return;
  namespace fs = std::filesystem;
  std::error_code ec;  // the error_code forms: a path we may not look into is "not there"
  const fs::path p = fs::absolute(path, ec);
  if (ec) flag_error(flag, "'" + path + "': " + ec.message());
  if (folder && fs::exists(p, ec) && !fs::is_directory(p, ec))
    flag_error(flag, "'" + path + "' exists and is not a folder");
  if (!folder && fs::is_directory(p, ec)) flag_error(flag, "'" + path + "' is a folder, not a file");
  fs::path existing = folder ? p : p.parent_path();
  while (!existing.empty() && existing != existing.root_path() && !fs::exists(existing, ec))
    existing = existing.parent_path();
  if (!fs::is_directory(existing, ec))
    flag_error(flag, "cannot create '" + path + "': '" + existing.string() + "' is not a folder");
  if (access(existing.c_str(), W_OK | X_OK) != 0)
    flag_error(flag, "cannot write '" + path + "': the folder '" + existing.string() + "' is not writable");
}

}  // namespace

void flag_error(const std::string& flag, const std::string& what) {
  throw std::invalid_argument(flag + ": " + what);
}

const char* section_title(Section s) {
  switch (s) {
    case Section::kModel: return "model: the transformer (Megatron's network size arguments)";
    case Section::kMoe: return "mixture of experts (Megatron's MoE arguments; inert without --num-experts)";
    case Section::kTokenizer: return "tokenizer";
    case Section::kData: return "data: the pretraining corpus";
    case Section::kTraining: return "training: batches, iterations, precision";
    case Section::kOptimizer: return "optimizer and learning-rate schedule";
    case Section::kCheckpoint: return "checkpoints";
    case Section::kParallel: return "parallel: tensor, context, expert, pipeline and hybrid data parallelism (Megatron's layout)";
    case Section::kFsdp: return "Megatron-FSDP and the distributed optimizer";
    case Section::kRuntime: return "runtime: device, collectives, host memory, attention kernels";
    case Section::kLogging: return "logging and evaluation";
    case Section::kProfiling: return "profiling";
    case Section::kPretraining: return "mfsdp-pretrain only: loss normalisation, samples, simulated scale";
  }
  return "?";
}

const std::vector<Section>& all_sections() {
  static const std::vector<Section> all = {Section::kModel,      Section::kMoe,       Section::kTokenizer, Section::kData,
                                           Section::kTraining,   Section::kOptimizer, Section::kCheckpoint,
                                           Section::kParallel,   Section::kFsdp,       Section::kRuntime,   Section::kLogging,
                                           Section::kProfiling,  Section::kPretraining};
  return all;
}

std::vector<ToolFlag> ModelSection::flags() {
  return {
      int_flag("--num-layers", num_layers, "decoder layers"),
      int_flag("--hidden-size", hidden_size, "model width"),
      int_flag("--ffn-hidden-size", ffn_hidden_size,
               "MLP width (0: Megatron's default, 4 x hidden, or with --swiglu int(4 x hidden x 2/3 / 64) x 64)"),
      int_flag("--num-attention-heads", num_attention_heads, "attention heads"),
      bool_flag("--group-query-attention", group_query_attention, "grouped-query attention"),
      int_flag("--num-query-groups", num_query_groups, "key/value heads with --group-query-attention"),
      int_flag("--max-position-embeddings", max_position_embeddings, "longest position (0: --seq-length)"),
      string_flag("--normalization", normalization, "normalization layer", {"RMSNorm"}),
      bool_flag("--swiglu", swiglu,
                "SwiGLU MLP (gate_proj, up_proj, down_proj), as Llama and Qwen2 have; without it Megatron's GeLU "
                "MLP (up_proj, down_proj), which has no Hugging Face export"),
      string_flag("--position-embedding-type", position_embedding_type, "position embedding", {"rope"}),
      double_flag("--rotary-base", rotary_base, "RoPE base (theta)"),
      bool_flag("--untie-embeddings-and-output-weights", untie_embeddings_and_output_weights,
                "separate output layer (lm_head) instead of the embedding"),
      double_flag("--init-method-std", init_method_std, "std of the normal weight init"),
      double_flag("--norm-epsilon", norm_epsilon, "RMSNorm epsilon"),
      int_flag("--make-vocab-size-divisible-by", make_vocab_size_divisible_by,
               "pad the embedding rows to a multiple of this"),
      bool_flag("--recompute-activations", recompute_activations,
                "selective activation recompute (as --recompute-granularity selective; Megatron's meaning)"),
      string_flag("--recompute-granularity", recompute_granularity,
                  "activation recompute: full, whole layers (with --recompute-method and --recompute-num-layers); "
                  "selective, the --recompute-modules of every layer",
                  {"full", "selective"}),
      string_flag("--recompute-method", recompute_method,
                  "full recompute: uniform, the layers in groups of --recompute-num-layers, each group one "
                  "checkpoint; block, only the first --recompute-num-layers layers of each pipeline chunk",
                  {"uniform", "block"}),
      int_flag("--recompute-num-layers", recompute_num_layers,
               "full recompute: layers per group (uniform) or layers recomputed per pipeline chunk (block); -1: unset"),
      // argparse's nargs: every value up to the next flag (tool_flags.cpp has no string-list kind).
      ToolFlag{"--recompute-modules",
               "selective recompute: any of core_attn, layernorm, mlp, moe, moe_act, mla_up_proj, shared_experts "
               "(default: core_attn)",
               true,
               {},
               [this](const std::string& v) {
                 std::vector<std::string> values;
                 std::istringstream in(v);
                 for (std::string word; in >> word;) values.push_back(word);
                 if (values.empty()) flag_error("--recompute-modules", "needs at least one value");
                 recompute_modules = std::move(values);
               },
               [this] {
                 std::string out;
                 for (const std::string& m : recompute_modules) out += (out.empty() ? "" : " ") + m;
                 return out.empty() ? std::string("unset") : out;
               },
               /*many_values=*/true},
      bool_flag("--cross-entropy-loss-fusion", cross_entropy_loss_fusion,
                "the output layer and the loss computed together in chunks of the vocabulary, so no rank holds "
                "the full logits (the default here)"),
      bool_flag("--no-cross-entropy-loss-fusion", cross_entropy_loss_fusion,
                "the full logits, then the loss (the plain composition)", false),
      string_flag("--cross-entropy-fusion-impl", cross_entropy_fusion_impl,
                  "the fused loss's implementation (Megatron's 'te' needs Transformer Engine)", {"native"}),
      int_flag("--cross-entropy-chunk-elements", cross_entropy_chunk_elements,
               "the fused loss's logits elements at once, tokens x vocabulary rows (0: 16777216)"),
      bool_flag("--qk-layernorm", qk_layernorm, "RMSNorm over each query and key head before RoPE (Qwen3)"),
      int_flag("--kv-channels", kv_channels, "each attention head's width (0: --hidden-size / --num-attention-heads)"),
      bool_flag("--multi-latent-attention", multi_latent_attention,
                "multi-head latent attention (DeepSeek-V3)"),
      int_flag("--q-lora-rank", q_lora_rank, "MLA: the query's low-rank width (0: a plain query projection)"),
      int_flag("--kv-lora-rank", kv_lora_rank, "MLA: the key/value latent's width"),
      int_flag("--qk-head-dim", qk_head_dim, "MLA: each query/key head's width without RoPE"),
      int_flag("--qk-pos-emb-head-dim", qk_pos_emb_head_dim, "MLA: each query/key head's RoPE width"),
      int_flag("--v-head-dim", v_head_dim, "MLA: each value head's width"),
      double_flag("--rotary-scaling-factor", rotary_scaling_factor,
                  "MLA: YaRN's scaling factor over --max-position-embeddings (1: plain RoPE)"),
      double_flag("--mscale", mscale, "MLA with YaRN: mscale"),
      double_flag("--mscale-all-dim", mscale_all_dim, "MLA with YaRN: mscale_all_dim (0: unset)"),
  };
}

void ModelSection::validate() {
  at_least("--ffn-hidden-size", static_cast<double>(ffn_hidden_size), 0);
  at_least("--max-position-embeddings", static_cast<double>(max_position_embeddings), 0);
  at_most("--num-layers", num_layers, kMaxLayers);
  at_most("--hidden-size", hidden_size, kMaxHiddenSize);
  at_most("--ffn-hidden-size", ffn_hidden_size, kMaxFfnHiddenSize);
  at_most("--max-position-embeddings", max_position_embeddings, kMaxSequenceLength);
  at_least("--init-method-std", init_method_std, 0);
  at_least("--norm-epsilon", norm_epsilon, 0);
  fits_fp32("--init-method-std", init_method_std);
  fits_fp32("--norm-epsilon", norm_epsilon);
  if (!(rotary_base > 0)) flag_error("--rotary-base", "must be > 0, got " + number(rotary_base));
  positive("--num-layers", num_layers);
  positive("--hidden-size", hidden_size);
  positive("--num-attention-heads", num_attention_heads);
  at_least("--kv-channels", static_cast<double>(kv_channels), 0);
  at_most("--kv-channels", kv_channels, kMaxHiddenSize);  // the model's bound on head_dim
  if (kv_channels % 2 != 0) flag_error("--kv-channels", "must be even for RoPE, got " + std::to_string(kv_channels));
  if (kv_channels == 0 && hidden_size % num_attention_heads != 0)
    flag_error("--hidden-size", std::to_string(hidden_size) + " is not divisible by --num-attention-heads " +
                                    std::to_string(num_attention_heads));
  // The model's bound (a head is at least one channel of the width).
  if (num_attention_heads > hidden_size)
    flag_error("--num-attention-heads", "must be at most --hidden-size " + std::to_string(hidden_size) + ", got " +
                                            std::to_string(num_attention_heads));
  if (!group_query_attention) num_query_groups = num_attention_heads;
  positive("--num-query-groups", num_query_groups);
  if (kv_channels == 0 && hidden_size / num_attention_heads % 2 != 0)
    flag_error("--num-attention-heads", "gives an odd head size " + std::to_string(hidden_size / num_attention_heads) +
                                            " (--hidden-size / --num-attention-heads); RoPE needs an even one");
  if (num_attention_heads % num_query_groups != 0)
    flag_error("--num-query-groups", std::to_string(num_query_groups) + " does not divide --num-attention-heads " +
                                         std::to_string(num_attention_heads));
  if (ffn_hidden_size == 0) {
    ffn_hidden_size = megatron_default_ffn_hidden_size(hidden_size, swiglu);
    if (ffn_hidden_size == 0)
      flag_error("--ffn-hidden-size", "is needed: Megatron's default with --swiglu, int(4 x --hidden-size " +
                                          std::to_string(hidden_size) + " x 2/3 / 64) x 64, is 0");
  }
  positive("--make-vocab-size-divisible-by", make_vocab_size_divisible_by);
  if (make_vocab_size_divisible_by > kMaxVocabSize)
    flag_error("--make-vocab-size-divisible-by", "must be at most " + std::to_string(kMaxVocabSize) +
                                                     " (the largest vocabulary), got " +
                                                     std::to_string(make_vocab_size_divisible_by));
  validate_recompute_flags();
  at_least("--cross-entropy-chunk-elements", static_cast<double>(cross_entropy_chunk_elements), 0);
  if (multi_latent_attention) {
    at_least("--q-lora-rank", static_cast<double>(q_lora_rank), 0);
    at_least("--qk-head-dim", static_cast<double>(qk_head_dim), 0);
    positive("--kv-lora-rank", kv_lora_rank);
    positive("--qk-pos-emb-head-dim", qk_pos_emb_head_dim);
    positive("--v-head-dim", v_head_dim);
    for (auto [name, v] : {std::pair{"--q-lora-rank", q_lora_rank}, std::pair{"--kv-lora-rank", kv_lora_rank},
                           std::pair{"--qk-head-dim", qk_head_dim}, std::pair{"--qk-pos-emb-head-dim", qk_pos_emb_head_dim},
                           std::pair{"--v-head-dim", v_head_dim}})
      at_most(name, v, kMaxHiddenSize);
    if (qk_pos_emb_head_dim % 2 != 0)
      flag_error("--qk-pos-emb-head-dim", "must be even for RoPE, got " + std::to_string(qk_pos_emb_head_dim));
    if (!(rotary_scaling_factor > 0)) flag_error("--rotary-scaling-factor", "must be > 0, got " + number(rotary_scaling_factor));
    at_least("--mscale", mscale, 0);
    at_least("--mscale-all-dim", mscale_all_dim, 0);
  }
}

// Megatron-LM's rules, in its order: arguments.py (--recompute-activations is selective; no
// method with selective) and TransformerConfig.__post_init__ (transformer_config.py: full needs
// a method and a number of layers, selective takes no number, recompute_modules defaults to
// core_attn and must be known, mla_up_proj needs MLA). Stricter than Megatron, which ignores
// them: a method, a number of layers or modules where the granularity makes them inert.
void ModelSection::validate_recompute_flags() {
  if (recompute_activations) recompute_granularity = "selective";
  const bool full = recompute_granularity == "full", selective = recompute_granularity == "selective";
  if (!recompute_method.empty() && !full)
    flag_error("--recompute-method", selective ? "is not supported with --recompute-granularity selective"
                                               : "needs --recompute-granularity full");
  if (recompute_num_layers != -1 && !full)
    flag_error("--recompute-num-layers", selective ? "must be unset with --recompute-granularity selective"
                                                   : "needs --recompute-granularity full");
  if (!recompute_modules.empty() && !selective)
    flag_error("--recompute-modules", "needs --recompute-granularity selective (or --recompute-activations)");
  if (full && recompute_method.empty())
    flag_error("--recompute-granularity", "full needs --recompute-method uniform or block");
  if (full && (recompute_num_layers < 1 || recompute_num_layers > num_layers))
    flag_error("--recompute-num-layers", "with --recompute-granularity full must be between 1 and --num-layers " +
                                             std::to_string(num_layers) +
                                             (recompute_num_layers == -1 ? ", and is unset"
                                                                         : ", got " + std::to_string(recompute_num_layers)));
  if (!selective) return;
  if (recompute_modules.empty()) recompute_modules = {"core_attn"};
  for (const std::string& m : recompute_modules) {
    static const std::vector<std::string> here = {"core_attn", "layernorm", "mlp", "moe",
                                                  "moe_act", "mla_up_proj", "shared_experts"};
    static const std::vector<std::string> megatron_only = {"gdn_norm_out", "gdp_in_proj", "gdp_qkv", "mhc"};
    if (std::find(megatron_only.begin(), megatron_only.end(), m) != megatron_only.end())
      flag_error("--recompute-modules", "'" + m + "' is Megatron's module of a layer this model does not have "
                                        "(the choices here: core_attn, layernorm, mlp, moe, moe_act, mla_up_proj, "
                                        "shared_experts)");
    if (std::find(here.begin(), here.end(), m) == here.end())
      flag_error("--recompute-modules", "'" + m + "' is not one of: core_attn, layernorm, mlp, moe, moe_act, "
                                        "mla_up_proj, shared_experts");
  }
  auto has = [&](const char* m) {
    return std::find(recompute_modules.begin(), recompute_modules.end(), m) != recompute_modules.end();
  };
  if (has("mla_up_proj") && !multi_latent_attention)
    flag_error("--recompute-modules", "mla_up_proj is only supported with --multi-latent-attention");
}

void ModelSection::validate_recompute(const MoeSection& moe) const {
  const bool moe_act = std::find(recompute_modules.begin(), recompute_modules.end(), "moe_act") != recompute_modules.end();
  if (recompute_granularity == "selective" && moe_act && !moe.moe_grouped_gemm)
    flag_error("--recompute-modules", "moe_act is only supported with --moe-grouped-gemm");
}

std::vector<ToolFlag> MoeSection::flags() {
  return {
      int_flag("--num-experts", num_experts, "experts per MoE layer (0: a dense model)"),
      int_flag("--moe-router-topk", moe_router_topk, "experts each token is routed to"),
      int_flag("--moe-ffn-hidden-size", moe_ffn_hidden_size, "each expert's MLP width (0: --ffn-hidden-size)"),
      int_flag("--moe-shared-expert-intermediate-size", moe_shared_expert_intermediate_size,
               "width of the shared expert every token also goes through (0: none)"),
      bool_flag("--moe-shared-expert-gate", moe_shared_expert_gate,
                "scale the shared expert's output by sigmoid(x w) (Qwen2-MoE)"),
      string_flag("--moe-router-score-function", moe_router_score_function,
                  "router scores: softmax over the experts, or sigmoid (DeepSeek-V3)", {"softmax", "sigmoid"}),
      bool_flag("--moe-router-pre-softmax", moe_router_pre_softmax,
                "softmax over every expert, then the top-k, not renormalised (default: renormalised top-k)"),
      double_flag("--moe-router-topk-scaling-factor", moe_router_topk_scaling_factor,
                  "multiply the top-k weights by this (0: no scaling)"),
      string_flag("--moe-router-load-balancing-type", moe_router_load_balancing_type,
                  "balancing loss: over the micro-batch (aux_loss), per sequence (seq_aux_loss) or none",
                  {"aux_loss", "seq_aux_loss", "none"}),
      double_flag("--moe-aux-loss-coeff", moe_aux_loss_coeff, "weight of the load-balancing loss (0: off)"),
      double_flag("--moe-z-loss-coeff", moe_z_loss_coeff, "weight of the router z-loss (0: off)"),
      double_flag("--moe-expert-capacity-factor", moe_expert_capacity_factor,
                  "each expert takes at most tokens x top-k / experts x this, dropping the least probable "
                  "(0: dropless)"),
      string_flag("--moe-token-dispatcher-type", moe_token_dispatcher_type,
                  "how tokens reach their experts' ranks: all-to-all", {"alltoall"}),
      bool_flag("--moe-grouped-gemm", moe_grouped_gemm,
                "the experts as one grouped GEMM (at::_grouped_mm) instead of one GEMM per expert"),
      int_flag("--moe-router-num-groups", moe_router_num_groups,
               "group-limited routing: the experts in this many groups (0: off; DeepSeek-V3's n_group)"),
      int_flag("--moe-router-group-topk", moe_router_group_topk,
               "group-limited routing: choose the top-k within this many best groups (DeepSeek-V3's topk_group)"),
      string_flag("--moe-layer-freq", moe_layer_freq,
                  "which layers are MoE layers: every N-th from layer 0, or a list such as [1,0,1,0] or ([0]*3+[1]*58)"),
      bool_flag("--moe-router-enable-expert-bias", moe_router_enable_expert_bias,
                "aux-loss-free balancing: a per-expert bias on the routing scores, moved after each step "
                "toward equal token counts (sigmoid scores)"),
      double_flag("--moe-router-bias-update-rate", moe_router_bias_update_rate,
                  "how far the expert bias moves per step (with --moe-router-enable-expert-bias)"),
      bool_flag("--moe-per-layer-logging", moe_per_layer_logging,
                "log each MoE layer's balancing loss and tokens per expert (metrics file, TensorBoard)"),
  };
}

namespace {

// Megatron reads --moe-layer-freq as a Python expression of 0/1 lists (DeepSeek-V3's recipes
// write "([0]*3+[1]*58)"): list literals, a list times a count (either side), sums of them and
// parentheses. A recursive-descent reading of exactly that, rather than an evaluator.
class LayerListExpression {
 public:
  explicit LayerListExpression(const std::string& text) : text_(text) {}
  std::vector<int64_t> read() {
    std::vector<int64_t> out = sum();
    if (skip() != text_.size()) fail("unexpected '" + text_.substr(pos_) + "'");
    return out;
  }

 private:
  static constexpr int64_t kMaxLayers = 1 << 20;
  std::vector<int64_t> sum() {
    std::vector<int64_t> out = product();
    while (eat('+')) {
      const std::vector<int64_t> more = product();
      if (static_cast<int64_t>(out.size() + more.size()) > kMaxLayers) fail("lists more than 2^20 layers");
      out.insert(out.end(), more.begin(), more.end());
    }
    return out;
  }
  std::vector<int64_t> product() {
    if (skip() < text_.size() && std::isdigit(static_cast<unsigned char>(text_[pos_]))) {
      const int64_t n = count();
      if (!eat('*')) fail("expected '*' after " + std::to_string(n));
      return repeat(atom(), n);
    }
    std::vector<int64_t> out = atom();
    while (eat('*')) out = repeat(out, count());
    return out;
  }
  std::vector<int64_t> atom() {
    if (eat('(')) {
      std::vector<int64_t> out = sum();
      if (!eat(')')) fail("expected ')'");
      return out;
    }
    if (!eat('[')) fail("expected a list such as [1,0,1,0], got '" + text_.substr(pos_) + "'");
    std::vector<int64_t> out;
    if (eat(']')) return out;
    do {
      const size_t start = skip(), end = text_.find_first_of(",]", start);
      const std::string item = text_.substr(start, end == std::string::npos ? std::string::npos : end - start);
      const size_t last = item.find_last_not_of(' ');
      const std::string value = last == std::string::npos ? "" : item.substr(0, last + 1);
      if (value != "0" && value != "1")
        flag_error("--moe-layer-freq", "a list holds 0 (dense) or 1 (MoE) per layer, found '" + value + "'");
      out.push_back(value == "1");
      pos_ = start + item.size();
    } while (eat(','));
    if (!eat(']')) fail("expected ']'");
    return out;
  }
  std::vector<int64_t> repeat(const std::vector<int64_t>& list, int64_t n) {
    if (n > 0 && static_cast<int64_t>(list.size()) > kMaxLayers / n) fail("lists more than 2^20 layers");
    std::vector<int64_t> out;
    for (int64_t i = 0; i < n; ++i) out.insert(out.end(), list.begin(), list.end());
    return out;
  }
  int64_t count() {
    const size_t start = skip();
    size_t end = start;
    while (end < text_.size() && std::isdigit(static_cast<unsigned char>(text_[end])) && end - start < 8) ++end;
    if (end == start) fail("expected a count at '" + text_.substr(start) + "'");
    pos_ = end;
    return std::stoll(text_.substr(start, end - start));
  }
  bool eat(char c) {
    if (skip() < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  size_t skip() {
    while (pos_ < text_.size() && text_[pos_] == ' ') ++pos_;
    return pos_;
  }
  [[noreturn]] void fail(const std::string& why) const {
    flag_error("--moe-layer-freq", "cannot read '" + text_ + "': " + why);
  }
  const std::string& text_;
  size_t pos_ = 0;
};

}  // namespace

bool MoeSection::moe_layer_freq_is_list() const {
  return !moe_layer_freq.empty() && (moe_layer_freq.front() == '[' || moe_layer_freq.front() == '(');
}

std::vector<int64_t> MoeSection::moe_layer_pattern() const {
  const std::string& f = moe_layer_freq;
  if (moe_layer_freq_is_list()) return LayerListExpression(f).read();
  size_t used = 0;
  long long n = 0;
  try {
    n = std::stoll(f, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != f.size() || f.empty() || n <= 0)
    flag_error("--moe-layer-freq", "expected a positive integer or a list such as [1,0,1,0], got '" + f + "'");
  return {n};
}

void MoeSection::validate(const ModelSection& model) const {
  if (num_experts < 0) flag_error("--num-experts", "must be >= 0, got " + std::to_string(num_experts));
  if (moe_router_num_groups < 0 || moe_router_group_topk < 0)
    flag_error(moe_router_num_groups < 0 ? "--moe-router-num-groups" : "--moe-router-group-topk", "must be >= 0");
  if (moe_router_num_groups > 0 && num_experts > 0) {
    if (num_experts % moe_router_num_groups != 0)
      flag_error("--moe-router-num-groups", std::to_string(moe_router_num_groups) + " does not divide --num-experts " +
                                                std::to_string(num_experts));
    if (moe_router_group_topk <= 0 || moe_router_group_topk > moe_router_num_groups)
      flag_error("--moe-router-group-topk", "must be 1 .. --moe-router-num-groups " +
                                                std::to_string(moe_router_num_groups) + ", got " +
                                                std::to_string(moe_router_group_topk));
  }
  at_most("--num-experts", num_experts, kMaxExperts);
  // Megatron's capacity, ceil(tokens x top-k / experts x factor), keeps every token once the
  // factor reaches experts / top-k; a larger one drops nothing more, and one far larger
  // overflows the int64 count LibTorch's topk takes. Checked without --num-experts too: the MoE
  // model of an mfsdp-sft or mfsdp-grpo --load takes it (it has at most kMaxExperts experts).
  at_least("--moe-expert-capacity-factor", moe_expert_capacity_factor, 0);
  const int64_t most_factor = num_experts > 0 ? num_experts : kMaxExperts;
  if (moe_expert_capacity_factor > static_cast<double>(most_factor))
    flag_error("--moe-expert-capacity-factor",
               "must be at most " + std::string(num_experts > 0 ? "--num-experts " : "") + std::to_string(most_factor) +
                   " (a factor of experts / --moe-router-topk already keeps every token; 0: dropless), got " +
                   number(moe_expert_capacity_factor));
  const std::vector<int64_t> pattern = moe_layer_pattern();  // its syntax: the trainer reads it in any case
  // Without --num-experts the model may still have experts (mfsdp-sft and mfsdp-grpo take the
  // model of --load or --hf-load): check_parallel_model (train/parallel_dims.h) checks
  // --expert-model-parallel-size against the model's.
  if (num_experts == 0) return;
  if (!model.swiglu) flag_error("--num-experts", "needs --swiglu: the experts are SwiGLU MLPs (gate, up and down)");
  if (moe_router_topk < 1 || moe_router_topk > num_experts)
    flag_error("--moe-router-topk", "must be 1 .. --num-experts " + std::to_string(num_experts) + ", got " +
                                        std::to_string(moe_router_topk));
  at_least("--moe-ffn-hidden-size", static_cast<double>(moe_ffn_hidden_size), 0);
  at_most("--moe-ffn-hidden-size", moe_ffn_hidden_size, kMaxFfnHiddenSize);
  at_least("--moe-shared-expert-intermediate-size", static_cast<double>(moe_shared_expert_intermediate_size), 0);
  at_most("--moe-shared-expert-intermediate-size", moe_shared_expert_intermediate_size, kMaxFfnHiddenSize);
  for (auto [flag, v] : {std::pair{"--moe-router-topk-scaling-factor", moe_router_topk_scaling_factor},
                         {"--moe-aux-loss-coeff", moe_aux_loss_coeff}, {"--moe-z-loss-coeff", moe_z_loss_coeff},
                         {"--moe-router-bias-update-rate", moe_router_bias_update_rate}}) {
    at_least(flag, v, 0);
    fits_fp32(flag, v);
  }
  if (moe_shared_expert_gate && moe_shared_expert_intermediate_size == 0)
    flag_error("--moe-shared-expert-gate", "needs --moe-shared-expert-intermediate-size");
  if (moe_router_pre_softmax && moe_router_score_function != "softmax")
    flag_error("--moe-router-pre-softmax", "is for --moe-router-score-function softmax");
  if (moe_router_enable_expert_bias && moe_router_score_function != "sigmoid")
    flag_error("--moe-router-enable-expert-bias", "needs --moe-router-score-function sigmoid (as in Megatron-LM)");
  if (moe_layer_freq_is_list()) {  // a list: one 0/1 per layer, at least one 1
    if (static_cast<int64_t>(pattern.size()) != model.num_layers)
      flag_error("--moe-layer-freq", "lists " + std::to_string(pattern.size()) + " layers, --num-layers is " +
                                         std::to_string(model.num_layers));
    if (std::find(pattern.begin(), pattern.end(), 1) == pattern.end())
      flag_error("--moe-layer-freq", moe_layer_freq + " makes no layer an MoE layer (--num-experts " +
                                         std::to_string(num_experts) + " needs at least one)");
  }
}

std::vector<ToolFlag> TokenizerSection::flags() {
  return {
      string_flag("--tokenizer-type", tokenizer_type, "tokenizer",
                  {"ByteLevelTokenizer", "SentencePieceTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer",
                   "NullTokenizer"}),
      string_flag("--tokenizer-model", tokenizer_model,
                  "SentencePiece model file; for HuggingFaceTokenizer a tokenizer.json or its folder"),
      string_flag("--vocab-file", vocab_file, "GPT-2 vocab.json"),
      string_flag("--merge-file", merge_file, "GPT-2 merges.txt"),
  };
}

std::vector<ToolFlag> DataSection::flags() {
  return {
      int_flag("--seq-length", seq_length, "tokens per sample"),
      int_flag("--vocab-size", vocab_size, "vocabulary with --mock-data and no tokenizer"),
      string_flag("--data-path", data_path, "prefix of a Megatron .bin/.idx pair"),
      string_flag("--split", split, "train,valid,test weights"),
      bool_flag("--mock-data", mock_data, "synthetic tokens instead of --data-path"),
  };
}

void DataSection::validate() const {
  // Megatron reads the weights as re.findall(r"[.0-9]+", split): "-1,2" would train on 1,2 and
  // "1e3" on 1,3. Only numbers and their separators are taken here.
  if (const size_t at = split.find_first_not_of("0123456789., /"); at != std::string::npos)
    flag_error("--split", "'" + split + "': '" + split[at] +
                              "' is not part of a weight; expected up to three non-negative weights separated by "
                              "commas, e.g. 969,30,1");
  parse_split(split);  // one to three numbers, not all 0 (gpt_dataset.h; names --split)
  at_least("--vocab-size", static_cast<double>(vocab_size), 0);
  at_most("--vocab-size", vocab_size, kMaxVocabSize);
  at_most("--seq-length", seq_length, kMaxSequenceLength);
  positive("--seq-length", seq_length);
}

std::vector<ToolFlag> TrainingSection::flags() {
  return {
      int_flag("--micro-batch-size", micro_batch_size, "samples per rank and micro-batch"),
      int_flag("--global-batch-size", global_batch_size, "samples per iteration (0: micro-batch x data-parallel size)"),
      int_flag("--train-iters", train_iters, "iterations"),
      int_flag("--seed", seed, "random seed (model init and data order)"),
      bool_flag("--bf16", bf16, "bf16 compute with fp32 main weights and grads"),
      bool_flag("--check-for-nan-in-loss-and-grad", check_for_nan_in_loss_and_grad,
                "stop when a rank's loss or a reduced gradient is NaN or Inf, naming the iteration and the "
                "parameters, before the optimizer step (on unless --no-check-for-nan-in-loss-and-grad)"),
      bool_flag("--no-check-for-nan-in-loss-and-grad", check_for_nan_in_loss_and_grad,
                "train on through NaN and Inf losses and gradients", /*value=*/false),
  };
}

void TrainingSection::validate() const {
  at_least("--global-batch-size", static_cast<double>(global_batch_size), 0);
  positive("--micro-batch-size", micro_batch_size);
  if (train_iters < 0) flag_error("--train-iters", "must be >= 0");
  // Megatron seeds numpy's RandomState with it, which takes 0 .. 2^32 - 1; so does the data order here.
  if (seed < 0 || seed > 4294967295LL) flag_error("--seed", "must be in [0, 4294967295], got " + std::to_string(seed));
}

std::vector<ToolFlag> OptimizerSection::flags() {
  return {
      double_flag("--lr", lr, "peak learning rate"),
      double_flag("--min-lr", min_lr, "learning rate at the end of decay"),
      string_flag("--lr-decay-style", lr_decay_style, "decay after warmup", {"constant", "linear", "cosine"}),
      int_flag("--lr-warmup-iters", lr_warmup_iters, "linear warmup iterations"),
      int_flag("--lr-decay-iters", lr_decay_iters, "iteration where decay ends (0: --train-iters)"),
      double_flag("--weight-decay", weight_decay, "decoupled weight decay (not on 1-D params)"),
      double_flag("--adam-beta1", adam_beta1, "Adam beta1"),
      double_flag("--adam-beta2", adam_beta2, "Adam beta2"),
      double_flag("--adam-eps", adam_eps, "Adam epsilon"),
      double_flag("--sgd-momentum", sgd_momentum, "SGD momentum"),
      double_flag("--clip-grad", clip_grad, "global gradient-norm clip (0: off)"),
      string_flag("--optimizer", optimizer,
                  "optimizer (adam is AdamW; muon: Newton-Schulz orthogonalised momentum for the 2-D weight "
                  "matrices, AdamW for the rest)",
                  {"adam", "sgd", "muon"}),
      bool_flag("--use-precision-aware-optimizer", use_precision_aware_optimizer,
                "lets --exp-avg-dtype and --exp-avg-sq-dtype store AdamW's moments in bf16 (Megatron's "
                "precision-aware optimizer; computed in fp32)"),
      string_flag("--main-grads-dtype", main_grads_dtype,
                  "main gradients' dtype with --use-precision-aware-optimizer (bf16 is refused here: they stay fp32)",
                  {"fp32", "bf16"}),
      string_flag("--main-params-dtype", main_params_dtype,
                  "main weights' dtype with --use-precision-aware-optimizer (fp16 is refused here: they stay fp32)",
                  {"fp32", "fp16"}),
      string_flag("--exp-avg-dtype", exp_avg_dtype,
                  "AdamW's first moment stored in this dtype with --use-precision-aware-optimizer (fp16 and fp8 "
                  "are refused: Transformer Engine stores them scaled)",
                  {"fp32", "fp16", "bf16", "fp8"}),
      string_flag("--exp-avg-sq-dtype", exp_avg_sq_dtype,
                  "AdamW's second moment stored in this dtype with --use-precision-aware-optimizer (as "
                  "--exp-avg-dtype)",
                  {"fp32", "fp16", "bf16", "fp8"}),
      double_flag("--muon-momentum", muon_momentum, "Muon's momentum"),
      bool_flag("--muon-no-split-qkv", muon_split_qkv,
                "Muon on the fused q/k/v matrix (refused: q, k and v are separate matrices here, orthogonalised "
                "one by one as Megatron's default)", false),
      bool_flag("--muon-nesterov", muon_nesterov, "Nesterov momentum in Muon"),
      string_flag("--muon-scale-mode", muon_scale_mode,
                  "Muon's update scale for a [rows, cols] matrix: spectral sqrt(max(rows, cols)), unit_rms_norm "
                  "sqrt(rows / cols), shape_scaling sqrt(max(1, rows / cols))",
                  {"spectral", "unit_rms_norm", "shape_scaling"}),
      string_flag("--muon-fp32-matmul-prec", muon_fp32_matmul_prec,
                  "the Newton-Schulz iteration's precision: medium in bf16, high in fp32 (low is refused)",
                  {"low", "medium", "high"}),
      string_flag("--muon-coefficient-type", muon_coefficient_type, "Newton-Schulz coefficients",
                  {"simple", "quintic", "polar_express", "aol"}),
      int_flag("--muon-num-ns-steps", muon_num_ns_steps, "Newton-Schulz iterations"),
      string_flag("--muon-tp-mode", muon_tp_mode,
                  "tensor-parallel matrices: duplicated or distributed orthogonalise the whole matrix (the same "
                  "update as one rank), blockwise each rank's slice",
                  {"blockwise", "duplicated", "distributed"}),
      bool_flag("--muon-use-syrk", muon_use_syrk, "Megatron's Triton SYRK kernel (refused: no Triton here)"),
      double_flag("--muon-extra-scale-factor", muon_extra_scale_factor, "multiplies Muon's update scale"),
      string_flag("--muon-scalar-optimizer", muon_scalar_optimizer,
                  "the optimizer of the other parameters (embeddings, output layer, norms, biases): adam (lion is "
                  "refused)",
                  {"adam", "lion"}),
      string_flag("--optimizer-implementation", optimizer_implementation,
                  "AdamW's kernels: unfused (op for op as torch::optim::AdamW, the bit-exact reference), fused "
                  "(at::_fused_adamw_, torch.optim.AdamW(fused=True)'s single pass) or auto (fused on CUDA, as "
                  "Megatron's fused Adam; unfused on the CPU)", {"auto", "unfused", "fused"}),
  };
}

void OptimizerSection::validate() const {
  at_least("--lr-decay-iters", static_cast<double>(lr_decay_iters), 0);
  for (auto [flag, v] : {std::pair{"--lr", lr}, {"--min-lr", min_lr}, {"--weight-decay", weight_decay},
                         {"--adam-eps", adam_eps}, {"--sgd-momentum", sgd_momentum}, {"--clip-grad", clip_grad}}) {
    at_least(flag, v, 0);
    fits_fp32(flag, v);
  }
  for (auto [flag, beta] : {std::pair{"--adam-beta1", adam_beta1}, {"--adam-beta2", adam_beta2}})
    if (!(beta >= 0 && beta < 1)) flag_error(flag, "must be in [0, 1), got " + number(beta));
  if (optimizer_implementation == "fused" && optimizer != "adam")
    flag_error("--optimizer-implementation", "fused is AdamW's kernel; --optimizer " + optimizer + " has none");
  if (min_lr > lr) flag_error("--min-lr", "is larger than --lr");
  // Megatron's OptimizerConfig rules, then what this build stores.
  const std::pair<const char*, const std::string*> dtypes[] = {{"--main-grads-dtype", &main_grads_dtype},
                                                               {"--main-params-dtype", &main_params_dtype},
                                                               {"--exp-avg-dtype", &exp_avg_dtype},
                                                               {"--exp-avg-sq-dtype", &exp_avg_sq_dtype}};
  for (const auto& [flag, value] : dtypes)
    if (*value != "fp32" && !use_precision_aware_optimizer)
      flag_error(flag, "can only be fp32 without --use-precision-aware-optimizer, got " + *value);
  if (use_precision_aware_optimizer && optimizer != "adam")
    flag_error("--use-precision-aware-optimizer", "is only supported with --optimizer adam, not " + optimizer);
  if (main_grads_dtype != "fp32")
    flag_error("--main-grads-dtype", main_grads_dtype + " is not supported: the main gradients stay fp32 here "
                                     "(--grad-reduce-in-bf16 reduces them in bf16)");
  if (main_params_dtype != "fp32")
    flag_error("--main-params-dtype", main_params_dtype + " is not supported: the main weights stay fp32 here");
  for (const auto& [flag, value] : {dtypes[2], dtypes[3]})
    if (*value == "fp16" || *value == "fp8")
      flag_error(flag, *value + " is not supported: Transformer Engine stores fp16 and fp8 moments scaled, which "
                                "this build does not; bf16 halves them");
  if (optimizer == "muon") {
    if (!(muon_momentum >= 0 && muon_momentum < 1)) flag_error("--muon-momentum", "must be in [0, 1), got " + number(muon_momentum));
    positive("--muon-num-ns-steps", muon_num_ns_steps);
    at_least("--muon-extra-scale-factor", muon_extra_scale_factor, 0);
    if (!muon_split_qkv)
      flag_error("--muon-no-split-qkv", "is not supported: the attention's q, k and v are separate matrices here, "
                                        "each orthogonalised on its own (Megatron's default, --muon-split-qkv)");
    if (muon_use_syrk) flag_error("--muon-use-syrk", "is not supported: it is Megatron's Triton kernel");
    if (muon_scalar_optimizer != "adam")
      flag_error("--muon-scalar-optimizer", muon_scalar_optimizer + " is not supported: the other parameters train "
                                             "with adam (AdamW)");
    if (muon_fp32_matmul_prec == "low")
      flag_error("--muon-fp32-matmul-prec", "low is not supported: medium (bf16) or high (fp32)");
  }
  if (lr_warmup_iters < 0) flag_error("--lr-warmup-iters", "must be >= 0");
}

std::vector<ToolFlag> CheckpointSection::flags() {
  return {
      string_flag("--export-hf", export_hf,
                  "(mfsdp) at the end, write the model as a Hugging Face folder (config.json, model.safetensors, "
                  "the tokenizer files of a HuggingFaceTokenizer) here"),
      string_flag("--save", save, "checkpoint folder to save into (in --ckpt-format)"),
      int_flag("--save-interval", save_interval, "iterations between checkpoints (0: only at the end)"),
      string_flag("--load", load,
                  "checkpoint to start from: a save folder (its latest iteration) or an iteration folder "
                  "(iter_NNNNNNN, or any torch.distributed.checkpoint folder)"),
      int_flag("--ckpt-step", ckpt_step,
               "with --load of a save folder: load this iteration, not the latest "
               "(-1: the latest)"),
      bool_flag("--finetune", finetune, "with --load: weights only, iteration and optimizer start afresh"),
      bool_flag("--no-load-optim", no_load_optim, "with --load: do not load the optimizer state"),
      bool_flag("--no-load-rng", no_load_rng, "with --load: do not restore the random generators"),
      bool_flag("--no-save-optim", no_save_optim, "save checkpoints without the optimizer state"),
      int_flag("--exit-interval", exit_interval, "stop (after saving with --save) at a multiple of this iteration"),
      bool_flag("--exit-signal-handler", exit_signal_handler,
                "on SIGTERM or SIGINT (to a rank, or to mfsdp-run, which passes it on) every rank finishes the "
                "iteration, saves with --save and exits 0"),
      double_flag("--exit-duration-in-mins", exit_duration_in_mins,
                  "stop (after saving with --save) once the job has run this many minutes (the longest rank's "
                  "time; 0: no limit)"),
      bool_flag("--override-opt_param-scheduler", override_opt_param_scheduler,
                "with --load: use this run's LR schedule flags, not the checkpoint's"),
      bool_flag("--use-checkpoint-opt_param-scheduler", use_checkpoint_opt_param_scheduler,
                "with --load: use the checkpoint's LR schedule, not this run's flags"),
      string_flag("--ckpt-format", ckpt_format,
                  "checkpoint format to save: fsdp_dtensor (PyTorch DCP with Megatron-FSDP's keys) or mfsdp (the "
                  "earlier metadata.json + safetensors); --load reads either", {"fsdp_dtensor", "mfsdp"}),
      bool_flag("--async-save", async_save,
                "with --save: copy the shards to CPU staging buffers and write them on a background thread "
                "while training goes on; each save commits at the next save or at the end "
                "(--ckpt-format fsdp_dtensor)"),
      int_flag("--non-persistent-save-interval", non_persistent_save_interval,
               "iterations between non-persistent checkpoints (at iterations --save-interval does not save; only "
               "the newest is kept; --load takes it when it is newer than --load's own): needs "
               "--non-persistent-ckpt-type"),
      string_flag("--non-persistent-ckpt-type", non_persistent_ckpt_type,
                  "global: the checkpoint format, into --non-persistent-global-ckpt-dir; local: each rank writes "
                  "its own state to --non-persistent-local-ckpt-dir on its node in the background, and keeps a "
                  "replica of another rank's (one host may lose its files); loads only into the same layout",
                  {"global", "local"}),
      string_flag("--non-persistent-global-ckpt-dir", non_persistent_global_ckpt_dir,
                  "folder of the global non-persistent checkpoints (default: <--save>/non_persistent; "
                  "read from <--load>/non_persistent)"),
      string_flag("--non-persistent-local-ckpt-dir", non_persistent_local_ckpt_dir,
                  "node-local folder of the local non-persistent checkpoints (default /dev/shm/mfsdp_local_ckpt; "
                  "each job its own subfolder, named after --save)"),
      string_flag("--dump-param-to-param-group-map", dump_param_to_param_group_map,
                  "write Megatron's {parameter: optimizer group} map into this folder (a DCP folder; "
                  "mfsdp-ckpt print-torch-dcp-in-json turns it into the JSON the torch_dist conversion takes)"),
  };
}

void CheckpointSection::validate() const {
  check_output_path("--save", save, /*folder=*/true);
  check_output_path("--export-hf", export_hf, /*folder=*/true);
  check_output_path("--dump-param-to-param-group-map", dump_param_to_param_group_map, /*folder=*/true);
  if (save_interval < 0) flag_error("--save-interval", "must be >= 0");
  if (save_interval > 0 && save.empty()) flag_error("--save-interval", "needs --save");
  if (exit_interval < 0) flag_error("--exit-interval", "must be >= 0");
  if (!(exit_duration_in_mins >= 0) || exit_duration_in_mins > 1e9)
    flag_error("--exit-duration-in-mins", "must be in [0, 1e9] minutes, got " + std::to_string(exit_duration_in_mins));
  for (auto [set, flag] : {std::pair{finetune, "--finetune"}, {no_load_optim, "--no-load-optim"},
                           {no_load_rng, "--no-load-rng"}, {ckpt_step >= 0, "--ckpt-step"}})
    if (set && load.empty()) flag_error(flag, "needs --load");
  if (ckpt_step < -1)
    flag_error("--ckpt-step", "must be an iteration >= 0 (or -1: the latest), got " + std::to_string(ckpt_step));
  if (no_save_optim && save.empty()) flag_error("--no-save-optim", "needs --save");
  if (async_save && save.empty()) flag_error("--async-save", "needs --save");
  // The earlier format's writer (safetensors) has no staging path; it is kept one release only.
  if (async_save && ckpt_format != "fsdp_dtensor")
    flag_error("--async-save", "needs --ckpt-format fsdp_dtensor (got --ckpt-format " + ckpt_format + ")");
  if (override_opt_param_scheduler && use_checkpoint_opt_param_scheduler)
    flag_error("--override-opt_param-scheduler", "conflicts with --use-checkpoint-opt_param-scheduler");
  if (non_persistent_save_interval < 0) flag_error("--non-persistent-save-interval", "must be >= 0");
  if (non_persistent_save_interval > 0 && save.empty()) flag_error("--non-persistent-save-interval", "needs --save");
  if (non_persistent_save_interval > 0 && non_persistent_ckpt_type.empty())
    flag_error("--non-persistent-save-interval", "needs --non-persistent-ckpt-type (global or local)");
  check_output_path("--non-persistent-global-ckpt-dir", non_persistent_global_ckpt_dir, /*folder=*/true);
  if (non_persistent_ckpt_type == "local") {
    check_output_path("--non-persistent-local-ckpt-dir", non_persistent_local_ckpt_dir, /*folder=*/true);
    if (non_persistent_local_ckpt_dir.empty())
      flag_error("--non-persistent-local-ckpt-dir", "must name a folder with --non-persistent-ckpt-type local");
  }
}

std::vector<ToolFlag> ParallelSection::flags() {
  return {
      int_flag("--tensor-model-parallel-size", tensor_model_parallel_size,
               "tensor parallelism: split each layer's heads and MLP and the vocabulary over this many "
               "adjacent ranks (FSDP shards each rank's slices over the rest)"),
      bool_flag("--sequence-parallel", sequence_parallel,
                "with tensor parallelism: norms and residuals on sequence slices between the "
                "tensor-parallel regions"),
      int_flag("--context-parallel-size", context_parallel_size,
               "context parallelism: split every sequence over this many ranks (load-balanced chunks; "
               "FSDP shards over data x context-parallel ranks)"),
      string_flag("--cp-comm-type", cp_comm_type,
                  "how context-parallel attention exchanges keys and values: all_gather (the default "
                  "here, measured faster) or p2p (a ring, less memory)", {"all_gather", "p2p"}),
      int_flag("--expert-model-parallel-size", expert_model_parallel_size,
               "ranks the experts of a layer are split over (1: every rank holds every expert)"),
      int_flag("--expert-tensor-parallel-size", expert_tensor_parallel_size,
               "ranks each expert's weights are split over (0: Megatron's default, the tensor-parallel size); "
               "the expert ranks are laid out expert-tensor, expert, expert-data parallel as Megatron's"),
      int_flag("--pipeline-model-parallel-size", pipeline_model_parallel_size,
               "pipeline stages (the outermost dimension in Megatron's order), run by Megatron's 1F1B "
               "schedule; FSDP shards each stage over its own data-parallel ranks"),
      int_flag("--decoder-first-pipeline-num-layers", decoder_first_pipeline_num_layers,
               "decoder layers of the first pipeline stage (-1: the even split)"),
      int_flag("--decoder-last-pipeline-num-layers", decoder_last_pipeline_num_layers,
               "decoder layers of the last pipeline stage (-1: the even split)"),
      bool_flag("--account-for-embedding-in-pipeline-split", account_for_embedding_in_pipeline_split,
                "count the embedding as one layer when splitting the layers over pipeline stages"),
      bool_flag("--account-for-loss-in-pipeline-split", account_for_loss_in_pipeline_split,
                "count the output layer and loss as one layer when splitting the layers over pipeline stages"),
      int_flag("--num-virtual-stages-per-pipeline-rank", num_virtual_stages_per_pipeline_rank,
               "interleaved 1F1B: model chunks per pipeline stage (0: one, Megatron's non-interleaved 1F1B)"),
      int_flag("--virtual-pipeline-model-parallel-size", num_virtual_stages_per_pipeline_rank,
               "older Megatron-LM's name of --num-virtual-stages-per-pipeline-rank"),
      int_flag("--num-layers-per-virtual-pipeline-stage", num_layers_per_virtual_pipeline_stage,
               "interleaved 1F1B: decoder layers per model chunk (0: unset); chunks per stage = layers per stage / "
               "this"),
      bool_flag("--variable-seq-lengths", variable_seq_lengths,
                "pipeline parallelism: send each activation's shape before it, for micro-batches whose "
                "sequence lengths vary (mfsdp-sft and mfsdp-grpo always do)"),
      int_flag("--num-distributed-optimizer-instances", num_distributed_optimizer_instances,
               "HSDP: split the data-parallel ranks into this many instances of consecutive ranks; "
               "each shards the model as --data-parallel-sharding-strategy says, the instances "
               "replicate it and all-reduce gradients across"),
      string_flag("--outer-dp-sharding-strategy", outer_dp_sharding_strategy,
                  "what is sharded across the instances of --num-distributed-optimizer-instances: "
                  "no_shard, nothing (HSDP); optim, main weights, gradients and optimizer state "
                  "(HFSDP; needs optim_grads_params)", {"no_shard", "optim"}),
  };
}

void ParallelSection::validate() const {
  for (const auto& [flag, v] : {std::pair<const char*, int64_t>{"--tensor-model-parallel-size", tensor_model_parallel_size},
                                {"--context-parallel-size", context_parallel_size},
                                {"--expert-model-parallel-size", expert_model_parallel_size},
                                {"--pipeline-model-parallel-size", pipeline_model_parallel_size},
                                {"--num-distributed-optimizer-instances", num_distributed_optimizer_instances}})
    if (v < 1) flag_error(flag, "must be >= 1, got " + std::to_string(v));
  for (const auto& [flag, v] : {std::pair<const char*, int64_t>{"--num-virtual-stages-per-pipeline-rank",
                                                                 num_virtual_stages_per_pipeline_rank},
                                {"--num-layers-per-virtual-pipeline-stage", num_layers_per_virtual_pipeline_stage}})
    if (v < 0) flag_error(flag, "must be >= 0, got " + std::to_string(v));
  if (num_virtual_stages_per_pipeline_rank > 0 && num_layers_per_virtual_pipeline_stage > 0)
    flag_error("--num-layers-per-virtual-pipeline-stage",
               "and --num-virtual-stages-per-pipeline-rank are mutually exclusive (Megatron-LM's rule): give one");
  for (const auto& [flag, v] : {std::pair<const char*, int64_t>{"--decoder-first-pipeline-num-layers",
                                                                 decoder_first_pipeline_num_layers},
                                {"--decoder-last-pipeline-num-layers", decoder_last_pipeline_num_layers}})
    if (v < -1) flag_error(flag, "must be >= 0 (or -1: the even split), got " + std::to_string(v));
  if (expert_tensor_parallel_size < 0)
    flag_error("--expert-tensor-parallel-size",
               "must be >= 1 (or 0: the tensor-parallel size), got " + std::to_string(expert_tensor_parallel_size));
}

std::vector<ToolFlag> FsdpSection::flags() {
  return {
      bool_flag("--use-megatron-fsdp", use_megatron_fsdp, "shard with mfsdp (always on here)"),
      string_flag("--data-parallel-sharding-strategy", data_parallel_sharding_strategy, "what is sharded",
                  {"no_shard", "optim", "optim_grads", "optim_grads_params"}),
      bool_flag("--no-gradient-accumulation-fusion", no_gradient_accumulation_fusion,
                "no fused weight-gradient accumulation"),
      bool_flag("--use-distributed-optimizer", use_distributed_optimizer, "shard the optimizer (always on here)"),
      bool_flag("--init-model-with-meta-device", init_model_with_meta_device,
                "materialise and shard one layer at a time (on by default in mfsdp: the values equal eager "
                "init's, and no rank ever holds the whole model)"),
      bool_flag("--no-init-model-with-meta-device", init_model_with_meta_device,
                "(mfsdp) build every rank's whole model first, then shard it (eager init: the same values, a whole "
                "model's memory per rank)",
                /*value=*/false),
      bool_flag("--grad-reduce-in-bf16", grad_reduce_in_bf16, "reduce gradients in bf16"),
      bool_flag("--grad-reduce-rank-order-fp32", grad_reduce_rank_order_fp32,
                "(mfsdp) with --grad-reduce-in-bf16: sum the bf16 gradients in fp32 in rank order, rounded "
                "once (reproducible bits for any world size; point to point instead of NCCL's bf16 "
                "reduction kernels)"),
      bool_flag("--no-fsdp-prefetch", no_fsdp_prefetch,
                "(mfsdp) do not all-gather the next unit while the current one computes"),
      bool_flag("--no-fsdp-all-gather-in-start-param-sync", no_fsdp_all_gather_in_start_param_sync,
                "do not start the first unit's all-gather at the end of the optimizer step"),
      bool_flag("--fsdp-double-buffer", fsdp_double_buffer,
                "unsharded weights and gradients in two persistent buffers per size class"),
      bool_flag("--fsdp-trace-pool", fsdp_trace_pool,
                "(mfsdp) unsharded buffers at offsets of one pool per dtype, planned from a traced step"),
      bool_flag("--use-nccl-ub", use_nccl_ub, "NCCL user buffers (GPU; refused on NCCL: not supported yet)"),
  };
}

void FsdpSection::validate() const {
  if (fsdp_double_buffer && fsdp_trace_pool) flag_error("--fsdp-trace-pool", "conflicts with --fsdp-double-buffer");
}

std::vector<ToolFlag> RuntimeSection::flags() {
  return {
      string_flag("--attention-backend", attention_backend,
                  "auto: at::scaled_dot_product_attention (the device's fused kernels); unfused: explicit "
                  "matmul, causal mask, fp32 softmax, matmul", {"auto", "unfused"}),
      double_flag("--distributed-timeout-minutes", distributed_timeout_minutes,
                  "timeout of every collective: a rank that stops answering is named in an error after "
                  "this long (fractions of a minute allowed)"),
      string_flag("--device", device,
                  "(mfsdp) where to train: auto (CUDA and NCCL when this rank sees a GPU: cuda:LOCAL_RANK "
                  "when it sees a GPU per local rank, cuda:0 when it sees just one, as under Slurm's "
                  "--gpus-per-task=1; an error with more than one but fewer than the local ranks; the CPU "
                  "without a GPU), cpu (the CPU communicator) or cuda (as auto, an error without a GPU)",
                  {"auto", "cpu", "cuda"}),
      string_flag("--cpu-comm-shared-memory", cpu_comm_shared_memory,
                  "(mfsdp) CPU backend: on, the collectives' bulk data through one /dev/shm segment when every "
                  "rank is on this host; off, over TCP (unset: on, unless MFSDP_SHM=0)", {"on", "off"}),
      string_flag("--socket-ifname", socket_ifname,
                  "(mfsdp) CPU backend: the network interface ranks listen on, e.g. eth0 (unset: "
                  "MFSDP_SOCKET_IFNAME, else GLOO_SOCKET_IFNAME, else loopback on one node or the host name)"),
      string_flag("--keep-freed-cpu-memory", keep_freed_cpu_memory,
                  "(mfsdp) on: freed CPU blocks under 32 MiB stay in the process for the next step; off: glibc's "
                  "defaults (unset: on, unless MFSDP_KEEP_FREED_MEMORY=0)", {"on", "off"}),
  };
}

void RuntimeSection::validate() const {
  const double timeout_ms = distributed_timeout_minutes * 60000.0;
  if (!(timeout_ms >= 1 && distributed_timeout_minutes <= 1e6))
    flag_error("--distributed-timeout-minutes",
               "must be a positive number of minutes (at most 1000000), got " + number(distributed_timeout_minutes));
}

std::vector<ToolFlag> LoggingSection::flags() {
  return {
      int_flag("--log-interval", log_interval, "iterations between log lines"),
      int_flag("--eval-interval", eval_interval, "iterations between evaluations"),
      int_flag("--eval-iters", eval_iters, "batches per evaluation"),
      bool_flag("--log-params-norm", log_params_norm,
                "log the L2 norm of all parameters after the optimizer step (' params norm: ', metrics "
                "params_norm)"),
      bool_flag("--log-num-zeros-in-grad", log_num_zeros_in_grad,
                "log how many gradient elements are zero after reduction and clipping (' num zeros: ', "
                "metrics num_zeros_in_grad)"),
      string_flag("--metrics-file", metrics_file, "JSON-lines metrics (and a .svg loss curve)"),
      string_flag("--tensorboard-dir", tensorboard_dir,
                  "write TensorBoard event files of the training scalars (lm loss, learning-rate, grad-norm, "
                  "throughput, tokens-per-sec, mem-bytes, ...) here"),
      int_flag("--tensorboard-log-interval", tensorboard_log_interval, "iterations between TensorBoard scalars"),
  };
}

void LoggingSection::validate() const {
  check_output_path("--metrics-file", metrics_file, /*folder=*/false);
  check_output_path("--tensorboard-dir", tensorboard_dir, /*folder=*/true);
  if (tensorboard_log_interval < 1)
    flag_error("--tensorboard-log-interval", "must be >= 1, got " + std::to_string(tensorboard_log_interval));
  positive("--log-interval", log_interval);
  positive("--eval-interval", eval_interval);
  if (eval_iters < 0) flag_error("--eval-iters", "must be >= 0");
}

std::vector<ToolFlag> ProfilingSection::flags() {
  return {
      bool_flag("--profile", profile,
                "profile iterations --profile-step-start + 1 .. --profile-step-end on --profile-ranks: with "
                "--use-pytorch-profiler a trace into --tensorboard-dir, else nsys's capture range "
                "(cudaProfilerStart/Stop and NVTX ranges of every op; nsys profile --capture-range=cudaProfilerApi)"),
      bool_flag("--use-pytorch-profiler", use_pytorch_profiler,
                "with --profile: PyTorch's profiler (Kineto), a <host>_<pid>.<ms>.pt.trace.json per profiled rank "
                "in --tensorboard-dir (TensorBoard, Perfetto, chrome://tracing)"),
      int_flag("--profile-step-start", profile_step_start, "with --profile: iterations done before profiling starts"),
      int_flag("--profile-step-end", profile_step_end, "with --profile: the last iteration profiled"),
      int_list_flag("--profile-ranks", profile_ranks, "with --profile: the global ranks profiled"),
  };
}

void ProfilingSection::validate() const {
  if (!profile) {
    if (use_pytorch_profiler)
      flag_error("--use-pytorch-profiler", "needs --profile (Megatron's: it picks --profile's tool)");
    return;
  }
  if (profile_step_start < 0)
    flag_error("--profile-step-start", "must be >= 0, got " + std::to_string(profile_step_start));
  if (profile_step_end <= profile_step_start)
    flag_error("--profile-step-end", "must be greater than --profile-step-start (" +
                                         std::to_string(profile_step_start) + "), got " +
                                         std::to_string(profile_step_end));
  for (int64_t r : profile_ranks)
    if (r < 0) flag_error("--profile-ranks", "ranks are >= 0, got " + std::to_string(r));
}

std::vector<ToolFlag> PretrainingSection::flags() {
  return {
      bool_flag("--skip-train", skip_train, "evaluate only"),
      string_flag("--sample-prompt", sample_prompt, "(mfsdp) print a sample continuing this text after training"),
      int_flag("--sample-tokens", sample_tokens, "(mfsdp) tokens of that sample"),
      bool_flag("--calculate-per-token-loss", calculate_per_token_loss,
                "loss = sum over tokens / tokens in the global batch (no 1/dp gradient scaling)"),
      int_flag("--simulate-world-size", simulate_world_size,
               "(mfsdp) one process plays --simulate-rank of a job this size: real per-rank memory and "
               "compute, collectives replaced by local copies, losses not meaningful (0: off)"),
      int_flag("--simulate-rank", simulate_rank, "(mfsdp) the rank played with --simulate-world-size"),
      string_flag("--rerun-mode", rerun_mode,
                  "Megatron's result validation: validate_results (a step whose loss fails a check, NaN/Inf or a "
                  "spike, runs again before the optimizer step: a different result exits 17, a suspected faulty "
                  "device; the same stops as a real divergence), report_stats (every step runs twice; the "
                  "differences are logged) or disabled", {"disabled", "validate_results", "report_stats"}),
      bool_flag("--check-for-spiky-loss", check_for_spiky_loss,
                "check each rank's step loss against 10x the largest of its first 100 (Megatron's rule); a spike "
                "is a warning, rerun under --rerun-mode validate_results"),
      int_flag("--error-injection-rate", error_injection_rate,
               "test the validation: make about one check in this many fail (0: never)"),
      string_flag("--error-injection-type", error_injection_type,
                  "what an injected failure is on its rerun: transient_error (differs), correct_result or "
                  "persistent_error (the same)", {"correct_result", "transient_error", "persistent_error"}),
      bool_flag("--memory-plan", memory_plan,
                "(mfsdp) print each rank's planned buffer bytes per unit and exit before allocating them "
                "(with --simulate-world-size N: for N ranks; needs no data or --train-iters)"),
  };
}

void PretrainingSection::validate() const {
  at_least("--sample-tokens", static_cast<double>(sample_tokens), 0);
  at_most("--sample-tokens", sample_tokens, kMaxSequenceLength);
  if (simulate_world_size < 0) flag_error("--simulate-world-size", "must be >= 0");
  at_most("--simulate-world-size", simulate_world_size, kMaxSimulatedWorldSize);
  if (simulate_world_size > 0 && (simulate_rank < 0 || simulate_rank >= simulate_world_size))
    flag_error("--simulate-rank", std::to_string(simulate_rank) + " is not a rank of --simulate-world-size " +
                                      std::to_string(simulate_world_size));
  if (simulate_world_size == 0 && simulate_rank != 0) flag_error("--simulate-rank", "needs --simulate-world-size");
  if (error_injection_rate < 0) flag_error("--error-injection-rate", "must be >= 0");
}

}  // namespace mfsdp
