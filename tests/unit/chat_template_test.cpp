// Built-in chat templates on tokenizers whose ids are the bytes of the text, so every expected id
// sequence and loss mask is written out by hand from the template's definition
// (include/mfsdp/data/chat_template.h): ByteLevelTokenizer for "plain", and for "chatml" a
// tokenizer.json whose vocabulary is the 256 byte symbols (id = byte, no merges) plus the added
// tokens <|im_start|> = 256, <|im_end|> = 257, <|endoftext|> = 258. (hf_tokenizer_test compares
// chatml with transformers' apply_chat_template on trained BPEs.)
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include "harness/expect_error.h"
#include "harness/temp_dir.h"
#include "mfsdp/data/chat_template.h"
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

// A byte-level tokenizer.json without merges: each byte is its own token, id = byte value.
std::unique_ptr<Tokenizer> bytes_with_chatml_tokens(const TempDir& dir) {
  std::string vocab = "{";
  for (int b = 0; b < 256; ++b) {
    std::string symbol = utf8(gpt2_byte_to_unicode(static_cast<uint8_t>(b)));
    if (symbol == "\"" || symbol == "\\") symbol = "\\" + symbol;
    vocab += (b ? ", \"" : "\"") + symbol + "\": " + std::to_string(b);
  }
  vocab += "}";
  auto added = [](int64_t id, const std::string& content) {
    return "{\"id\": " + std::to_string(id) + ", \"content\": \"" + content +
           "\", \"single_word\": false, \"lstrip\": false, \"rstrip\": false, "
           "\"normalized\": false, \"special\": true}";
  };
  std::ofstream(dir.file("tokenizer.json"))
      << "{\"added_tokens\": [" << added(kImStart, "<|im_start|>") << ", "
      << added(kImEnd, "<|im_end|>") << ", " << added(kEndOfText, "<|endoftext|>") << "], "
      << "\"normalizer\": null, "
      << "\"pre_tokenizer\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false}, "
      << "\"decoder\": {\"type\": \"ByteLevel\"}, "
      << "\"model\": {\"type\": \"BPE\", \"vocab\": " << vocab << ", \"merges\": []}}";
  return load_hf_tokenizer(dir.file("tokenizer.json"));
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
  EXPECT_EQ(chat_template_names(), (std::vector<std::string>{"chatml", "plain"}));
}

}  // namespace
}  // namespace mfsdp
