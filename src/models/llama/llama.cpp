// Decoder layer, LlamaModel and LlamaForCausalLM: wiring, initialisation, deferred init.
#include "mfsdp/models/llama.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "mfsdp/comm/comm.h"
#include "mfsdp/fsdp/recompute.h"
#include "mfsdp/models/mla_attention.h"
#include "models/param_init.h"

namespace mfsdp {

// ---- LlamaDecoderLayer --------------------------------------------------------------------

LlamaDecoderLayerImpl::LlamaDecoderLayerImpl(const LlamaConfig& c, int64_t layer_idx, bool deferred) {
  if (c.mla) {
    mla_attn = register_module("self_attn", std::make_shared<MlaAttentionImpl>(*c.mla, deferred, layer_idx));
  } else {
    self_attn = register_module("self_attn", LlamaAttention(c, layer_idx, deferred));
  }
  if (c.moe.is_moe_layer(layer_idx)) {
    moe = register_module(c.moe.mixtral_names ? "block_sparse_moe" : "mlp",
                          MoeBlock(c.hidden_size, c.moe, deferred));
  } else {
    mlp = register_module("mlp", LlamaMLP(c, deferred));
  }
  input_layernorm = register_module("input_layernorm", LlamaRMSNorm(c.hidden_size, c.rms_norm_eps, deferred));
  post_attention_layernorm =
      register_module("post_attention_layernorm", LlamaRMSNorm(c.hidden_size, c.rms_norm_eps, deferred));
}

at::Tensor LlamaDecoderLayerImpl::forward(const at::Tensor& hidden, const RotaryTables& rope,
                                          LlamaKVCache* cache, const at::Tensor& allowed, const at::Tensor& tokens,
                                          const ContextParallelKeys& cp) {
  // Selective recompute (recompute.h): a piece checkpointed runs once without keeping its
  // activations and again in backward. Each reads only this layer's parameters (its FSDP unit,
  // gathered for the layer's backward) or, for the MoE block, its experts' unit, which the rerun
  // gathers itself (unit_state.cpp, in_recompute).
  const bool selective = recompute.is_selective() && cache == nullptr;
  auto piece = [](bool on, RecomputeFn fn, const at::Tensor& x) {
    return on ? mfsdp::recompute(fn, {x})[0] : fn({x})[0];
  };
  auto norm = [&](const LlamaRMSNorm& n, const at::Tensor& x) {
    return piece(selective && recompute.layernorm,
                 [n = n.ptr()](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{n->forward(in[0])}; }, x);
  };
  at::Tensor h;
  if (mla_attn) {
    h = hidden + mla_attn->forward(norm(input_layernorm, hidden), rope, cache, allowed, cp);
  } else {
    h = hidden + self_attn(norm(input_layernorm, hidden), rope, cache, allowed, cp);
  }
  at::Tensor normed = norm(post_attention_layernorm, h);
  if (moe) {
    std::shared_ptr<MoeBlockImpl> block = moe.ptr();
    return h + piece(selective && recompute.moe,
                     [block, tokens](const std::vector<at::Tensor>& in) {
                       return std::vector<at::Tensor>{block->forward(in[0], tokens)};
                     },
                     normed);
  }
  std::shared_ptr<LlamaMLPImpl> dense = mlp.ptr();
  return h + piece(selective && recompute.mlp,
                   [dense](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{dense->forward(in[0])}; },
                   normed);
}

// ---- LlamaModel ---------------------------------------------------------------------------

LlamaModelImpl::LlamaModelImpl(const LlamaConfig& c, bool deferred, const LlamaParallel& parallel)
    : config_(c), parallel_(parallel) {
  config_.validate();
  embed_tokens = register_module("embed_tokens", LlamaEmbedding(c.vocab_size, c.hidden_size, deferred));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.num_layers; ++i) layers->push_back(LlamaDecoderLayer(c, i, deferred));
  norm = register_module("norm", LlamaRMSNorm(c.hidden_size, c.rms_norm_eps, deferred));
  end_layer_ = c.num_layers;
  for (int64_t i = 0; i < c.num_layers; ++i) kept_layers_.push_back(i);
}

void LlamaModelImpl::keep_pipeline_chunks(const std::vector<PipelineChunk>& chunks, bool tied_embedding) {
  bool embedding = false, output = false;
  std::vector<bool> kept(static_cast<size_t>(num_layers()), false);
  for (const PipelineChunk& chunk : chunks) {
    if (chunk.first_layer < 0 || chunk.num_layers < 0 || chunk.first_layer + chunk.num_layers > num_layers())
      throw std::invalid_argument("LlamaModel: pipeline chunk of layers [" + std::to_string(chunk.first_layer) + ", " +
                                  std::to_string(chunk.first_layer + chunk.num_layers) + ") outside the model's " +
                                  std::to_string(num_layers()) + " layers");
    for (int64_t i = chunk.first_layer; i < chunk.first_layer + chunk.num_layers; ++i) kept[static_cast<size_t>(i)] = true;
    embedding = embedding || chunk.embedding;
    output = output || chunk.output;
  }
  kept_layers_.clear();
  for (int64_t i = 0; i < num_layers(); ++i)
    if (kept[static_cast<size_t>(i)])
      kept_layers_.push_back(i);
    else
      layers->unregister_module(std::to_string(i));
  if (!embedding) {
    if (output && tied_embedding) {
      embed_tokens->as_output = true;  // the last stage's copy of the tied weight
    } else {
      unregister_module("embed_tokens");
      embed_tokens = nullptr;
    }
  }
  if (!output) {
    unregister_module("norm");
    norm = nullptr;
  }
  if (!chunks.empty()) run_chunk(chunks.front());
}

void LlamaModelImpl::run_chunk(const PipelineChunk& chunk) {
  first_layer_ = chunk.first_layer;
  end_layer_ = chunk.first_layer + chunk.num_layers;
  chunk_embeds_ = chunk.embedding;
  chunk_outputs_ = chunk.output;
}

int64_t LlamaModelImpl::row_length(const at::Tensor& input) const {
  const bool ids = chunk_embeds_;
  if (ids ? input.dim() != 2 : input.dim() != 3)
    throw std::invalid_argument(std::string("LlamaModel::forward: expected ") +
                                (ids ? "input_ids [B, T]" : "a previous pipeline stage's hidden states [B, T, H]") +
                                ", found shape " + c10::str(input.sizes()));
  // Under sequence parallelism the hidden states between stages are this rank's slice [B, T/tp, H].
  return ids || !parallel_.sequence ? input.size(1) : input.size(1) * parallel_.tp_size();
}

void LlamaModelImpl::set_recompute(const RecomputeOptions& options) {
  if (options.full() && options.num_layers < 1)
    throw std::invalid_argument("LlamaModel: full recompute needs num_layers >= 1, got " +
                                std::to_string(options.num_layers));
  recompute_ = options;
  // Selective: each layer's pieces; the other modules' flags are off under full or none.
  const bool s = options.is_selective();
  for (int64_t i = 0; i < num_layers(); ++i) {
    LlamaDecoderLayerImpl& l = layer(i);
    l.recompute = s ? options : RecomputeOptions{};
    if (l.self_attn) l.self_attn->recompute_core_attn = s && options.core_attn;
    if (l.mla_attn) {
      l.mla_attn->recompute_core_attn = s && options.core_attn;
      l.mla_attn->recompute_up_proj = s && options.mla_up_proj;
    }
    if (l.moe) {
      l.moe->recompute_shared_expert = s && options.shared_experts;
      l.moe->experts->recompute_activation = s && options.moe_act;
    }
  }
}

LlamaDecoderLayerImpl& LlamaModelImpl::layer(int64_t i) {
  if (i < 0 || i >= num_layers())
    throw std::out_of_range("LlamaModel::layer: index " + std::to_string(i) + " outside [0, " +
                            std::to_string(num_layers()) + ")");
  return *layers->ptr<LlamaDecoderLayerImpl>(i);
}

at::Tensor LlamaModelImpl::forward(const at::Tensor& input_ids, LlamaKVCache* cache, int64_t start_pos) {
  const int64_t t = row_length(input_ids);
  if (context_parallelism.active()) {
    // This rank's chunks of a sequence starting at position 0.
    const int64_t s = context_parallel_length(t, cache);
    if (start_pos > 0)
      throw std::invalid_argument("LlamaModel::forward: context parallelism starts every sequence at position 0, not " +
                                  std::to_string(start_pos));
    ContextParallelKeys keys;
    keys.global_positions = context_parallel::cp_positions(s, context_parallelism.size(), context_parallelism.rank())
                                .to(input_ids.device());
    return run_layers(input_ids, rope_tables(keys.global_positions), nullptr,
                      {}, {}, keys);
  }
  if (cache != nullptr && cache->num_layers() != num_layers())
    throw std::invalid_argument("LlamaModel::forward: the KV cache has " +
                                std::to_string(cache->num_layers()) + " layers, the model " +
                                std::to_string(num_layers()));
  const int64_t cached = cache != nullptr ? cache->length() : 0;
  const int64_t start = start_pos < 0 ? cached : start_pos;
  if (cache != nullptr && start != cached)
    throw std::invalid_argument("LlamaModel::forward: start_pos " + std::to_string(start) +
                                " differs from the KV cache's length " + std::to_string(cached));
  if (start + t > config_.max_position_embeddings)
    throw std::invalid_argument("LlamaModel::forward: positions up to " + std::to_string(start + t) +
                                " exceed max_position_embeddings " +
                                std::to_string(config_.max_position_embeddings));

  at::Tensor positions = at::arange(start, start + t, input_ids.options().dtype(at::kLong));
  return run_layers(input_ids, rope_tables(positions), cache, {}, {});
}

at::Tensor LlamaModelImpl::forward(const at::Tensor& input_ids, const SequenceLayout& layout, LlamaKVCache* cache) {
  const int64_t b = input_ids.size(0), t = row_length(input_ids);
  if (cache != nullptr && cache->num_layers() != num_layers())
    throw std::invalid_argument("LlamaModel::forward: the KV cache has " +
                                std::to_string(cache->num_layers()) + " layers, the model " +
                                std::to_string(num_layers()));
  const int64_t past = cache != nullptr ? cache->length() : 0;
  ContextParallelKeys keys;
  at::Tensor allowed;
  if (context_parallelism.active()) {
    // Every field of the layout is this rank's part; the masks compare global indices.
    const int64_t s = context_parallel_length(t, cache);
    keys.global_positions = context_parallel::cp_positions(s, context_parallelism.size(), context_parallelism.rank())
                                .to(input_ids.device());
    keys.key_padding_mask = layout.attention_mask.defined() ? layout.attention_mask.to(input_ids.device()) : at::Tensor();
    keys.segment_ids = layout.segment_ids.defined() ? layout.segment_ids.to(input_ids.device()) : at::Tensor();
    for (const auto& [field, value] : {std::pair<const char*, const at::Tensor*>{"attention_mask", &keys.key_padding_mask},
                                       {"segment_ids", &keys.segment_ids}})
      if (value->defined() && (value->dim() != 2 || value->size(0) != b || value->size(1) != t))
        throw std::invalid_argument(std::string("LlamaModel::forward: under context parallelism ") + field +
                                    " must be this rank's part [" + std::to_string(b) + ", " + std::to_string(t) +
                                    "], found " + c10::str(value->sizes()));
  } else {
    allowed = layout.allowed_keys(b, t, input_ids.device(), past);
  }
  // Positions are checked where they are known without reading the device: a read here would be
  // a host sync in every forward, and the step must have none (tests/gpu/host_sync_gpu_test.cpp).
  // Generated positions by their range, given ones on the CPU (the trainers build them there)
  // before they move, given ones already on a GPU by an assertion on the device.
  const int64_t limit = config_.max_position_embeddings;
  const std::string out_of_range =
      "LlamaModel::forward: position_ids must lie in [0, " + std::to_string(limit) + ")";
  at::Tensor positions;
  if (layout.position_ids.defined()) {
    const at::Tensor& given = layout.position_ids;
    if (given.numel() > 0 && given.device().is_cpu()) {
      if (given.max().item<int64_t>() >= limit || given.min().item<int64_t>() < 0)
        throw std::invalid_argument(out_of_range);
    } else if (given.numel() > 0) {
      at::_assert_async(at::logical_and(given.min() >= 0, given.max() < limit), out_of_range);
    }
    positions = given.to(input_ids.device(), at::kLong);
  } else if (keys.global_positions.defined()) {
    positions = keys.global_positions;  // [0, the global length): checked by context_parallel_length
  } else {
    if (past + t > limit) throw std::invalid_argument(out_of_range);
    positions = at::arange(past, past + t, input_ids.options().dtype(at::kLong));
  }
  // Padding positions route like any other but are not counted (Megatron's padding_mask).
  at::Tensor tokens;
  if (layout.attention_mask.defined())
    tokens = layout.attention_mask.narrow(1, past, t).to(input_ids.device()).ne(0).reshape({-1});
  if (tokens.defined() && parallel_.sequence) {
    // Under sequence parallelism the layers hold this rank's slice of the sequence.
    const int64_t slice = t / parallel_.tp_size();
    tokens = tokens.view({-1, t}).narrow(1, parallel_.tp_rank() * slice, slice).reshape({-1});
  }
  return run_layers(input_ids, rope_tables(positions), cache, allowed,
                    tokens, keys);
}

RotaryTables LlamaModelImpl::rope_tables(const at::Tensor& positions) const {
  return config_.mla ? mla_rotary_tables(positions, *config_.mla)
                     : rotary_tables(positions, config_.head_dim(), config_.rope_theta);
}

int64_t LlamaModelImpl::context_parallel_length(int64_t local_length, const LlamaKVCache* cache) const {
  if (cache != nullptr)
    throw std::invalid_argument("LlamaModel::forward: no KV cache under context parallelism (generation runs on one "
                                "rank's whole sequence)");
  const int64_t s = local_length * context_parallelism.size();
  if (s > config_.max_position_embeddings)
    throw std::invalid_argument("LlamaModel::forward: the whole sequence (" + std::to_string(local_length) + " x " +
                                std::to_string(context_parallelism.size()) +
                                " context-parallel ranks) exceeds max_position_embeddings " +
                                std::to_string(config_.max_position_embeddings));
  return s;
}

at::Tensor LlamaModelImpl::run_layers(const at::Tensor& input_ids, const RotaryTables& rope, LlamaKVCache* cache,
                                      const at::Tensor& allowed, const at::Tensor& tokens,
                                      const ContextParallelKeys& cp) {
  // A unit of its own when untied. A pipeline chunk without the embedding starts from the
  // previous chunk's hidden states.
  at::Tensor hidden = chunk_embeds_ ? mfsdp::call(*embed_tokens, input_ids) : input_ids;
  // Full recompute (recompute.h) over this chunk's layers, as Megatron's _checkpointed_forward
  // (megatron/core/recompute.py in Megatron-LM): uniform, groups of num_layers layers, each group
  // one checkpoint; block, the chunk's first num_layers layers one by one, the rest plain.
  const bool full = recompute_.full() && cache == nullptr && at::GradMode::is_enabled();
  const bool uniform = recompute_.method == RecomputeOptions::Method::kUniform;
  for (int64_t i = first_layer_; i < end_layer_;) {
    const int64_t count = full && uniform ? std::min(recompute_.num_layers, end_layer_ - i) : 1;
    if (full && (uniform || i - first_layer_ < recompute_.num_layers)) {
      std::vector<std::shared_ptr<LlamaDecoderLayerImpl>> group;
      for (int64_t j = i; j < i + count; ++j) group.push_back(layers->ptr<LlamaDecoderLayerImpl>(j));
      // Captured by value: backward calls the function again after this frame is gone.
      hidden = mfsdp::recompute(
          [group, rope, allowed, tokens, cp](const std::vector<at::Tensor>& in) -> std::vector<at::Tensor> {
            at::Tensor h = in[0];
            for (const auto& layer : group)
              h = layer->call(h, rope, static_cast<LlamaKVCache*>(nullptr), allowed, tokens, cp);
            return {h};
          },
          {hidden})[0];
    } else {
      hidden = layers->ptr<LlamaDecoderLayerImpl>(i)->call(hidden, rope, cache, allowed, tokens, cp);
    }
    i += count;
  }
  return chunk_outputs_ ? norm(hidden) : hidden;
}

// ---- LlamaForCausalLM ---------------------------------------------------------------------

namespace {

// Megatron's checks (its arguments.py and the divide() of each layer): every split dimension
// divides by the tensor-parallel size. Throws std::invalid_argument naming the field.
void check_tensor_parallel(const LlamaConfig& c, const LlamaParallel& p) {
  const int tp = p.tp_size();
  if (tp == 1) return;
  for (const auto& [field, value] : c.tensor_parallel_splits())
    if (value % tp != 0)
      throw std::invalid_argument("LlamaForCausalLM: tensor parallelism over " + std::to_string(tp) +
                                  " ranks splits " + field + " (" + std::to_string(value) +
                                  "), which does not divide by " + std::to_string(tp));
  if (p.moe.expert_tensor && c.moe.num_experts > 0 && c.moe.ffn_hidden_size % tp != 0)
    throw std::invalid_argument("LlamaForCausalLM: expert tensor parallelism over " + std::to_string(tp) +
                                " ranks splits each expert's width (moe_intermediate_size " +
                                std::to_string(c.moe.ffn_hidden_size) + "), which does not divide by " +
                                std::to_string(tp));
  // Megatron's MoE layer refuses to train under tensor parallelism without it: each rank routes
  // its slice of the sequence.
  if (c.moe.num_experts > 0 && !p.sequence)
    throw std::invalid_argument("LlamaForCausalLM: tensor parallelism with MoE layers (num_experts " +
                                std::to_string(c.moe.num_experts) + ") needs sequence parallelism");
}

LlamaParallel parallel_of(const LlamaConfig& c, const LlamaOptions& o) {
  LlamaParallel p;
  p.tensor = split_group(o.tensor_parallel);
  // Megatron turns sequence parallelism off without tensor parallelism.
  p.sequence = p.tensor != nullptr && o.sequence_parallel;
  p.moe.expert = o.expert_parallel;
  if (p.tensor && split_group(o.expert_tensor_parallel)) {
    if (o.expert_tensor_parallel->size() != p.tensor->size())
      throw std::invalid_argument("LlamaForCausalLM: the experts split over " +
                                  std::to_string(o.expert_tensor_parallel->size()) +
                                  " ranks, not the tensor-parallel group's " + std::to_string(p.tensor->size()));
    p.moe.expert_tensor = o.expert_tensor_parallel;
  }
  // Each MoE block's tokens are spread over the context-parallel ranks and, under sequence
  // parallelism, the tensor-parallel ones (both: their tp_cp group).
  if (p.sequence) p.moe.sequence = p.tensor;
  const std::shared_ptr<Communicator> context = split_group(o.context_parallel);
  if (p.sequence && context) {
    if (!o.tensor_context_parallel && c.moe.num_experts > 0)
      throw std::logic_error("LlamaForCausalLM: MoE layers under sequence and context parallelism need the "
                             "tensor- and context-parallel group (ModelBuildOptions::tensor_context_parallel)");
    p.moe.tokens = o.tensor_context_parallel;
  } else {
    p.moe.tokens = p.sequence ? p.tensor : context;
  }
  return p;
}

}  // namespace

LlamaForCausalLMImpl::LlamaForCausalLMImpl(const LlamaConfig& c, const LlamaOptions& options)
    : config_(c), parallel_(parallel_of(c, options)) {
  config_.validate();
  check_tensor_parallel(c, parallel_);
  init_seed_ = options.init_seed ? *options.init_seed : detail::draw_seed();
  // Built whole and deferred, cut by the plan, then initialised (unless the caller defers).
  model = register_module("model", LlamaModel(c, /*deferred=*/true, parallel_));
  model->set_recompute(options.effective_recompute());
  for (int64_t i = 0; i < c.num_layers; ++i)
    if (model->layer(i).moe) model->layer(i).moe->training_options = options.moe;
  if (!c.tie_word_embeddings)
    lm_head = register_module("lm_head", LlamaLinear(c.hidden_size, c.vocab_size, /*deferred=*/true));
  if (!options.pipeline.empty()) {
    model->keep_pipeline_chunks(options.pipeline, c.tie_word_embeddings);
    const bool output = std::any_of(options.pipeline.begin(), options.pipeline.end(),
                                    [](const PipelineChunk& k) { return k.output; });
    if (lm_head && !output) {
      unregister_module("lm_head");
      lm_head = nullptr;
    }
  }
  // The experts are FSDP units of their own when their expert-data-parallel group is not the
  // layer's (expert parallelism, or experts whole under tensor parallelism).
  const bool experts_apart = split_group(options.expert_parallel) || (parallel_.tensor && !parallel_.moe.expert_tensor);
  apply_parallel_plan(llama_parallel_plan(c, experts_apart, options.pipeline),
                      {parallel_.tensor, parallel_.sequence, parallel_.moe.expert_tensor != nullptr},
                      {split_group(options.context_parallel), options.context_parallel_algorithm}, parallel_.moe,
                      options.pipeline, c.tie_word_embeddings ? "model.embed_tokens.weight" : "");
  layer_deferred_.assign(c.num_layers, false);
  for (int64_t i : model->kept_layers()) layer_deferred_[static_cast<size_t>(i)] = true;
  root_deferred_ = true;
  if (!options.deferred_init) reset_parameters();
}

at::Tensor LlamaForCausalLMImpl::forward(const at::Tensor& input_ids, LlamaKVCache* cache,
                                         int64_t start_pos) {
  check_materialized();
  if (const auto chunk = pipeline_chunk()) model->run_chunk(*chunk);
  return logits(model->forward(input_ids, cache, start_pos));
}

at::Tensor LlamaForCausalLMImpl::forward(const at::Tensor& input_ids, const SequenceLayout& layout,
                                         LlamaKVCache* cache) {
  check_materialized();
  if (const auto chunk = pipeline_chunk()) model->run_chunk(*chunk);
  return logits(model->forward(input_ids, layout, cache));
}

at::Tensor LlamaForCausalLMImpl::logits(const at::Tensor& hidden) {
  if (const auto chunk = pipeline_chunk(); chunk && !chunk->output) return hidden;  // the next chunk's input
  // Tensor-parallel (the plan's boundary): a column-parallel output layer over this rank's
  // vocabulary rows, so no rank forms the full-vocabulary logits.
  const at::Tensor in = parallel_boundary.enter(hidden);
  if (lm_head) return mfsdp::call(*lm_head, in);
  // The last pipeline stage's copy of a tied embedding is a unit of its own.
  if (model->embed_tokens->as_output) return mfsdp::call(*model->embed_tokens, in);
  return at::linear(in, model->embed_tokens->weight);
}

TokenStats LlamaForCausalLMImpl::forward_token_stats(const at::Tensor& input, const SequenceLayout& layout,
                                                     const at::Tensor& targets, const ChunkedOutputOptions& options) {
  check_materialized();
  if (const auto chunk = pipeline_chunk()) {
    if (!chunk->output)
      throw std::logic_error("LlamaForCausalLM::forward_token_stats: the selected pipeline chunk does not hold "
                             "the output layer");
    model->run_chunk(*chunk);
  }
  // As logits() but fused with the loss: the same weight (lm_head's, the tied embedding's or the
  // last stage's copy of it), read through its unit's hooks so FSDP gathers it for this forward
  // and again for the backward.
  // No layout: the plain causal forward (no mask tensor), as forward(input) runs it.
  const bool plain = !layout.position_ids.defined() && !layout.attention_mask.defined() && !layout.segment_ids.defined();
  const at::Tensor in = parallel_boundary.enter(plain ? model->forward(input) : model->forward(input, layout));
  ChunkedOutputOptions o = options;
  o.tensor_parallel = parallel_.tensor.get();
  const auto stats = [&](torch::nn::Module& owner, const at::Tensor& weight) {
    return call_as_forward(owner, in, [&](const at::Tensor& cast) {
      TokenStats s = chunked_output_token_stats(cast, weight, targets, o);
      return std::vector<at::Tensor>{s.log_probs, s.entropy};
    });
  };
  std::vector<at::Tensor> out;
  if (lm_head) {
    out = stats(*lm_head, lm_head->weight);
  } else if (model->embed_tokens->as_output) {
    out = stats(*model->embed_tokens, model->embed_tokens->weight);
  } else {
    TokenStats s = chunked_output_token_stats(in, model->embed_tokens->weight, targets, o);
    return s;
  }
  return {out[0], out[1]};
}

void LlamaForCausalLMImpl::check_materialized() const {
  if (has_deferred())
    throw std::logic_error(
        "LlamaForCausalLM::forward: the model was built with deferred_init and some parameters "
        "are not materialised yet (call materialize_and_init_layer(i) for every layer and "
        "init_root())");
}

void LlamaForCausalLMImpl::init_values(const std::string& name, const at::Tensor& out) const {
  const at::Tensor* param = named_parameters().find(name);
  if (param == nullptr)
    throw std::invalid_argument("LlamaForCausalLM::init_values: no parameter named '" + name + "'");
  if (!out.sizes().equals(param->sizes()))
    throw std::invalid_argument("LlamaForCausalLM::init_values: '" + name + "' has shape " +
                                c10::str(param->sizes()) + ", the output " + c10::str(out.sizes()));
  // Norm weights (input_layernorm, post_attention_layernorm, norm) start at one, biases (Qwen2's
  // q/k/v) at zero (transformers' _init_weights); the projections and the embedding at
  // normal(0, init_std).
  const auto dot = name.rfind('.');
  const std::string owner = name.substr(0, dot == std::string::npos ? 0 : dot);
  const std::string leaf = name.substr(dot == std::string::npos ? 0 : dot + 1);
  const bool is_norm = owner.size() >= 4 && owner.compare(owner.size() - 4, 4, "norm") == 0;
  at::NoGradGuard no_grad;
  if (leaf == "bias") {
    out.zero_();
  } else if (is_norm) {
    out.fill_(1.0);
  } else if (const TensorParallelSplit split = tensor_parallel_split(name); split != TensorParallelSplit::kReplicated) {
    // This rank's rows or columns of the values the whole parameter gets on one rank.
    const int64_t dim = split == TensorParallelSplit::kRows ? 0 : 1;
    std::vector<int64_t> full_sizes = out.sizes().vec();
    full_sizes[static_cast<size_t>(dim)] *= parallel_.tp_size();
    at::Tensor full = at::empty(full_sizes, at::kFloat);
    detail::fill_normal(full, config_.init_std, detail::parameter_seed(init_seed_, name));
    out.copy_(full.narrow(dim, parallel_.tp_rank() * out.size(dim), out.size(dim)));
  } else {
    detail::fill_normal(out, config_.init_std, detail::parameter_seed(init_seed_, name));
  }
}

void LlamaForCausalLMImpl::init_named(const std::string& prefix, torch::nn::Module& module) {
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    detail::materialize(item.value());
    init_values(prefix + item.key(), item.value());
  }
}

namespace {
// After fully_shard, a parameter is a view of the unit's flat buffer, whose storage is freed
// (0 bytes) between uses under optim_grads_params: "growing" it would corrupt the unit.
void require_not_sharded(const torch::nn::Module& module, const std::string& what) {
  if (detail::find_unit(module) != nullptr)
    throw std::logic_error("LlamaForCausalLM: " + what +
                           " is already a fully_shard unit; materialise and initialise before "
                           "fully_shard (or fill the unit's buffers through init_values)");
}
}  // namespace

void LlamaForCausalLMImpl::materialize_and_init_layer(int64_t i) {
  const std::vector<int64_t>& kept = model->kept_layers();
  if (!std::binary_search(kept.begin(), kept.end(), i))
    throw std::out_of_range("LlamaForCausalLM::materialize_and_init_layer: layer " + std::to_string(i) +
                            " is not in this pipeline stage's chunks");
  require_not_sharded(model->layer(i), "layer " + std::to_string(i));
  init_named("model.layers." + std::to_string(i) + ".", model->layer(i));
  layer_deferred_[i] = false;
}

void LlamaForCausalLMImpl::init_root() {
  require_not_sharded(*this, "the root");
  if (model->embed_tokens) init_named("model.embed_tokens.", *model->embed_tokens);
  if (model->norm) init_named("model.norm.", *model->norm);
  if (lm_head) init_named("lm_head.", *lm_head);
  root_deferred_ = false;
}

void LlamaForCausalLMImpl::reset_parameters() {
  for (int64_t i : model->kept_layers()) materialize_and_init_layer(i);
  init_root();
}

bool LlamaForCausalLMImpl::has_deferred() const {
  if (root_deferred_) return true;
  for (bool d : layer_deferred_)
    if (d) return true;
  return false;
}

std::vector<std::pair<int64_t, RouterStats>> LlamaForCausalLMImpl::take_router_stats() {
  std::vector<std::pair<int64_t, RouterStats>> out;
  for (int64_t i : model->kept_layers())
    if (model->layer(i).moe) out.emplace_back(i, model->layer(i).moe->take_stats());
  return out;
}

void LlamaForCausalLMImpl::set_aux_loss_scale(double scale) {
  for (int64_t i : model->kept_layers())
    if (model->layer(i).moe) model->layer(i).moe->aux_loss_scale = scale;
}

void LlamaForCausalLMImpl::update_expert_bias(int64_t layer, const std::vector<int64_t>& tokens_per_expert) {
  if (MoeBlock& moe = model->layer(layer).moe) moe->update_expert_bias(tokens_per_expert);
}

void LlamaForCausalLMImpl::set_use_sdpa(bool on) {
  for (int64_t i : model->kept_layers())
    if (LlamaAttention& attn = model->layer(i).self_attn) attn->use_sdpa = on;  // MLA: always SDPA
}

FsdpHandle shard_llama(LlamaForCausalLM& model, const FullyShardOptions& options) {
  // fully_shard copies each parameter into its flat buffer: a 0-byte storage would be read.
  if (model->has_deferred())
    throw std::logic_error(
        "shard_llama: the model has deferred parameters; call materialize_and_init_layer(i) for "
        "every layer and init_root() first");
  return shard_model(*model, options);
}

}  // namespace mfsdp
