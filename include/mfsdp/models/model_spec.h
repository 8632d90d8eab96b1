// Model families: one ModelSpec per family (TorchTitan's TrainSpec is the model), found in a
// registry by name, by a Hugging Face config.json's model_type or by Megatron's arguments. The
// trainers, the checkpoint tools and generation go through it and never name a family.
//
//   const mfsdp::ModelSpec& spec = mfsdp::model_spec_for_hf(config_json);
//   mfsdp::ModelConfig config = spec.config_from_hf(config_json);
//   std::shared_ptr<mfsdp::CausalLM> model = spec.build(config, {});
//
// Adding a family is a folder src/models/<family>/ with its CausalLM and its ModelSpec, plus one
// line in src/models/model_registry.cpp (docs/design.md "Model families").
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "mfsdp/models/causal_lm.h"

namespace mfsdp {

class ModelSpec;

// A model's configuration, whatever its family: the family's spec and the model as a Hugging
// Face config.json, which is what checkpoints record as model_config. The spec writes it
// (config_from_hf / config_from_megatron), so it holds every field with torch_dtype "float32".
struct ModelConfig {
  const ModelSpec* spec = nullptr;
  nlohmann::json hf = nlohmann::json::object();

  // The fields every causal LM's config.json has.
  int64_t vocab_size() const;
  int64_t num_layers() const;  // num_hidden_layers
  int64_t hidden_size() const;
  int64_t max_position_embeddings() const;
};

// One Megatron-Core tensor's rows as a parameter of the family (from_megatron_name).
struct MegatronRows {
  std::string name;                                 // the family's parameter name
  std::vector<std::pair<int64_t, int64_t>> ranges;  // (first row, count), in order; empty: every row
  int64_t rows = 0;                                 // the rows they add up to
};

// What the layout must divide of a model (its family's parallel plan): the sizes tensor
// parallelism splits, by config.json field, and the routed experts of an MoE layer (0: dense),
// which expert parallelism splits. train/parallel_dims.h checks a layout against them.
struct ParallelSplits {
  std::vector<std::pair<std::string, int64_t>> tensor_parallel;  // {"num_attention_heads", 32}, ...
  int64_t experts = 0;
  // What expert tensor parallelism splits (each routed expert's MLP width).
  std::vector<std::pair<std::string, int64_t>> expert_tensor_parallel;
};

class ModelSpec {
 public:
  virtual ~ModelSpec() = default;

  virtual std::string name() const = 0;  // the registry's key: "llama"
  // The config.json model_type values the family reads.
  virtual std::vector<std::string> hf_model_types() const = 0;

  // The model Megatron-LM builds from its model arguments (its argparse names: num_layers,
  // hidden_size, ffn_hidden_size, num_attention_heads, group_query_attention, num_query_groups,
  // kv_channels, padded_vocab_size, max_position_embeddings, seq_length, rotary_base,
  // norm_epsilon, untie_embeddings_and_output_weights, init_method_std, swiglu, normalization,
  // position_embedding_type, add_bias_linear, add_qkv_bias, qk_layernorm, num_experts). Throws std::invalid_argument naming the argument
  // when they describe a model the family does not build.
  virtual ModelConfig config_from_megatron(const nlohmann::json& args) const = 0;
  // A config.json (or a checkpoint's model_config). Throws std::invalid_argument naming the
  // missing or invalid field.
  virtual ModelConfig config_from_hf(const nlohmann::json& hf) const = 0;
  // The config.json that transformers loads, with torch_dtype (float32, bfloat16 or float16).
  virtual nlohmann::json hf_config(const ModelConfig& config, at::ScalarType torch_dtype) const = 0;
  // Empty when a Hugging Face folder can hold the model; else why not (export is refused).
  virtual std::string hf_export_refusal(const ModelConfig& config) const = 0;
  // The model a Hugging Face folder holds, given its config and the names of its tensors
  // (optional tensors the folder leaves out, such as zero biases). Throws std::invalid_argument
  // starting with `where` when the tensors contradict the config.
  virtual ModelConfig with_hf_tensors(const ModelConfig& config, const std::vector<std::string>& tensor_names,
                                      const std::string& where) const = 0;

  // The model: eager (initialised from ModelBuildOptions::init_seed) or with deferred parameters.
  virtual std::shared_ptr<CausalLM> build(const ModelConfig& config, const ModelBuildOptions& options) const = 0;

  // The parameters a Megatron-Core GPT tensor `fqn` (Megatron-FSDP's and torch_dist's names) of
  // `rows` rows becomes, each a list of its row ranges; empty when `fqn` is not one of the
  // family's. `config` (null when the checkpoint records none) gives what splitting needs (the
  // head counts of a fused qkv); without it such a tensor keeps its name. Throws
  // std::invalid_argument naming `where` when the rows do not split as the config says.
  virtual std::vector<MegatronRows> from_megatron_name(const std::string& fqn, int64_t rows, const ModelConfig* config,
                                                       const std::string& where) const = 0;

  // Megatron-LM's model FLOPs of one iteration of `batch` sequences of `seq_length` tokens
  // (training.py num_floating_point_operations): what TFLOP/s is computed from.
  virtual double flops_per_iteration(const ModelConfig& config, int64_t batch, int64_t seq_length) const = 0;
  // What tensor and expert parallelism split of the model.
  virtual ParallelSplits parallel_splits(const ModelConfig& config) const = 0;
  // A few words for messages: "2 layers, hidden 32, vocab 64, tied embeddings".
  virtual std::string describe(const ModelConfig& config) const = 0;
};

// Every family, in registration order.
const std::vector<const ModelSpec*>& model_specs();
// By name; throws std::invalid_argument listing the families.
const ModelSpec& model_spec(const std::string& name);
// By config.json's model_type; throws std::invalid_argument naming the field and the types read.
const ModelSpec& model_spec_for_hf(const nlohmann::json& hf);
// The first family whose config_from_megatron takes `args`; else throws the first one's error.
const ModelSpec& model_spec_for_megatron(const nlohmann::json& args);

// Megatron-LM's MLP width when --ffn-hidden-size is not given (its arguments.py): 4 x hidden,
// or with --swiglu int(4 x hidden x 2/3 / 64) x 64, which keeps the three SwiGLU matrices near
// the parameters of the two GeLU ones, at a multiple of 64. 0 for a SwiGLU hidden_size under 48.
int64_t megatron_default_ffn_hidden_size(int64_t hidden_size, bool swiglu);

// model_spec_for_hf(hf).config_from_hf(hf).
ModelConfig model_config_from_hf(const nlohmann::json& hf);
// The config of the first family whose config_from_megatron takes `args`; else throws the first
// family's error.
ModelConfig model_config_from_megatron(const nlohmann::json& args);

// What a checkpoint or a Hugging Face folder holds of a model: its parameters, then its buffers
// (a router's expert bias), by name, in module order.
std::vector<std::pair<std::string, at::Tensor>> model_tensors(const torch::nn::Module& model);

// Name -> shape of every tensor of model_tensors. Built with deferred parameters: nothing
// large is allocated.
std::vector<std::pair<std::string, std::vector<int64_t>>> model_tensor_shapes(const ModelConfig& config);

}  // namespace mfsdp
