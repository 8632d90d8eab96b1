// Chat formatting for post-training: conversations (role/content messages) to token ids, with the
// mask of the tokens a supervised fine-tuning loss trains on. Built-in templates, no template
// engine (docs/post_training.md):
//   chatml  "<|im_start|>{role}\n{content}<|im_end|>\n" per message (Qwen2's format); the
//           tokenizer must have the special tokens <|im_start|> and <|im_end|>.
//   plain   "System: {content}\n", "User: {content}\n", "Assistant: {content}<EOD>"; any tokenizer.
// Torch-free (library mfsdp_data).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mfsdp/data/tokenizer.h"

namespace mfsdp {

struct ChatMessage {
  std::string role;  // "system", "user" or "assistant"
  std::string content;
};

struct ChatTokens {
  std::vector<int64_t> ids;
  // 1 on the tokens of each assistant message's content and its end-of-turn token; 0 elsewhere
  // (role headers, system and user turns, the generation prompt). Same length as ids.
  std::vector<uint8_t> loss_mask;
};

// Renders `messages` with the template `name` ("chatml" or "plain"), each segment encoded on its
// own and special tokens by id. add_generation_prompt appends the header of an assistant turn
// ("<|im_start|>assistant\n" / "Assistant: "), for generation. Throws std::invalid_argument naming
// the template, the message index and what is wrong (unknown template or role, a tokenizer
// without the template's special tokens).
ChatTokens apply_chat_template(const Tokenizer& tokenizer, const std::string& name,
                               const std::vector<ChatMessage>& messages, bool add_generation_prompt);

// The id that ends an assistant turn (generation stops there): <|im_end|> for chatml, the
// tokenizer's EOD for plain.
int64_t chat_end_of_turn_id(const Tokenizer& tokenizer, const std::string& name);

// The built-in template names, for flag validation and --help.
const std::vector<std::string>& chat_template_names();

}  // namespace mfsdp
