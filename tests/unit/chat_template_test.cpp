// Built-in chat templates. First on tokenizers whose ids are the bytes of the text, so every
// expected id sequence and loss mask is written out by hand from the template's definition
// (include/mfsdp/data/posttrain/chat_template.h): ByteLevelTokenizer for "plain", and for the others a
// tokenizer.json whose vocabulary is the 256 byte symbols (id = byte, no merges) plus the added
// tokens a test names. (hf_tokenizer_test compares chatml with transformers' apply_chat_template
// on trained BPEs.) Then llama3, llama3.1 and qwen3 token for token against transformers'
// apply_chat_template running the published Jinja templates (tests/reference/chat_templates/) on
// BPE tokenizers trained at test time by tests/reference/chat_template_reference.py, ids and
// assistant mask, and proof that one changed token is caught.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "harness/expect_error.h"
#include "harness/run_command.h"
#include "harness/temp_dir.h"
#include "mfsdp/data/posttrain/chat_template.h"
#include "mfsdp/data/tokenizer.h"

namespace mfsdp {
namespace {

using Ids = std::vector<int64_t>;
using Mask = std::vector<uint8_t>;
using mfsdp::testing::error_of;
using mfsdp::testing::expect_contains;
using mfsdp::testing::TempDir;

constexpr int64_t kImStart = 256, kImEnd = 257, kEndOfText = 258;

// Expected output, built segment by segment from literal strings (one id per byte).
struct Expected {
  Ids ids;
  Mask mask;
  void text(const std::string& s, uint8_t m) {
    for (unsigned char c : s) {
      ids.push_back(c);
      mask.push_back(m);
    }
  }
  void token(int64_t id, uint8_t m) {
    ids.push_back(id);
    mask.push_back(m);
  }
};

std::string utf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s.push_back(static_cast<char>(cp));
  } else {  // bytes_to_unicode symbols are below U+0800
    s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
  return s;
}

// A byte-level tokenizer.json without merges: each byte is its own token, id = byte value, and
// `tokens` added with ids 256, 257, ... in order.
std::unique_ptr<Tokenizer> bytes_with_tokens(const TempDir& dir, const std::vector<std::string>& tokens) {
  std::string vocab = "{";
  for (int b = 0; b < 256; ++b) {
    std::string symbol = utf8(gpt2_byte_to_unicode(static_cast<uint8_t>(b)));
    if (symbol == "\"" || symbol == "\\") symbol = "\\" + symbol;
    vocab += (b ? ", \"" : "\"") + symbol + "\": " + std::to_string(b);
  }
  vocab += "}";
  std::string added;
  for (size_t k = 0; k < tokens.size(); ++k)
    added += std::string(k ? ", " : "") + "{\"id\": " + std::to_string(256 + k) + ", \"content\": \"" +
             tokens[k] +
             "\", \"single_word\": false, \"lstrip\": false, \"rstrip\": false, "
             "\"normalized\": false, \"special\": true}";
  std::ofstream(dir.file("tokenizer.json"))
      << "{\"added_tokens\": [" << added << "], "
      << "\"normalizer\": null, "
      << "\"pre_tokenizer\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false}, "
      << "\"decoder\": {\"type\": \"ByteLevel\"}, "
      << "\"model\": {\"type\": \"BPE\", \"vocab\": " << vocab << ", \"merges\": []}}";
  return load_hf_tokenizer(dir.file("tokenizer.json"));
}

// <|im_start|> = 256, <|im_end|> = 257, <|endoftext|> = 258.
std::unique_ptr<Tokenizer> bytes_with_chatml_tokens(const TempDir& dir) {
  return bytes_with_tokens(dir, {"<|im_start|>", "<|im_end|>", "<|endoftext|>"});
}

const std::vector<ChatMessage> kConversation = {
    {"system", "Be brief."},
    {"user", "Hi?"},
    {"assistant", "Hello!"},
    {"user", "2+2"},
    {"assistant", "4"},
};

TEST(ChatTemplate, ChatmlIdsAndMask) {
  TempDir dir;
  auto t = bytes_with_chatml_tokens(dir);
  ASSERT_EQ(t->encode("ab"), (Ids{'a', 'b'}));  // the premise: one id per byte
  for (bool gen : {false, true}) {
    Expected e;
    for (const ChatMessage& m : kConversation) {
      const uint8_t a = m.role == "assistant";
      e.token(kImStart, 0);
      e.text(m.role + "\n", 0);
      e.text(m.content, a);
      e.token(kImEnd, a);
      e.text("\n", 0);
    }
    if (gen) {
      e.token(kImStart, 0);
      e.text("assistant\n", 0);
    }
    const ChatTokens r = apply_chat_template(*t, "chatml", kConversation, gen);
    EXPECT_EQ(r.ids, e.ids) << gen;
    EXPECT_EQ(r.loss_mask, e.mask) << gen;
    // The masked tokens are exactly the assistant replies and their end tokens.
    Ids masked;
    for (size_t k = 0; k < r.ids.size(); ++k)
      if (r.loss_mask[k]) masked.push_back(r.ids[k]);
    EXPECT_EQ(t->decode(masked), "Hello!<|im_end|>4<|im_end|>");
  }
  EXPECT_EQ(chat_end_of_turn_id(*t, "chatml"), kImEnd);
  EXPECT_EQ(chat_end_of_turn_id(*t, "plain"), kEndOfText);
}

TEST(ChatTemplate, PlainIdsAndMask) {
  ByteLevelTokenizer t;
  const int64_t eod = ByteLevelTokenizer::kEod;
  for (bool gen : {false, true}) {
    Expected e;
    e.text("System: Be brief.\n", 0);
    e.text("User: Hi?\n", 0);
    e.text("Assistant: ", 0);
    e.text("Hello!", 1);
    e.token(eod, 1);
    e.text("User: 2+2\n", 0);
    e.text("Assistant: ", 0);
    e.text("4", 1);
    e.token(eod, 1);
    if (gen) e.text("Assistant: ", 0);
    const ChatTokens r = apply_chat_template(t, "plain", kConversation, gen);
    EXPECT_EQ(r.ids, e.ids) << gen;
    EXPECT_EQ(r.loss_mask, e.mask) << gen;
  }
  EXPECT_EQ(chat_end_of_turn_id(t, "plain"), eod);
}

TEST(ChatTemplate, EmptyAssistantReplyTrainsOnlyTheEndToken) {
  ByteLevelTokenizer t;
  const ChatTokens r = apply_chat_template(t, "plain", {{"user", "x"}, {"assistant", ""}}, false);
  Expected e;
  e.text("User: x\n", 0);
  e.text("Assistant: ", 0);
  e.token(ByteLevelTokenizer::kEod, 1);
  EXPECT_EQ(r.ids, e.ids);
  EXPECT_EQ(r.loss_mask, e.mask);
  EXPECT_TRUE(apply_chat_template(t, "plain", {}, false).ids.empty());
}

TEST(ChatTemplate, ErrorsNameTemplateMessageAndToken) {
  ByteLevelTokenizer t;
  expect_contains(error_of([&] { apply_chat_template(t, "jinja", kConversation, false); }),
                  {"jinja", "chatml", "plain"});
  expect_contains(error_of([&] { chat_end_of_turn_id(t, "jinja"); }), {"jinja"});
  expect_contains(error_of([&] {
                    apply_chat_template(t, "plain", {{"user", "a"}, {"tool", "b"}}, false);
                  }),
                  {"plain", "message 1", "tool"});
  expect_contains(error_of([&] { apply_chat_template(t, "chatml", kConversation, false); }),
                  {"chatml", "ByteLevelTokenizer", "<|im_start|>"});
  expect_contains(error_of([&] { chat_end_of_turn_id(t, "chatml"); }),
                  {"ByteLevelTokenizer", "<|im_end|>"});
  EXPECT_EQ(chat_template_names(),
            (std::vector<std::string>{"chatml", "llama3", "llama3.1", "qwen3", "plain"}));
}

// The families' templates on byte ids, written out by hand: where the mask starts and ends,
// trimming (llama3), the knowledge-date system turn (llama3.1), the think block of the turns
// after the last user message and the dropped reasoning of earlier ones (qwen3).
TEST(ChatTemplate, FamiliesOnByteIds) {
  TempDir dir;
  // 256 <|begin_of_text|>, 257 <|start_header_id|>, 258 <|end_header_id|>, 259 <|eot_id|>,
  // 260 <|im_start|>, 261 <|im_end|>, 262 <think>, 263 </think>, 264 <|endoftext|>
  auto t =
      bytes_with_tokens(dir, {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                              "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|endoftext|>"});
  const std::vector<ChatMessage> chat = {{"system", " Be brief. "},
                                         {"user", "Hi?\n"},
                                         {"assistant", "<think>r</think>\nHello!"},
                                         {"user", "2+2"},
                                         {"assistant", "\n4 "}};
  {
    // The turns after the system message, as both llama templates render them.
    Expected rest;
    auto header = [](Expected& e, const std::string& role) {
      e.token(257, 0);
      e.text(role, 0);
      e.token(258, 0);
      e.text("\n\n", 0);
    };
    header(rest, "user");
    rest.text("Hi?", 0);  // trimmed
    rest.token(259, 0);
    header(rest, "assistant");
    rest.token(262, 1);  // llama3 keeps the reasoning, as text (its markers are added tokens here)
    rest.text("r", 1);
    rest.token(263, 1);
    rest.text("\nHello!", 1);
    rest.token(259, 1);
    header(rest, "user");
    rest.text("2+2", 0);
    rest.token(259, 0);
    header(rest, "assistant");
    rest.text("4", 1);
    rest.token(259, 1);
    Expected e;
    e.token(256, 0);
    header(e, "system");
    e.text("Be brief.", 0);
    e.token(259, 0);
    e.ids.insert(e.ids.end(), rest.ids.begin(), rest.ids.end());
    e.mask.insert(e.mask.end(), rest.mask.begin(), rest.mask.end());
    const ChatTokens r = apply_chat_template(*t, "llama3", chat, false);
    EXPECT_EQ(r.ids, e.ids);
    EXPECT_EQ(r.loss_mask, e.mask);
    // llama3.1: the system message goes into the knowledge-date turn, the rest as llama3.
    Expected e31;
    e31.token(256, 0);
    header(e31, "system");
    e31.text("Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nBe brief.", 0);
    e31.token(259, 0);
    e31.ids.insert(e31.ids.end(), rest.ids.begin(), rest.ids.end());
    e31.mask.insert(e31.mask.end(), rest.mask.begin(), rest.mask.end());
    const ChatTokens r31 = apply_chat_template(*t, "llama3.1", chat, false);
    EXPECT_EQ(r31.ids, e31.ids);
    EXPECT_EQ(r31.loss_mask, e31.mask);
    EXPECT_EQ(chat_end_of_turn_id(*t, "llama3"), 259);
    EXPECT_EQ(chat_end_of_turn_id(*t, "llama3.1"), 259);
  }
  {
    Expected e;
    auto turn = [&](const std::string& role, const std::string& content) {
      e.token(260, 0);
      e.text(role + "\n" + content, 0);
      e.token(261, 0);
      e.text("\n", 0);
    };
    turn("system", " Be brief. ");
    turn("user", "Hi?\n");
    e.token(260, 0);
    e.text("assistant\n", 0);
    e.text("Hello!", 1);  // before the last user message: the reasoning is dropped
    e.token(261, 1);
    e.text("\n", 0);
    turn("user", "2+2");
    e.token(260, 0);
    e.text("assistant\n", 0);
    e.token(262, 1);  // the last turn: an (empty) think block, then the content without leading \n
    e.text("\n\n", 1);
    e.token(263, 1);
    e.text("\n\n4 ", 1);
    e.token(261, 1);
    e.text("\n", 0);
    const ChatTokens r = apply_chat_template(*t, "qwen3", chat, false);
    EXPECT_EQ(r.ids, e.ids);
    EXPECT_EQ(r.loss_mask, e.mask);
    e.token(260, 0);
    e.text("assistant\n", 0);  // enable_thinking's default: no empty think block in the prompt
    const ChatTokens g = apply_chat_template(*t, "qwen3", chat, true);
    EXPECT_EQ(g.ids, e.ids);
    EXPECT_EQ(g.loss_mask, e.mask);
    EXPECT_EQ(chat_end_of_turn_id(*t, "qwen3"), 261);
  }
}

TEST(ChatTemplate, AutoChoosesByTheSpecialTokens) {
  struct Case {
    std::vector<std::string> tokens;
    std::string name;
  };
  for (const Case& c :
       {Case{{"<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
              "<|eot_id|>", "<|eom_id|>"},
             "llama3.1"},
        Case{{"<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
              "<|eot_id|>"},
             "llama3"},
        Case{{"<|im_start|>", "<|im_end|>", "<think>", "</think>"}, "qwen3"},
        Case{{"<|im_start|>", "<|im_end|>", "<|endoftext|>"}, "chatml"}, Case{{"<|endoftext|>"}, "plain"}}) {
    TempDir dir;
    auto t = bytes_with_tokens(dir, c.tokens);
    std::string why;
    EXPECT_EQ(detect_chat_template(*t, &why), c.name) << why;
    EXPECT_FALSE(why.empty());
  }
  ByteLevelTokenizer bytes;
  std::string why;
  EXPECT_EQ(detect_chat_template(bytes, &why), "plain");
  expect_contains(why, {"neither", "<|start_header_id|>", "<|im_start|>"});
}

TEST(ChatTemplate, FamiliesRefuseTokenizersWithoutTheirTokens) {
  TempDir dir;
  auto chatml_only = bytes_with_chatml_tokens(dir);
  expect_contains(error_of([&] { apply_chat_template(*chatml_only, "qwen3", kConversation, false); }),
                  {"chat template qwen3", "HuggingFaceTokenizer", "no special token <think>", "</think>"});
  expect_contains(error_of([&] { apply_chat_template(*chatml_only, "llama3", kConversation, false); }),
                  {"chat template llama3", "no special token <|begin_of_text|>", "<|eot_id|>"});
  expect_contains(error_of([&] { chat_end_of_turn_id(*chatml_only, "llama3.1"); }),
                  {"chat template llama3.1", "<|eot_id|>"});
  TempDir dir2;
  auto qwen = bytes_with_tokens(dir2, {"<|im_start|>", "<|im_end|>", "<think>", "</think>"});
  expect_contains(error_of([&] {
                    apply_chat_template(*qwen, "qwen3", {{"user", "a"}, {"tool", "b"}}, false);
                  }),
                  {"qwen3", "message 1", "\"tool\""});
}

// ---- against transformers on the published templates ---------------------------------------------

// The source tree and the reference Python: compiled in when tests/CMakeLists.txt gives them, else
// this file's own path and CMake's default MFSDP_PYTHON (<source>/.venv/bin/python).
std::string source_dir() {
#ifdef MFSDP_SOURCE_DIR
  return MFSDP_SOURCE_DIR;
#else
  const std::string file = __FILE__;
  return file.substr(0, file.rfind("/tests/unit/"));
#endif
}
std::string reference_python() {
#ifdef MFSDP_PYTHON_PATH
  return MFSDP_PYTHON_PATH;
#else
  return source_dir() + "/.venv/bin/python";
#endif
}

using nlohmann::json;

class ChatTemplateReference : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir("mfsdp-chatref");
    const std::string command = "\"" + reference_python() + "\" \"" + source_dir() +
                                "/tests/reference/chat_template_reference.py\" \"" + dir_->path().string() +
                                "\"";
    const auto outcome = mfsdp::testing::run_command(command);
    script_output_ = new std::string(outcome.output);
    if (outcome.exit_code != 0) return;
    std::ifstream in(dir_->file("reference.json"));
    std::stringstream ss;
    ss << in.rdbuf();
    reference_ = new json(json::parse(ss.str()));
  }
  static void TearDownTestSuite() {
    delete reference_;
    delete script_output_;
    delete dir_;
    reference_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(reference_, nullptr) << "chat_template_reference.py failed:\n" << *script_output_;
  }
  // The trained tokenizer of a family ("llama3", "qwen3"), loaded once.
  static const Tokenizer& tokenizer(const std::string& family) {
    static std::map<std::string, std::unique_ptr<Tokenizer>> loaded;
    auto& t = loaded[family];
    if (!t) t = load_hf_tokenizer(dir_->file(family));
    return *t;
  }
  static std::vector<ChatMessage> messages_of(const json& c) {
    std::vector<ChatMessage> out;
    for (const json& m : c["messages"])
      out.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
    return out;
  }

  static TempDir* dir_;
  static std::string* script_output_;
  static json* reference_;
};
TempDir* ChatTemplateReference::dir_ = nullptr;
std::string* ChatTemplateReference::script_output_ = nullptr;
json* ChatTemplateReference::reference_ = nullptr;

// Where two sequences first differ, in words, with the text around it; empty when equal.
template <typename T>
std::string difference(const std::vector<T>& ours, const std::vector<T>& theirs, const Tokenizer& t,
                       const std::vector<int64_t>& ids, const char* what) {
  if (ours == theirs) return "";
  size_t k = 0;
  while (k < ours.size() && k < theirs.size() && ours[k] == theirs[k]) ++k;
  auto at = [&](const std::vector<T>& v) { return k < v.size() ? std::to_string(int64_t(v[k])) : "nothing"; };
  const size_t from = k > 4 ? k - 4 : 0;
  const std::vector<int64_t> context(ids.begin() + std::min(from, ids.size()),
                                     ids.begin() + std::min(k + 1, ids.size()));
  return std::string(what) + " differ at token " + std::to_string(k) + ": ours " + at(ours) +
         ", transformers' " + at(theirs) + " (lengths " + std::to_string(ours.size()) + " and " +
         std::to_string(theirs.size()) + "), after " + json(t.decode(context)).dump();
}

TEST_F(ChatTemplateReference, MatchesTransformersOnThePublishedTemplates) {
  std::map<std::string, int> compared;
  for (const json& c : (*reference_)["cases"]) {
    const std::string name = c["template"].get<std::string>();
    const Tokenizer& t = tokenizer(c["tokenizer"].get<std::string>());
    const bool gen = c["add_generation_prompt"].get<bool>();
    const ChatTokens r = apply_chat_template(t, name, messages_of(c), gen);
    const auto ids = c["ids"].get<Ids>();
    const auto mask = c["mask"].get<Mask>();
    const std::string where =
        name + " conversation " + std::to_string(compared[name] / 2) + (gen ? " with" : " without") +
        " the generation prompt, rendered by transformers as " + c["text"].dump() + ": ";
    EXPECT_EQ(difference(r.ids, ids, t, ids, "ids"), "") << where;
    EXPECT_EQ(difference(r.loss_mask, mask, t, ids, "masks"), "") << where;
    ++compared[name];
  }
  EXPECT_EQ(compared, (std::map<std::string, int>{{"llama3", 12}, {"llama3.1", 12}, {"qwen3", 12}}));
  EXPECT_EQ(chat_end_of_turn_id(tokenizer("llama3"), "llama3"),
            *tokenizer("llama3").special_token_id("<|eot_id|>"));
  EXPECT_EQ(chat_end_of_turn_id(tokenizer("llama3"), "llama3.1"),
            *tokenizer("llama3").special_token_id("<|eot_id|>"));
  EXPECT_EQ(chat_end_of_turn_id(tokenizer("qwen3"), "qwen3"),
            *tokenizer("qwen3").special_token_id("<|im_end|>"));
  // --chat-template auto on the two tokenizers (the llama3 one has Llama-3.1's <|eom_id|>).
  EXPECT_EQ(detect_chat_template(tokenizer("llama3")), "llama3.1");
  EXPECT_EQ(detect_chat_template(tokenizer("qwen3")), "qwen3");
}

// The comparison above reports one changed id or mask value, and the ids of a template with one
// small edit (an "\n" less, another date) differ from ours: a changed token is caught.
TEST_F(ChatTemplateReference, AChangedTokenIsCaught) {
  const json& first = (*reference_)["cases"][0];
  const Tokenizer& t = tokenizer(first["tokenizer"].get<std::string>());
  const ChatTokens r =
      apply_chat_template(t, first["template"].get<std::string>(), messages_of(first), false);
  auto ids = first["ids"].get<Ids>();
  auto mask = first["mask"].get<Mask>();
  ASSERT_EQ(difference(r.ids, ids, t, ids, "ids"), "");
  ids[5] = ids[5] == 7 ? 8 : 7;
  expect_contains(difference(r.ids, ids, t, ids, "ids"), {"ids differ at token 5"});
  mask[3] ^= 1;
  expect_contains(difference(r.loss_mask, mask, t, ids, "masks"), {"masks differ at token 3"});
  std::map<std::string, int> caught;
  for (const json& c : (*reference_)["mutants"]) {
    const std::string name = c["template"].get<std::string>();
    const Tokenizer& tok = tokenizer(c["tokenizer"].get<std::string>());
    const ChatTokens ours =
        apply_chat_template(tok, name, messages_of(c), c["add_generation_prompt"].get<bool>());
    const auto theirs = c["ids"].get<Ids>();
    if (!difference(ours.ids, theirs, tok, theirs, "ids").empty()) ++caught[name];
  }
  // Every rendering the edit touches: each conversation (both ways) for llama3's headers and
  // llama3.1's date; for qwen3's "</think>\n\n" the ones with a think block (all but the prompt).
  EXPECT_EQ(caught, (std::map<std::string, int>{{"llama3", 12}, {"llama3.1", 12}, {"qwen3", 10}}));
}

}  // namespace
}  // namespace mfsdp
