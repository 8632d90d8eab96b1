// Chat formatting for post-training: conversations (role/content messages) to token ids, with the
// mask of the tokens a supervised fine-tuning loss trains on. Built-in templates, no template
// engine (docs/data.md "Chat templates"):
//   chatml    "<|im_start|>{role}\n{content}<|im_end|>\n" per message (Qwen2's format).
//   llama3    Meta-Llama-3-Instruct's: <|begin_of_text|>, then per message
//             "<|start_header_id|>{role}<|end_header_id|>\n\n{content, trimmed}<|eot_id|>".
//   llama3.1  Llama-3.1-Instruct's (no tools): llama3 after a system turn holding "Cutting
//             Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n" and the system message.
//   qwen3     Qwen3's: chatml with its <think> handling, enable_thinking left at its default.
//   plain     "System: {content}\n", "User: {content}\n", "Assistant: {content}<EOD>"; any tokenizer.
// The first four need their special tokens in the tokenizer. Torch-free (library mfsdp_data).
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
  // 1 on the tokens of each assistant message's content (as rendered: qwen3's think block
  // included) and its end-of-turn token; 0 elsewhere (role headers, system and user turns, the
  // generation prompt). Same length as ids.
  std::vector<uint8_t> loss_mask;
};

// Renders `messages` with the template `name` (one of chat_template_names()), special tokens by
// id. add_generation_prompt appends the header of an assistant turn, for generation. Throws
// std::invalid_argument naming the template, the message index and what is wrong (unknown
// template or role, a tokenizer without the template's special tokens).
ChatTokens apply_chat_template(const Tokenizer& tokenizer, const std::string& name,
                               const std::vector<ChatMessage>& messages, bool add_generation_prompt);

// The id that ends an assistant turn (generation stops there): <|im_end|> for chatml and qwen3,
// <|eot_id|> for llama3 and llama3.1, the tokenizer's EOD for plain.
int64_t chat_end_of_turn_id(const Tokenizer& tokenizer, const std::string& name);

// The built-in template names, for flag validation and --help.
const std::vector<std::string>& chat_template_names();

// --chat-template auto: the template the tokenizer's special tokens call for (<|start_header_id|>:
// llama3.1 with <|eom_id|>, else llama3; <|im_start|>: qwen3 with <think>, else chatml; else
// plain). `why`, when given, receives the reason in words, for the start-up log.
std::string detect_chat_template(const Tokenizer& tokenizer, std::string* why = nullptr);

}  // namespace mfsdp
