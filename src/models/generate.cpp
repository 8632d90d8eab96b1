#include "mfsdp/generate.h"

#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>

namespace mfsdp {
namespace {

// Keeps the logits of the smallest set of tokens whose probability reaches top_p, and at most
// top_k of them; the rest become -inf.
at::Tensor filter_logits(at::Tensor logits, const GenerateOptions& o) {
  if (o.top_k > 0 && o.top_k < logits.size(0)) {
    at::Tensor kth = std::get<0>(logits.topk(o.top_k)).index({-1});
    logits = logits.masked_fill(logits < kth, -std::numeric_limits<float>::infinity());
  }
  if (o.top_p < 1.0) {
    auto [sorted, order] = logits.sort(/*dim=*/0, /*descending=*/true);
    at::Tensor cumulative = sorted.softmax(0).cumsum(0);
    // Drop a token when the tokens before it already reach top_p (the first always stays).
    at::Tensor drop = (cumulative - sorted.softmax(0)) >= o.top_p;
    at::Tensor mask = at::zeros_like(drop).scatter(0, order, drop);
    logits = logits.masked_fill(mask, -std::numeric_limits<float>::infinity());
  }
  return logits;
}

}  // namespace

std::vector<int64_t> generate(LlamaForCausalLMImpl& model, const std::vector<int64_t>& prompt,
                              const GenerateOptions& o) {
  if (prompt.empty()) throw std::invalid_argument("generate: the prompt is empty");
  if (!(o.temperature > 0)) throw std::invalid_argument("generate: temperature must be > 0");
  if (!(o.top_p > 0 && o.top_p <= 1)) throw std::invalid_argument("generate: top_p must be in (0, 1]");
  if (o.top_k < 0) throw std::invalid_argument("generate: top_k must be >= 0");
  const int64_t limit = model.config().max_position_embeddings;
  if (static_cast<int64_t>(prompt.size()) >= limit)
    throw std::invalid_argument("generate: the prompt has " + std::to_string(prompt.size()) +
                                " tokens; the model takes at most " + std::to_string(limit));
  torch::NoGradGuard no_grad;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(o.seed);
  LlamaKVCache cache(model.config().num_layers);
  at::Tensor input = torch::tensor(prompt, torch::kLong).unsqueeze(0);
  std::vector<int64_t> out;
  int64_t position = 0;
  for (int64_t step = 0; step < o.max_new_tokens && position + input.size(1) <= limit; ++step) {
    at::Tensor logits = model.forward(input, &cache, position);  // [1, T, V]
    position += input.size(1);
    at::Tensor last = logits[0][-1].to(torch::kFloat);
    int64_t next;
    if (o.greedy) {
      next = last.argmax().item<int64_t>();
    } else {
      at::Tensor probs = filter_logits(last / o.temperature, o).softmax(0);
      next = at::multinomial(probs, 1, false, gen).item<int64_t>();
    }
    out.push_back(next);
    if (next == o.stop_id) break;
    input = torch::tensor({next}, torch::kLong).unsqueeze(0);
  }
  return out;
}

void save_final_model(const std::string& dir, const LlamaConfig& c, const std::string& tokenizer_type,
                      const std::map<std::string, at::Tensor>& state) {
  namespace fs = std::filesystem;
  fs::create_directories(dir);
  nlohmann::json j = {{"vocab_size", c.vocab_size},
                      {"hidden_size", c.hidden_size},
                      {"intermediate_size", c.intermediate_size},
                      {"num_hidden_layers", c.num_layers},
                      {"num_attention_heads", c.num_attention_heads},
                      {"num_key_value_heads", c.num_key_value_heads},
                      {"max_position_embeddings", c.max_position_embeddings},
                      {"rope_theta", c.rope_theta},
                      {"rms_norm_eps", c.rms_norm_eps},
                      {"tie_word_embeddings", c.tie_word_embeddings},
                      {"initializer_range", c.init_std},
                      {"tokenizer_type", tokenizer_type}};
  std::ofstream(fs::path(dir) / "config.json") << j.dump(2) << "\n";
  c10::impl::GenericDict dict(c10::StringType::get(), c10::TensorType::get());
  for (const auto& [name, t] : state) dict.insert(name, t.contiguous());
  dict.insert("__format__", torch::tensor({1}));  // keeps the dict >= 2 entries (libtorch_probe Q8)
  std::vector<char> bytes = torch::pickle_save(c10::IValue(dict));
  std::ofstream out(fs::path(dir) / "model.pt", std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + (fs::path(dir) / "model.pt").string());
}

LoadedModel load_final_model(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path config_path = fs::path(dir) / "config.json", model_path = fs::path(dir) / "model.pt";
  std::ifstream cin(config_path);
  if (!cin) throw std::invalid_argument("--model: cannot read " + config_path.string());
  nlohmann::json j;
  try {
    cin >> j;
  } catch (const std::exception& e) {
    throw std::invalid_argument(config_path.string() + ": " + e.what());
  }
  LlamaConfig c;
  try {
    c.vocab_size = j.at("vocab_size");
    c.hidden_size = j.at("hidden_size");
    c.intermediate_size = j.at("intermediate_size");
    c.num_layers = j.at("num_hidden_layers");
    c.num_attention_heads = j.at("num_attention_heads");
    c.num_key_value_heads = j.at("num_key_value_heads");
    c.max_position_embeddings = j.at("max_position_embeddings");
    c.rope_theta = j.at("rope_theta");
    c.rms_norm_eps = j.at("rms_norm_eps");
    c.tie_word_embeddings = j.at("tie_word_embeddings");
  } catch (const std::exception& e) {
    throw std::invalid_argument(config_path.string() + ": " + e.what());
  }
  LoadedModel loaded;
  loaded.tokenizer_type = j.value("tokenizer_type", "");
  loaded.model = LlamaForCausalLM(c);
  std::ifstream in(model_path, std::ios::binary);
  if (!in) throw std::invalid_argument("--model: cannot read " + model_path.string());
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  c10::impl::GenericDict dict = torch::pickle_load(bytes).toGenericDict();
  torch::NoGradGuard no_grad;
  for (auto& item : loaded.model->named_parameters()) {
    if (!dict.contains(item.key()))
      throw std::invalid_argument(model_path.string() + ": missing tensor '" + item.key() + "'");
    at::Tensor t = dict.at(item.key()).toTensor();
    if (t.sizes() != item.value().sizes())
      throw std::invalid_argument(model_path.string() + ": tensor '" + item.key() + "' has shape " +
                                  c10::str(t.sizes()) + ", config.json implies " +
                                  c10::str(item.value().sizes()));
    item.value().copy_(t);
  }
  return loaded;
}

}  // namespace mfsdp
