// Built-in chat templates (include/mfsdp/data/posttrain/chat_template.h, docs/data.md "Chat templates").
//
// A conversation is rendered as a list of segments, each either text or a special token (inserted
// by its id from Tokenizer::special_token_id, so the template does not depend on how a tokenizer
// would encode the marker's spelling). Consecutive text with the same mask value is encoded as
// one string, so a token boundary is forced only where the mask changes (an assistant turn's
// header | its content) and at special tokens, where the tokenizer splits anyway: the loss mask
// is exact. For the templates whose headers end in "\n" the ids equal encoding the whole
// rendered string (what transformers' apply_chat_template does) with Llama-3 and Qwen2 style
// pre-tokenizers, unless a reply starts with whitespace the pre-tokenizer would join to that
// "\n" (llama3 trims replies, so it never does). plain's "Assistant: " keeps its space apart
// from the reply; plain follows no published template. tests/unit/chat_template_test.cpp checks
// llama3, llama3.1 and qwen3 against transformers running the published Jinja templates
// (tests/reference/chat_templates/).
#include "mfsdp/data/posttrain/chat_template.h"

#include <stdexcept>

namespace mfsdp {
namespace {

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

// The special tokens each template inserts, and the tokenizers that have them.
struct Family {
  const char* name;
  std::vector<const char*> tokens;
  const char* example;
};
const std::vector<Family>& families() {
  static const std::vector<Family> f = {
      {"chatml", {"<|im_start|>", "<|im_end|>"}, "a Qwen2 tokenizer.json"},
      {"llama3", {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"},
       "a Llama-3 tokenizer.json"},
      {"llama3.1", {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"},
       "a Llama-3.1 tokenizer.json"},
      {"qwen3", {"<|im_start|>", "<|im_end|>", "<think>", "</think>"}, "a Qwen3 tokenizer.json"},
      {"plain", {}, ""},
  };
  return f;
}

const Family& family(const std::string& name) {
  for (const Family& f : families())
    if (name == f.name) return f;
  throw std::invalid_argument("chat template: unknown template \"" + name +
                              "\" (built in: chatml, llama3, llama3.1, qwen3, plain)");
}

int64_t require_special(const Tokenizer& tokenizer, const std::string& name, const char* token) {
  const std::optional<int64_t> id = tokenizer.special_token_id(token);
  if (!id) {
    const Family& f = family(name);
    std::string all;
    for (const char* t : f.tokens) all += std::string(all.empty() ? "" : ", ") + t;
    throw std::invalid_argument("chat template " + name + ": tokenizer " + tokenizer.name() +
                                " has no special token " + token + " (" + name + " needs " + all +
                                ", e.g. " + f.example + "; use --chat-template plain otherwise)");
  }
  return *id;
}

// Python's str.isspace() code points (what Jinja's `trim` filter, str.strip(), removes).
bool py_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

// The code point starting at s[i] and its length in bytes (malformed UTF-8: the byte itself, which
// is never a space).
std::pair<uint32_t, size_t> code_point_at(const std::string& s, size_t i) {
  const auto b = static_cast<unsigned char>(s[i]);
  const size_t n = b < 0x80 ? 1 : (b >> 5) == 0x6 ? 2 : (b >> 4) == 0xE ? 3 : (b >> 3) == 0x1E ? 4 : 0;
  if (n == 0 || i + n > s.size()) return {0xFFFFFFFF, 1};
  uint32_t c = n == 1 ? b : b & (0x7F >> n);
  for (size_t k = 1; k < n; ++k) c = (c << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  return {c, n};
}

// Jinja's `trim`: Python's str.strip() with no argument.
std::string trim(const std::string& s) {
  size_t first = 0;
  while (first < s.size()) {
    const auto [c, n] = code_point_at(s, first);
    if (!py_space(c)) break;
    first += n;
  }
  size_t last = first;  // one past the last non-space code point
  for (size_t i = first; i < s.size();) {
    const auto [c, n] = code_point_at(s, i);
    i += n;
    if (!py_space(c)) last = i;
  }
  return s.substr(first, last - first);
}

// Python's lstrip('\n') / rstrip('\n').
std::string lstrip_newlines(const std::string& s) {
  const size_t first = s.find_first_not_of('\n');
  return first == std::string::npos ? "" : s.substr(first);
}
std::string rstrip_newlines(const std::string& s) {
  const size_t last = s.find_last_not_of('\n');
  return last == std::string::npos ? "" : s.substr(0, last + 1);
}

bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }
bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Appends segments to a ChatTokens with their mask value; consecutive text of one mask value is
// encoded as one string (see the top of the file).
struct Builder {
  explicit Builder(const Tokenizer& t) : tokenizer(t) {}
  const Tokenizer& tokenizer;
  ChatTokens out;
  std::string pending;
  uint8_t pending_mask = 0;

  void text(const std::string& s, uint8_t mask) {
    if (s.empty()) return;
    if (mask != pending_mask) flush();
    pending += s;
    pending_mask = mask;
  }
  void token(int64_t id, uint8_t mask) {
    flush();
    out.ids.push_back(id);
    out.loss_mask.push_back(mask);
  }
  void flush() {
    if (pending.empty()) return;
    const std::vector<int64_t> ids = tokenizer.encode(pending);
    out.ids.insert(out.ids.end(), ids.begin(), ids.end());
    out.loss_mask.insert(out.loss_mask.end(), ids.size(), pending_mask);
    pending.clear();
  }
  ChatTokens finish() {
    flush();
    return std::move(out);
  }
};

void render_chatml(Builder& b, const Tokenizer& t, const std::string& name,
                   const std::vector<ChatMessage>& messages, bool add_generation_prompt) {
  const int64_t im_start = require_special(t, name, "<|im_start|>");
  const int64_t im_end = require_special(t, name, "<|im_end|>");
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
}

// Meta-Llama-3-Instruct's template ("llama3"), and Llama-3.1-Instruct's without tools
// ("llama3.1"): the latter always opens with a system turn carrying the knowledge cut-off and its
// default date, then the first message's content when that is a system message.
void render_llama3(Builder& b, const Tokenizer& t, const std::string& name,
                   const std::vector<ChatMessage>& messages, bool add_generation_prompt) {
  const int64_t bos = require_special(t, name, "<|begin_of_text|>");
  const int64_t start_header = require_special(t, name, "<|start_header_id|>");
  const int64_t end_header = require_special(t, name, "<|end_header_id|>");
  const int64_t eot = require_special(t, name, "<|eot_id|>");
  for (size_t k = 0; k < messages.size(); ++k) parse_role(name, messages, k);
  size_t first = 0;
  if (name == "llama3.1") {
    b.token(bos, 0);
    std::string system;
    if (!messages.empty() && messages[0].role == "system") {
      system = trim(messages[0].content);
      first = 1;
    }
    b.token(start_header, 0);
    b.text("system", 0);
    b.token(end_header, 0);
    b.text("\n\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n" + system, 0);
    b.token(eot, 0);
  } else if (!messages.empty()) {
    b.token(bos, 0);  // llama3 puts bos_token before the first message only
  }
  // <|start_header_id|>{role}<|end_header_id|>\n\n{content | trim}<|eot_id|>
  for (size_t k = first; k < messages.size(); ++k) {
    const uint8_t train = messages[k].role == "assistant" ? 1 : 0;
    b.token(start_header, 0);
    b.text(messages[k].role, 0);
    b.token(end_header, 0);
    b.text("\n\n", 0);
    b.text(trim(messages[k].content), train);
    b.token(eot, train);
  }
  if (add_generation_prompt) {
    b.token(start_header, 0);
    b.text("assistant", 0);
    b.token(end_header, 0);
    b.text("\n\n", 0);
  }
}

// Qwen3's template without tools, with enable_thinking left undefined (transformers' default:
// thinking on). The last assistant turn, and the others after the last user query that carry
// reasoning, render a think block (empty when the content has no "</think>"); the other turns
// drop their reasoning. The mask covers everything after an assistant turn's
// "<|im_start|>assistant\n", think block included (the model writes it after the generation
// prompt), through <|im_end|>.
void render_qwen3(Builder& b, const Tokenizer& t, const std::string& name,
                  const std::vector<ChatMessage>& messages, bool add_generation_prompt) {
  const int64_t im_start = require_special(t, name, "<|im_start|>");
  const int64_t im_end = require_special(t, name, "<|im_end|>");
  require_special(t, name, "<think>");
  require_special(t, name, "</think>");
  for (size_t k = 0; k < messages.size(); ++k) parse_role(name, messages, k);
  // The last user message that is not a tool response: the query the final answer belongs to.
  const size_t n = messages.size();
  size_t last_query = n == 0 ? 0 : n - 1;
  for (size_t k = n; k-- > 0;) {
    const std::string& c = messages[k].content;
    const bool tool_response = starts_with(c, "<tool_response>") && ends_with(c, "</tool_response>");
    if (messages[k].role == "user" && !tool_response) {
      last_query = k;
      break;
    }
  }
  for (size_t k = 0; k < n; ++k) {
    const ChatMessage& m = messages[k];
    if (m.role != "assistant") {
      // The template emits a leading system message before this loop and skips it in the loop;
      // any other system message is rendered like a user message, in the same form.
      b.token(im_start, 0);
      b.text(m.role + "\n" + m.content, 0);
      b.token(im_end, 0);
      b.text("\n", 0);
      continue;
    }
    std::string content = m.content, reasoning;
    const size_t close = content.find("</think>");
    if (close != std::string::npos) {
      // content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n')
      std::string before = rstrip_newlines(content.substr(0, close));
      const size_t open = before.rfind("<think>");
      if (open != std::string::npos) before = before.substr(open + 7);
      reasoning = lstrip_newlines(before);
      // content.split('</think>')[-1].lstrip('\n')
      content = lstrip_newlines(content.substr(content.rfind("</think>") + 8));
    }
    b.token(im_start, 0);
    b.text("assistant\n", 0);
    if (k > last_query && (k + 1 == n || !reasoning.empty())) {
      // '<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n')
      const std::string think = "<think>\n" + rstrip_newlines(lstrip_newlines(reasoning)) + "\n</think>\n\n";
      b.text(think + lstrip_newlines(content), 1);
    } else {
      b.text(content, 1);
    }
    b.token(im_end, 1);
    b.text("\n", 0);
  }
  if (add_generation_prompt) {
    b.token(im_start, 0);
    b.text("assistant\n", 0);
  }
}

void render_plain(Builder& b, const Tokenizer& t, const std::string& name,
                  const std::vector<ChatMessage>& messages, bool add_generation_prompt) {
  // System: {content}\n  User: {content}\n  Assistant: {content}<EOD>
  for (size_t k = 0; k < messages.size(); ++k) {
    const Role role = parse_role(name, messages, k);
    if (role == Role::kAssistant) {
      b.text("Assistant: ", 0);
      b.text(messages[k].content, 1);
      b.token(t.eod(), 1);
    } else {
      b.text(role == Role::kSystem ? "System: " : "User: ", 0);
      b.text(messages[k].content, 0);
      b.text("\n", 0);
    }
  }
  if (add_generation_prompt) b.text("Assistant: ", 0);
}

}  // namespace

ChatTokens apply_chat_template(const Tokenizer& tokenizer, const std::string& name,
                               const std::vector<ChatMessage>& messages,
                               bool add_generation_prompt) {
  family(name);
  Builder b(tokenizer);
  if (name == "chatml") {
    render_chatml(b, tokenizer, name, messages, add_generation_prompt);
  } else if (name == "llama3" || name == "llama3.1") {
    render_llama3(b, tokenizer, name, messages, add_generation_prompt);
  } else if (name == "qwen3") {
    render_qwen3(b, tokenizer, name, messages, add_generation_prompt);
  } else {
    render_plain(b, tokenizer, name, messages, add_generation_prompt);
  }
  return b.finish();
}

int64_t chat_end_of_turn_id(const Tokenizer& tokenizer, const std::string& name) {
  family(name);
  if (name == "chatml" || name == "qwen3") return require_special(tokenizer, name, "<|im_end|>");
  if (name == "llama3" || name == "llama3.1") return require_special(tokenizer, name, "<|eot_id|>");
  return tokenizer.eod();
}

const std::vector<std::string>& chat_template_names() {
  static const std::vector<std::string> names{"chatml", "llama3", "llama3.1", "qwen3", "plain"};
  return names;
}

std::string detect_chat_template(const Tokenizer& tokenizer, std::string* why) {
  auto has = [&](const char* token) { return tokenizer.special_token_id(token).has_value(); };
  std::string name, reason;
  if (has("<|start_header_id|>")) {
    // <|eom_id|> came with Llama-3.1's tool calling; Llama-3's tokenizer has a reserved token there.
    name = has("<|eom_id|>") ? "llama3.1" : "llama3";
    reason = has("<|eom_id|>") ? "the tokenizer has <|start_header_id|> and <|eom_id|>"
                               : "the tokenizer has <|start_header_id|> and no <|eom_id|>";
  } else if (has("<|im_start|>") && has("<think>")) {
    name = "qwen3";
    reason = "the tokenizer has <|im_start|> and <think>";
  } else if (has("<|im_start|>")) {
    name = "chatml";
    reason = "the tokenizer has <|im_start|> and no <think>";
  } else {
    name = "plain";
    reason = "the tokenizer has neither <|start_header_id|> nor <|im_start|>";
  }
  if (why) *why = reason;
  return name;
}

}  // namespace mfsdp
