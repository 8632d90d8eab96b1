// Built-in chat templates (include/mfsdp/data/chat_template.h, docs/data.md "Chat templates").
//
// A conversation is rendered as a list of segments, each either text (encoded on its own) or a
// special token (inserted by its id from Tokenizer::special_token_id, so the template does not
// depend on how a tokenizer would encode the marker's spelling). Encoding the segments separately
// puts a token boundary at every segment edge, which makes the loss mask exact: an assistant
// message's content is a segment of its own. For the usual text (content starting with a letter,
// digit or space after the header's "\n") this equals encoding the whole rendered string, which
// tests/unit/hf_tokenizer_test.cpp checks against transformers' apply_chat_template.
#include "mfsdp/data/chat_template.h"

#include <stdexcept>

namespace mfsdp {
namespace {

const char kImStart[] = "<|im_start|>";
const char kImEnd[] = "<|im_end|>";

enum class Role { kSystem, kUser, kAssistant };

Role parse_role(const std::string& name, const std::vector<ChatMessage>& messages, size_t k) {
  const std::string& role = messages[k].role;
  if (role == "system") return Role::kSystem;
  if (role == "user") return Role::kUser;
  if (role == "assistant") return Role::kAssistant;
  throw std::invalid_argument("chat template " + name + ": message " + std::to_string(k) +
                              " has unknown role \"" + role +
                              "\" (known: system, user, assistant)");
}

int64_t require_special(const Tokenizer& tokenizer, const std::string& name, const char* token) {
  const std::optional<int64_t> id = tokenizer.special_token_id(token);
  if (!id) {
    throw std::invalid_argument("chat template " + name + ": tokenizer " + tokenizer.name() +
                                " has no special token " + token +
                                " (chatml needs <|im_start|> and <|im_end|>, e.g. a Qwen2 "
                                "tokenizer.json; use --chat-template plain otherwise)");
  }
  return *id;
}

void check_name(const std::string& name) {
  if (name == "chatml" || name == "plain") return;
  throw std::invalid_argument("chat template: unknown template \"" + name +
                              "\" (built in: chatml, plain)");
}

// Appends segments to a ChatTokens with their mask value.
struct Builder {
  const Tokenizer& tokenizer;
  ChatTokens out;
  void text(const std::string& s, uint8_t mask) {
    if (s.empty()) return;
    const std::vector<int64_t> ids = tokenizer.encode(s);
    out.ids.insert(out.ids.end(), ids.begin(), ids.end());
    out.loss_mask.insert(out.loss_mask.end(), ids.size(), mask);
  }
  void token(int64_t id, uint8_t mask) {
    out.ids.push_back(id);
    out.loss_mask.push_back(mask);
  }
};

}  // namespace

ChatTokens apply_chat_template(const Tokenizer& tokenizer, const std::string& name,
                               const std::vector<ChatMessage>& messages,
                               bool add_generation_prompt) {
  check_name(name);
  Builder b{tokenizer, {}};
  if (name == "chatml") {
    const int64_t im_start = require_special(tokenizer, name, kImStart);
    const int64_t im_end = require_special(tokenizer, name, kImEnd);
    // <|im_start|>{role}\n{content}<|im_end|>\n
    for (size_t k = 0; k < messages.size(); ++k) {
      const uint8_t train = parse_role(name, messages, k) == Role::kAssistant ? 1 : 0;
      b.token(im_start, 0);
      b.text(messages[k].role + "\n", 0);
      b.text(messages[k].content, train);
      b.token(im_end, train);  // the model learns to end its turn ...
      b.text("\n", 0);         // ... the newline after it belongs to the template
    }
    if (add_generation_prompt) {
      b.token(im_start, 0);
      b.text("assistant\n", 0);
    }
  } else {
    // System: {content}\n  User: {content}\n  Assistant: {content}<EOD>
    for (size_t k = 0; k < messages.size(); ++k) {
      const Role role = parse_role(name, messages, k);
      if (role == Role::kAssistant) {
        b.text("Assistant: ", 0);
        b.text(messages[k].content, 1);
        b.token(tokenizer.eod(), 1);
      } else {
        b.text(role == Role::kSystem ? "System: " : "User: ", 0);
        b.text(messages[k].content, 0);
        b.text("\n", 0);
      }
    }
    if (add_generation_prompt) b.text("Assistant: ", 0);
  }
  return std::move(b.out);
}

int64_t chat_end_of_turn_id(const Tokenizer& tokenizer, const std::string& name) {
  check_name(name);
  if (name == "chatml") return require_special(tokenizer, name, kImEnd);
  return tokenizer.eod();
}

const std::vector<std::string>& chat_template_names() {
  static const std::vector<std::string> names{"chatml", "plain"};
  return names;
}

}  // namespace mfsdp
