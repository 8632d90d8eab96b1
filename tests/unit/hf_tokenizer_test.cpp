// The tokenizer.json loader (HuggingFaceTokenizer) and the chatml template against the Hugging Face
// libraries themselves: tests/reference/hf_tokenizer_reference.py trains small byte-level BPEs with
// `tokenizers` (GPT-2's pre-tokenizer, the same with add_prefix_space, and Llama-3/Qwen2's
// Split + ByteLevel), saves them, and writes the library's ids for edge-case texts and
// transformers' apply_chat_template ids for a few conversations. Every id must match.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "harness/expect_error.h"
#include "harness/run_command.h"
#include "harness/temp_dir.h"
#include "mfsdp/data/chat_template.h"
#include "mfsdp/data/tokenizer.h"

namespace mfsdp {
namespace {

using nlohmann::json;
using Ids = std::vector<int64_t>;
using mfsdp::testing::TempDir;

const char* kNames[] = {"gpt2", "gpt2_prefix", "llama3"};

class HfTokenizerReference : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir("mfsdp-hftok");
    const std::string command = std::string("\"") + MFSDP_PYTHON_PATH + "\" \"" +
                                MFSDP_SOURCE_DIR + "/tests/reference/hf_tokenizer_reference.py\" \"" +
                                dir_->path().string() + "\"";
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
    ASSERT_NE(reference_, nullptr) << "hf_tokenizer_reference.py failed:\n" << *script_output_;
  }
  static std::string folder(const std::string& name) { return dir_->file(name); }

  static TempDir* dir_;
  static std::string* script_output_;
  static json* reference_;
};
TempDir* HfTokenizerReference::dir_ = nullptr;
std::string* HfTokenizerReference::script_output_ = nullptr;
json* HfTokenizerReference::reference_ = nullptr;

TEST_F(HfTokenizerReference, EncodeMatchesTheTokenizersLibrary) {
  for (const std::string name : kNames) {
    auto t = make_tokenizer({"HuggingFaceTokenizer", folder(name) + "/tokenizer.json", "", ""});
    EXPECT_EQ(t->vocab_size(), (*reference_)["vocab_size"][name].get<int64_t>()) << name;
    for (const auto& [token, id] : (*reference_)["special"][name].items())
      EXPECT_EQ(t->special_token_id(token), std::optional<int64_t>(id.get<int64_t>())) << name;
    EXPECT_EQ(t->eod(), *t->special_token_id("<|endoftext|>")) << name;
    size_t compared = 0;
    for (const json& c : (*reference_)["encode"][name]) {
      const std::string text = c["text"].get<std::string>();
      const Ids ids = t->encode(text);
      EXPECT_EQ(ids, c["ids"].get<Ids>()) << name << ": text \"" << text << "\"";
      // add_prefix_space adds text, so only the others round-trip.
      if (name != "gpt2_prefix") {
        EXPECT_EQ(t->decode(ids), text) << name;
      }
      ++compared;
    }
    EXPECT_GE(compared, 20u) << name;
  }
}

// The library writes merges as [left, right] pairs; older files hold "left right" strings.
TEST_F(HfTokenizerReference, StringMergesEncodeTheSame) {
  std::ifstream in(folder("llama3") + "/tokenizer.json");
  json tok = json::parse(in);
  for (json& m : tok["model"]["merges"]) m = m[0].get<std::string>() + " " + m[1].get<std::string>();
  TempDir dir;
  std::ofstream(dir.file("tokenizer.json")) << tok.dump();
  auto pairs = load_hf_tokenizer(folder("llama3"));
  auto strings = load_hf_tokenizer(dir.path().string());
  for (const json& c : (*reference_)["encode"]["llama3"]) {
    const std::string text = c["text"].get<std::string>();
    EXPECT_EQ(strings->encode(text), pairs->encode(text)) << text;
  }
}

TEST_F(HfTokenizerReference, ChatmlMatchesTransformersApplyChatTemplate) {
  for (const std::string name : {"gpt2", "llama3"}) {
    auto t = load_hf_tokenizer(folder(name));
    const int64_t im_end = *t->special_token_id("<|im_end|>");
    size_t compared = 0;
    for (const json& c : (*reference_)["chat"][name]) {
      std::vector<ChatMessage> messages;
      std::string assistant_text;  // what the loss mask must cover, decoded
      for (const json& m : c["messages"]) {
        messages.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
        if (messages.back().role == "assistant") assistant_text += messages.back().content + "<|im_end|>";
      }
      const bool gen = c["add_generation_prompt"].get<bool>();
      const ChatTokens r = apply_chat_template(*t, "chatml", messages, gen);
      EXPECT_EQ(r.ids, c["ids"].get<Ids>()) << name << " conversation " << compared;
      ASSERT_EQ(r.loss_mask.size(), r.ids.size());
      Ids masked;
      for (size_t k = 0; k < r.ids.size(); ++k)
        if (r.loss_mask[k]) masked.push_back(r.ids[k]);
      EXPECT_EQ(t->decode(masked), assistant_text) << name;
      // Every masked run ends with <|im_end|>, and the "\n" after it is not trained on.
      for (size_t k = 0; k + 1 < r.ids.size(); ++k) {
        if (r.loss_mask[k] && !r.loss_mask[k + 1]) {
          EXPECT_EQ(r.ids[k], im_end);
        }
      }
      ++compared;
    }
    EXPECT_EQ(compared, 6u) << name;
    EXPECT_EQ(chat_end_of_turn_id(*t, "chatml"), im_end);
  }
}

TEST_F(HfTokenizerReference, PreprocessAcceptsTheType) {
  // tokenizer_vocab_size / make_torch_safe_tokenizer see the same tokenizer as make_tokenizer.
  const TokenizerOptions options{"HuggingFaceTokenizer", folder("llama3"), "", ""};
  EXPECT_EQ(tokenizer_vocab_size(options), make_tokenizer(options)->vocab_size());
  auto safe = make_torch_safe_tokenizer(options);
  ASSERT_NE(safe, nullptr);
  const json& first = (*reference_)["encode"]["llama3"][0];
  EXPECT_EQ(safe->encode(first["text"].get<std::string>()), first["ids"].get<Ids>());
}

}  // namespace
}  // namespace mfsdp
