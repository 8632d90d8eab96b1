// Options of the Hugging Face tokenizer.json loader (HuggingFaceTokenizer, docs/data.md). Kept out
// of tokenizer.h so that adding an option does not rebuild everything that tokenizes.
#pragma once

#include <memory>
#include <string>

#include "mfsdp/data/tokenizer.h"

namespace mfsdp {

struct HfTokenizerOptions {
  // Apply the file's post_processor to every encode(): TemplateProcessing (Llama-3's
  // <|begin_of_text|>, Llama-2's <s>), RobertaProcessing / BertProcessing (cls ... sep), as
  // transformers' tokenizer(text) and tokenizer.encode(text) do by default
  // (add_special_tokens=True). Off (load_hf_tokenizer(path)): add_special_tokens=False, what
  // pretraining documents and the chat templates want.
  bool add_special_tokens = false;
};

// load_hf_tokenizer (tokenizer.h) with options.
std::unique_ptr<Tokenizer> load_hf_tokenizer(const std::string& path, const HfTokenizerOptions& options);

}  // namespace mfsdp
