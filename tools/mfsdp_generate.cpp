// mfsdp-generate: continue a prompt with a model trained by mfsdp-pretrain (or imported).
//
//   mfsdp-generate --model DIR (--prompt TEXT | --prompt-ids 5,17,99) [--max-new-tokens 64]
//       [--greedy | --temperature 0.8 --top-k 20 --top-p 0.95] [--seed 0] [--print-ids]
//       [--logits-out FILE] [--vocab-file V --merge-file M]   (GPT2BPETokenizer models)
//       [--model-config config.json]   (a checkpoint that records no model: PyTorch's dcp.save)
//
// DIR is what mfsdp::load_model (include/mfsdp/checkpoint/load_model.h) reads: a checkpoint (`--save` of
// mfsdp-pretrain, -sft or -grpo at any world size, `mfsdp-ckpt import-hf`; a save folder or an
// iter_NNNNNNN folder) or a Hugging Face Llama or Qwen2 folder (`--export-hf`, `mfsdp-ckpt
// export-hf`, transformers' save_pretrained). Text in and out needs the model's tokenizer to be
// ByteLevelTokenizer or GPT2BPETokenizer (a checkpoint records it; an HF folder does not, so use
// --prompt-ids there); any model works with token ids. --logits-out writes the fp32 logits of
// one forward over the prompt ([1, T, vocab], tensor "logits", safetensors) so they can be
// compared with another implementation's (tests/reference/).
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <iostream>
#include <limits>
#include <optional>
#include <sstream>

#include "mfsdp/checkpoint/load_model.h"
#include "mfsdp/checkpoint/safetensors.h"
#include "mfsdp/comm/comm.h"
#include "mfsdp/data/tokenizer.h"
#include "mfsdp/models/generate.h"

namespace {

// Bounds of the numeric flags, checked before the model is loaded. Generation stops at the
// model's max_position_embeddings anyway; these keep a typo from allocating or looping.
constexpr int64_t kMaxNewTokens = int64_t{1} << 20;
constexpr int64_t kMaxTopK = int64_t{1} << 24;
// Below this the logits / temperature of a float32 model overflow to inf (a sampling error deep
// in LibTorch); use --greedy for the most likely token.
constexpr double kMinTemperature = 1e-4, kMaxTemperature = 1e4;

// --prompt-ids: comma-separated non-negative token ids ("" when they parse, else what is wrong).
std::string check_ids(const std::string& text) {
  std::stringstream s(text);
  std::string item;
  while (std::getline(s, item, ',')) {
    size_t used = 0;
    long long id = -1;
    try {
      id = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size() || id < 0) return "'" + item + "' is not a token id";
  }
  return text.empty() || text.back() == ',' ? "expected token ids separated by commas, got '" + text + "'" : "";
}

// The seed, or nullopt unless `text` is a whole decimal integer in 0 .. 2^64 - 1.
std::optional<uint64_t> parse_seed(const std::string& text) {
  if (text.empty() || text.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  try {
    return std::stoull(text);  // out_of_range past 2^64 - 1
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

std::vector<int64_t> parse_ids(const std::string& text) {
  std::vector<int64_t> ids;
  std::stringstream s(text);
  std::string item;
  while (std::getline(s, item, ',')) ids.push_back(std::stoll(item));
  return ids;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_dir, model_config, prompt, prompt_ids, vocab_file, merge_file, logits_out, device_choice = "auto";
  bool print_ids = false;
  mfsdp::GenerateOptions g;
  CLI::App app{"Continue a prompt with a model trained by mfsdp (a checkpoint) or a Hugging Face Llama/Qwen2 folder",
               "mfsdp-generate"};
  app.add_option("--model", model_dir,
                 "a checkpoint (--save of mfsdp-pretrain, -sft, -grpo; mfsdp-ckpt import-hf: a save folder, read at "
                 "its latest iteration, or an iteration folder, a bare PyTorch dcp.save folder included) or a "
                 "Hugging Face Llama or Qwen2 folder (config.json + model.safetensors or its index)")
      ->required();
  app.add_option("--model-config", model_config,
                 "the model as a Hugging Face config.json, for a checkpoint that records none (a PyTorch dcp.save "
                 "folder)")
      ->check(CLI::ExistingFile);
  auto* text = app.add_option("--prompt", prompt, "the prompt as text (needs the model's text tokenizer)");
  auto* ids = app.add_option("--prompt-ids", prompt_ids, "the prompt as token ids, e.g. 5,17,99")->check(check_ids);
  text->excludes(ids);
  app.add_option("--max-new-tokens", g.max_new_tokens, "tokens to generate at most")
      ->check(CLI::Range(int64_t{0}, kMaxNewTokens))
      ->capture_default_str();
  app.add_flag("--greedy", g.greedy, "take the most likely token (else sample)");
  app.add_option("--temperature", g.temperature, "sampling temperature")
      ->check(CLI::Range(kMinTemperature, kMaxTemperature))
      ->capture_default_str();
  app.add_option("--top-k", g.top_k, "sample among the k most likely tokens (0: all)")
      ->check(CLI::Range(int64_t{0}, kMaxTopK))
      ->capture_default_str();
  app.add_option("--top-p", g.top_p, "sample within the smallest set of tokens of this probability, in (0, 1]")
      ->check(CLI::Range(std::numeric_limits<double>::min(), 1.0))
      ->capture_default_str();
  std::string seed = "0";  // parsed here: CLI11 wraps negative numbers and saturates large ones
  app.add_option("--seed", seed, "seed of the sampling generator, 0 .. 2^64 - 1")
      ->check([](const std::string& v) { return parse_seed(v) ? "" : "must be an integer in 0 .. 2^64 - 1"; },
              "0 .. 2^64 - 1")
      ->capture_default_str();
  app.add_flag("--print-ids", print_ids, "print the generated token ids (comma-separated) instead of text");
  app.add_option("--logits-out", logits_out,
                 "also write the fp32 logits of one forward over the prompt, shape [1, prompt tokens, vocab], as "
                 "tensor \"logits\" of a safetensors file");
  app.add_option("--vocab-file", vocab_file, "GPT2BPETokenizer models: the vocabulary file");
  app.add_option("--merge-file", merge_file, "GPT2BPETokenizer models: the merges file");
  app.add_option("--device", device_choice, "where the model runs: auto (the GPU when there is one), cpu or cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  try {
    app.parse(argc, argv);
    g.seed = *parse_seed(seed);
    if (prompt.empty() == prompt_ids.empty())
      throw CLI::ValidationError("--prompt / --prompt-ids", "give exactly one of them");
    if (vocab_file.empty() != merge_file.empty())
      throw CLI::ValidationError("--vocab-file / --merge-file", "give both or neither");
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::cerr << "mfsdp-generate: error: " << e.what() << " (mfsdp-generate --help)" << std::endl;
    return 2;
  }
  try {
    torch::set_num_threads(1);
    const at::Device device = mfsdp::resolve_device(device_choice, /*local_rank=*/0);
    mfsdp::LoadedModel loaded = mfsdp::load_model(model_dir, model_config);
    loaded.model->to(device);
    auto tokenizer = mfsdp::make_torch_safe_tokenizer({loaded.tokenizer_type, "", vocab_file, merge_file});
    std::vector<int64_t> input;
    if (!prompt_ids.empty()) {
      input = parse_ids(prompt_ids);
    } else {
      if (!tokenizer)
        throw std::invalid_argument("--prompt: the model's tokenizer '" + loaded.tokenizer_type +
                                    "' cannot encode text here; use --prompt-ids");
      input = tokenizer->encode(prompt);
    }
    const int64_t vocab = loaded.model->vocab_size();
    for (int64_t id : input)
      if (id < 0 || id >= vocab)
        throw std::invalid_argument("prompt token id " + std::to_string(id) + " is outside the model's vocabulary [0, " +
                                    std::to_string(vocab) + ")");
    if (tokenizer) g.stop_id = tokenizer->eod();
    if (tokenizer && !print_ids) g.vocab_size = tokenizer->vocab_size();  // decodable ids only, not padded rows
    std::vector<int64_t> out = mfsdp::generate(*loaded.model, input, g);  // also checks the prompt's length
    if (!logits_out.empty()) {
      torch::NoGradGuard no_grad;
      // No cache: the whole prompt in one forward, as a reference implementation computes it.
      at::Tensor logits = loaded.model->forward(torch::tensor(input, torch::kLong).unsqueeze(0).to(device))
                              .to(at::kCPU, torch::kFloat);
      mfsdp::write_safetensors(logits_out, {{"logits", logits}});
    }
    if (print_ids || !tokenizer) {
      for (size_t i = 0; i < out.size(); ++i) std::cout << (i ? "," : "") << out[i];
      std::cout << "\n";
    } else {
      if (!out.empty() && out.back() == tokenizer->eod()) out.pop_back();
      std::cout << (prompt.empty() ? "" : prompt) << tokenizer->decode(out) << "\n";
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "mfsdp-generate: " << e.what() << std::endl;
    return 1;
  }
}
