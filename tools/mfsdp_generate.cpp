// mfsdp-generate: continue a prompt with a model trained by mfsdp-pretrain.
//
//   mfsdp-generate --model DIR (--prompt TEXT | --prompt-ids 5,17,99) [--max-new-tokens 64]
//       [--greedy | --temperature 0.8 --top-k 20 --top-p 0.95] [--seed 0] [--print-ids]
//       [--vocab-file V --merge-file M]   (GPT2BPETokenizer models)
//
// DIR is what `mfsdp-pretrain --save-final-model DIR` wrote. Text in and out needs the model's
// tokenizer to be ByteLevelTokenizer or GPT2BPETokenizer; any model works with token ids.
#include <torch/torch.h>

#include <iostream>
#include <sstream>

#include "mfsdp/generate.h"
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
  std::string model_dir, prompt, prompt_ids, vocab_file, merge_file;
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
        std::cout << "usage: mfsdp-generate --model DIR (--prompt TEXT | --prompt-ids 1,2,3) "
                     "[--max-new-tokens N] [--greedy] [--temperature T] [--top-k K] [--top-p P] "
                     "[--seed S] [--print-ids] [--vocab-file V --merge-file M]\n";
        return 0;
      } else if (flag == "--model") model_dir = value();
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
      else usage_error("unknown flag " + flag);
    }
    if (model_dir.empty()) usage_error("--model is required");
    if (prompt.empty() == prompt_ids.empty()) usage_error("give exactly one of --prompt and --prompt-ids");
  } catch (const std::exception& e) {
    std::cerr << "mfsdp-generate: error: " << e.what() << std::endl;
    return 2;
  }
  try {
    torch::set_num_threads(1);
    mfsdp::LoadedModel loaded = mfsdp::load_final_model(model_dir);
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
    if (tokenizer) g.stop_id = tokenizer->eod();
    std::vector<int64_t> out = mfsdp::generate(*loaded.model, input, g);
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
