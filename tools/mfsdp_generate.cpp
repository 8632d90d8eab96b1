// mfsdp-generate: continue a prompt with a model trained by mfsdp-pretrain (or imported).
//
//   mfsdp-generate --model DIR (--prompt TEXT | --prompt-ids 5,17,99) [--max-new-tokens 64]
//       [--greedy | --temperature 0.8 --top-k 20 --top-p 0.95] [--seed 0] [--print-ids]
//       [--logits-out FILE] [--vocab-file V --merge-file M]   (GPT2BPETokenizer models)
//       [--model-config config.json]   (a checkpoint that records no model: PyTorch's dcp.save)
//
// DIR is what mfsdp::load_model (include/mfsdp/generate.h) reads: a checkpoint (`--save` of
// mfsdp-pretrain, -sft or -grpo at any world size, `mfsdp-ckpt import-hf`; a save folder or an
// iter_NNNNNNN folder) or a Hugging Face Llama or Qwen2 folder (`--export-hf`, `mfsdp-ckpt
// export-hf`, transformers' save_pretrained). Text in and out needs the model's tokenizer to be
// ByteLevelTokenizer or GPT2BPETokenizer (a checkpoint records it; an HF folder does not, so use
// --prompt-ids there); any model works with token ids. --logits-out writes the fp32 logits of
// one forward over the prompt ([1, T, vocab], tensor "logits", safetensors) so they can be
// compared with another implementation's (tests/reference/).
#include <torch/torch.h>

#include <filesystem>
#include <iostream>
#include <sstream>

#include "mfsdp/comm.h"
#include "mfsdp/generate.h"
#include "mfsdp/safetensors.h"
#include "mfsdp/tokenizer.h"

namespace {

[[noreturn]] void usage_error(const std::string& what) {
  throw std::invalid_argument(what + " (mfsdp-generate --help)");
}

std::vector<int64_t> parse_ids(const std::string& text) {
  std::vector<int64_t> ids;
  std::stringstream s(text);
  std::string item;
  while (std::getline(s, item, ',')) {
    try {
      size_t used = 0;
      ids.push_back(std::stoll(item, &used));
      if (used != item.size()) throw std::invalid_argument(item);
    } catch (const std::exception&) {
      usage_error("--prompt-ids: '" + item + "' is not a token id");
    }
  }
  return ids;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_dir, model_config, prompt, prompt_ids, vocab_file, merge_file, logits_out, device_choice = "auto";
  bool print_ids = false;
  mfsdp::GenerateOptions g;
  try {
    for (int i = 1; i < argc; ++i) {
      std::string flag = argv[i];
      auto value = [&]() -> std::string {
        if (i + 1 >= argc) usage_error(flag + " needs a value");
        return argv[++i];
      };
      auto number = [&](const std::string& v) {
        try {
          return std::stod(v);
        } catch (const std::exception&) {
          usage_error(flag + ": '" + v + "' is not a number");
        }
      };
      if (flag == "--help" || flag == "-h") {
        std::cout
            << "usage: mfsdp-generate --model DIR (--prompt TEXT | --prompt-ids 1,2,3) [--max-new-tokens N]\n"
               "           [--greedy] [--temperature T] [--top-k K] [--top-p P] [--seed S] [--print-ids]\n"
               "           [--logits-out FILE] [--vocab-file V --merge-file M] [--device auto|cpu|cuda]\n"
               "  --model DIR        a checkpoint (--save of mfsdp-pretrain, -sft, -grpo; mfsdp-ckpt import-hf:\n"
               "                     the save folder, read at its latest iteration, or an iter_NNNNNNN folder) or\n"
               "                     a Hugging Face Llama or Qwen2 folder (--export-hf, mfsdp-ckpt export-hf:\n"
               "                     config.json + model.safetensors or model.safetensors.index.json)\n"
               "  --model-config F   the model as a Hugging Face config.json, for a checkpoint that records none\n"
               "                     (a PyTorch dcp.save folder)\n"
               "  --device D         where the model runs: auto (the GPU when there is one), cpu or cuda\n"
               "  --print-ids        print the generated token ids (comma-separated) instead of text\n"
               "  --logits-out FILE  also write the fp32 logits of one forward over the prompt, shape\n"
               "                     [1, prompt tokens, vocab], as tensor \"logits\" of a safetensors file\n";
        return 0;
      } else if (flag == "--model") model_dir = value();
      else if (flag == "--model-config") model_config = value();
      else if (flag == "--prompt") prompt = value();
      else if (flag == "--prompt-ids") prompt_ids = value();
      else if (flag == "--max-new-tokens") g.max_new_tokens = static_cast<int64_t>(number(value()));
      else if (flag == "--greedy") g.greedy = true;
      else if (flag == "--temperature") g.temperature = number(value());
      else if (flag == "--top-k") g.top_k = static_cast<int64_t>(number(value()));
      else if (flag == "--top-p") g.top_p = number(value());
      else if (flag == "--seed") g.seed = static_cast<uint64_t>(number(value()));
      else if (flag == "--print-ids") print_ids = true;
      else if (flag == "--vocab-file") vocab_file = value();
      else if (flag == "--merge-file") merge_file = value();
      else if (flag == "--logits-out") logits_out = value();
      else if (flag == "--device") device_choice = value();
      else usage_error("unknown flag " + flag);
    }
    if (model_dir.empty()) usage_error("--model is required");
    if (!model_config.empty() && !std::filesystem::is_regular_file(model_config))
      usage_error("--model-config: '" + model_config + "' is not a file");
    if (prompt.empty() == prompt_ids.empty()) usage_error("give exactly one of --prompt and --prompt-ids");
  } catch (const std::exception& e) {
    std::cerr << "mfsdp-generate: error: " << e.what() << std::endl;
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
    const int64_t vocab = loaded.model->config().vocab_size;
    for (int64_t id : input)
      if (id < 0 || id >= vocab)
        throw std::invalid_argument("prompt token id " + std::to_string(id) + " is outside the model's vocabulary [0, " +
                                    std::to_string(vocab) + ")");
    if (tokenizer) g.stop_id = tokenizer->eod();
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
