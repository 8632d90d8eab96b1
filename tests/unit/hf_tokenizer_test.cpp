// The tokenizer.json loader (HuggingFaceTokenizer) and the chatml template against the Hugging Face
// libraries themselves: tests/reference/hf_tokenizer_reference.py trains small tokenizers with
// `tokenizers` at test time in the layouts real models ship (GPT-2, Llama-3, Qwen2, Llama-2 and
// Mistral SentencePiece-style BPE with byte fallback, Unigram, and every Split behavior, other
// models' regexes and the other pre-tokenizers, normalizers and post-processors), saves them, and
// writes the library's ids and decoded texts for a multilingual test text and edge cases, with
// and without special tokens, transformers' ids for the main layouts, and transformers'
// apply_chat_template ids for a few conversations. Every id and every decoded text must match.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "harness/expect_error.h"
#include "harness/run_command.h"
#include "harness/temp_dir.h"
#include "mfsdp/data/posttrain/chat_template.h"
#include "mfsdp/data/tokenizer.h"
#include "mfsdp/data/tokenizer_hf.h"

namespace mfsdp {
namespace {

using nlohmann::json;
using Ids = std::vector<int64_t>;
using mfsdp::testing::error_of;
using mfsdp::testing::expect_contains;
using mfsdp::testing::TempDir;

class HfTokenizerReference : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // Under ctest the setup test HfTokenizerReferenceData has written the reference
    // (tests/CMakeLists.txt); run by hand, the script runs here.
    const char* fixture = std::getenv("MFSDP_HF_REFERENCE_DIR");
    dir_ = new TempDir("mfsdp-hftok");
    root_ = new std::string(fixture != nullptr ? fixture : dir_->path().string());
    script_output_ = new std::string("(written by ctest's HfTokenizerReferenceData)");
    if (fixture == nullptr) {
      const std::string command = std::string("\"") + MFSDP_PYTHON_PATH + "\" \"" + MFSDP_SOURCE_DIR +
                                  "/tests/reference/hf_tokenizer_reference.py\" \"" + *root_ + "\"";
      const auto outcome = mfsdp::testing::run_command(command);
      *script_output_ = outcome.output;
      if (outcome.exit_code != 0) return;
    }
    std::ifstream in(*root_ + "/reference.json");
    std::stringstream ss;
    ss << in.rdbuf();
    reference_ = new json(json::parse(ss.str()));
  }
  static void TearDownTestSuite() {
    delete reference_;
    delete script_output_;
    delete root_;
    delete dir_;
    reference_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(reference_, nullptr) << "hf_tokenizer_reference.py failed:\n" << *script_output_;
  }
  static std::string folder(const std::string& name) { return *root_ + "/" + name; }
  static const json& tokenizers() { return (*reference_)["tokenizers"]; }

  static TempDir* dir_;      // this process's scratch folder
  static std::string* root_;  // the reference's folder: the fixture's, or dir_
  static std::string* script_output_;
  static json* reference_;
};
TempDir* HfTokenizerReference::dir_ = nullptr;
std::string* HfTokenizerReference::root_ = nullptr;
std::string* HfTokenizerReference::script_output_ = nullptr;
json* HfTokenizerReference::reference_ = nullptr;

std::string shown(const std::string& text) {
  std::string s = json(text).dump();
  return s.size() > 60 ? s.substr(0, 57) + "...\"" : s;
}

// Where two id lists first differ, in words; empty when they are equal.
std::string id_difference(const Ids& ours, const Ids& theirs) {
  if (ours == theirs) return "";
  size_t k = 0;
  while (k < ours.size() && k < theirs.size() && ours[k] == theirs[k]) ++k;
  auto at = [](const Ids& ids, size_t k) { return k < ids.size() ? std::to_string(ids[k]) : "nothing"; };
  return "token " + std::to_string(k) + " is " + at(ours, k) + " here and " + at(theirs, k) +
         " in the library (" + std::to_string(ours.size()) + " vs " + std::to_string(theirs.size()) +
         " tokens)";
}

// Every difference between our tokenizer `name` (plain: add_special_tokens off; special: on) and
// the library's results in `entry`, one line each.
std::vector<std::string> differences(const std::string& name, const Tokenizer& plain,
                                     const Tokenizer& special, const json& entry) {
  std::vector<std::string> found;
  auto report = [&](const std::string& what, const std::string& how) {
    if (!how.empty()) found.push_back(name + ": " + what + ": " + how);
  };
  auto decoded = [&](const Ids& ids, const std::string& theirs, const std::string& what) {
    std::string ours;
    try {
      ours = plain.decode(ids);
    } catch (const std::exception& e) {
      ours = std::string("<error: ") + e.what() + ">";
    }
    if (ours != theirs)
      report(what, "decodes to " + shown(ours) + " here and " + shown(theirs) + " in the library");
  };
  if (plain.vocab_size() != entry["vocab_size"].get<int64_t>()) {
    report("vocab_size",
           std::to_string(plain.vocab_size()) + " here, " + entry["vocab_size"].dump() + " in the library");
  }
  for (const auto& [token, id] : entry["special"].items()) {
    if (plain.special_token_id(token) != std::optional<int64_t>(id.get<int64_t>())) {
      report("special_token_id(" + shown(token) + ")", "not " + id.dump());
    }
  }
  for (const json& c : entry["cases"]) {
    const std::string text = c["text"].get<std::string>();
    report("encode(" + shown(text) + ")", id_difference(plain.encode(text), c["ids"].get<Ids>()));
    report("encode(" + shown(text) + ", add_special_tokens)",
           id_difference(special.encode(text), c["ids_special"].get<Ids>()));
    decoded(c["ids"].get<Ids>(), c["decoded"].get<std::string>(), "decode(encode(" + shown(text) + "))");
    decoded(c["ids_special"].get<Ids>(), c["decoded_special"].get<std::string>(),
            "decode(encode(" + shown(text) + ", add_special_tokens))");
  }
  for (const json& d : entry["decode"]) {
    decoded(d["ids"].get<Ids>(), d["text"].get<std::string>(),
            "decode(" + d["ids"].dump().substr(0, 40) + ")");
  }
  if (entry.contains("transformers")) {
    for (const json& c : entry["transformers"]) {
      const std::string text = c["text"].get<std::string>();
      report("transformers tokenizer(" + shown(text) + ")",
             id_difference(special.encode(text), c["ids"].get<Ids>()));
    }
  }
  return found;
}

TEST_F(HfTokenizerReference, MatchesTheTokenizersLibraryTokenForToken) {
  size_t compared = 0;
  for (const auto& [name, entry] : tokenizers().items()) {
    SCOPED_TRACE(name);
    const std::string file = folder(name) + "/tokenizer.json";
    std::unique_ptr<Tokenizer> plain, special;
    try {
      plain = make_tokenizer({"HuggingFaceTokenizer", file, "", ""});
      special = load_hf_tokenizer(file, HfTokenizerOptions{true});
    } catch (const std::exception& e) {
      ADD_FAILURE() << name << " does not load: " << e.what();
      continue;
    }
    const std::vector<std::string> found = differences(name, *plain, *special, entry);
    std::string all;
    for (size_t k = 0; k < found.size() && k < 20; ++k) all += found[k] + "\n";
    EXPECT_TRUE(found.empty()) << found.size() << " differences, the first ones:\n" << all;
    EXPECT_GE(entry["cases"].size(), 30u);
    ++compared;
  }
  // Every layout of hf_tokenizer_reference.py, e.g. gpt2, llama3, qwen2, llama2, mistral, unigram.
  EXPECT_GE(compared, 60u);
  for (const char* name : {"gpt2", "gpt2_prefix", "llama3", "qwen2", "llama2", "llama2_added", "mistral", "unigram",
                           "unicode_nfkc", "unicode_bert", "sp_bpe_nfkc", "sp_charsmap"}) {
    EXPECT_TRUE(tokenizers().contains(name)) << name;
  }
}

// The comparison above fails when one token changes: one id of the library's encoding of a text
// moved by one is reported, and so is one character changed in a text the library decoded.
TEST_F(HfTokenizerReference, AChangedTokenIsCaught) {
  const std::string file = folder("llama3") + "/tokenizer.json";
  auto plain = load_hf_tokenizer(file);
  auto special = load_hf_tokenizer(file, HfTokenizerOptions{true});
  json entry = tokenizers()["llama3"];
  ASSERT_TRUE(differences("llama3", *plain, *special, entry).empty());

  json changed = entry;
  json& ids = changed["cases"][0]["ids"];
  ASSERT_GE(ids.size(), 2u);
  ids[1] = ids[1].get<int64_t>() + 1;
  std::vector<std::string> found = differences("llama3", *plain, *special, changed);
  // The ids differ, and so does what the changed ids decode to.
  ASSERT_EQ(found.size(), 2u);
  expect_contains(found[0], {"llama3", "encode(\"Hello world\")", "token 1 is"});
  expect_contains(found[1], {"llama3", "decode(encode(\"Hello world\"))"});

  changed = entry;
  std::string& text = changed["cases"][2]["decoded"].get_ref<std::string&>();
  text[0] = text[0] == 'x' ? 'y' : 'x';
  found = differences("llama3", *plain, *special, changed);
  ASSERT_EQ(found.size(), 1u);
  expect_contains(found[0], {"decode(encode(", "in the library"});
}

// Llama-3's file: <|begin_of_text|> when asked for, nothing otherwise.
TEST_F(HfTokenizerReference, PostProcessorOnlyWithAddSpecialTokens) {
  const std::string file = folder("llama3") + "/tokenizer.json";
  const Ids plain = load_hf_tokenizer(file)->encode("Hello world");
  const Ids special = load_hf_tokenizer(file, HfTokenizerOptions{true})->encode("Hello world");
  const int64_t bos = tokenizers()["llama3"]["special"]["<|begin_of_text|>"].get<int64_t>();
  ASSERT_EQ(special.size(), plain.size() + 1);
  EXPECT_EQ(special[0], bos);
  EXPECT_EQ(Ids(special.begin() + 1, special.end()), plain);
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
  for (const json& c : tokenizers()["llama3"]["cases"]) {
    const std::string text = c["text"].get<std::string>();
    EXPECT_EQ(strings->encode(text), pairs->encode(text)) << text;
  }
}

// What the library accepts but we refuse, with the file and the JSON path in the error.
TEST_F(HfTokenizerReference, RefusalsNameTheFileAndTheJsonField) {
  std::ifstream in(folder("llama3") + "/tokenizer.json");
  const json base = json::parse(in);
  TempDir dir;
  const std::string file = dir.file("tokenizer.json");
  auto error_with = [&](const std::function<void(json&)>& edit) {
    json tok = base;
    edit(tok);
    std::ofstream(file) << tok.dump();
    return error_of([&] { load_hf_tokenizer(file); });
  };
  const std::string regex_at = "pre_tokenizer.pretokenizers[0].pattern.Regex";
  auto with_regex = [&](const std::string& regex) {
    return error_with([&](json& t) { t["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = regex; });
  };
  expect_contains(with_regex("[a-z&&[^aeiou]]+"), {file, regex_at, "&&"});
  expect_contains(with_regex("\\p{L}{1,2}+"), {file, regex_at, "possessive"});
  expect_contains(with_regex("a\\Kb"), {file, regex_at, "\\K"});
  expect_contains(with_regex("(?s)."), {file, regex_at, "option"});
  expect_contains(with_regex("\\p{NoSuchProperty}"), {file, regex_at, "does not compile"});
  expect_contains(error_with([](json& t) {
                    t["normalizer"] = {{"type", "Uppercase"}};
                  }),
                  {file, "normalizer.type", "Uppercase", "supported: "});
  // A null step of a Sequence is refused (the library's serde refuses it), not skipped.
  expect_contains(error_with([](json& t) {
                    t["normalizer"] = {{"type", "Sequence"}, {"normalizers", {json(), {{"type", "NFC"}}}}};
                  }),
                  {file, "normalizer.normalizers[0]", "null"});
  expect_contains(error_with([](json& t) {
                    t["normalizer"] = {{"type", "Precompiled"}, {"precompiled_charsmap", "AAAA%"}};
                  }),
                  {file, "normalizer.precompiled_charsmap", "base64"});
  expect_contains(error_with([](json& t) {
                    t["normalizer"] = {{"type", "Precompiled"}, {"precompiled_charsmap", "/////wAA"}};
                  }),
                  {file, "normalizer.precompiled_charsmap", "does not fit"});
  expect_contains(error_with([](json& t) {
                    t["pre_tokenizer"] = {{"type", "UnicodeScripts"}};
                  }),
                  {file, "pre_tokenizer.type", "UnicodeScripts"});
  expect_contains(error_with([](json& t) {
                    t["decoder"] = {{"type", "WordPiece"}, {"prefix", "##"}};
                  }),
                  {file, "decoder.type", "WordPiece"});
  expect_contains(error_with([](json& t) { t["model"]["type"] = "WordPiece"; }),
                  {file, "model.type", "WordPiece"});
  expect_contains(error_with([](json& t) { t["model"]["dropout"] = 0.1; }), {file, "model.dropout"});
  expect_contains(error_with([](json& t) { t["model"]["continuing_subword_prefix"] = "##"; }),
                  {file, "model.continuing_subword_prefix"});
  expect_contains(
      error_with([](json& t) { t["post_processor"]["processors"][1]["single"][1]["Sequence"]["id"] = "B"; }),
      {file, "post_processor.processors[1].single[1].Sequence.id"});
  expect_contains(error_with([](json& t) {
                    t["post_processor"] = {{"type", "Unknown"}};
                  }),
                  {file, "post_processor.type"});
  expect_contains(error_with([](json& t) {
                    t["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "ab"}};
                  }),
                  {file, "pre_tokenizer.replacement", "one character"});
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

// SFT's assistant-only mask under a normalizer that changes lengths (NFKC: full-width forms,
// ligatures, jamo): the library encodes the whole rendered conversation and the mask comes from
// its offsets into the original text; apply_chat_template must give the same ids and mask.
TEST_F(HfTokenizerReference, ChatMasksUnderNfkcMatchTheLibrarysOffsets) {
  auto t = load_hf_tokenizer(folder("llama3_nfkc"));
  size_t compared = 0;
  for (const json& c : (*reference_)["chat_masks"]["llama3_nfkc"]) {
    std::vector<ChatMessage> messages;
    for (const json& m : c["messages"]) {
      messages.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
    }
    const ChatTokens r = apply_chat_template(*t, "chatml", messages, false);
    EXPECT_EQ(r.ids, c["ids"].get<Ids>()) << "conversation " << compared;
    EXPECT_EQ(std::vector<int>(r.loss_mask.begin(), r.loss_mask.end()), c["mask"].get<std::vector<int>>())
        << "conversation " << compared;
    ++compared;
  }
  EXPECT_EQ(compared, 2u);
}

TEST_F(HfTokenizerReference, PreprocessAcceptsTheType) {
  // tokenizer_vocab_size / make_torch_safe_tokenizer see the same tokenizer as make_tokenizer.
  for (const char* name : {"llama3", "llama2", "unigram"}) {
    const TokenizerOptions options{"HuggingFaceTokenizer", folder(name), "", ""};
    EXPECT_EQ(tokenizer_vocab_size(options), make_tokenizer(options)->vocab_size());
    auto safe = make_torch_safe_tokenizer(options);
    ASSERT_NE(safe, nullptr);
    const json& first = tokenizers()[name]["cases"][0];
    EXPECT_EQ(safe->encode(first["text"].get<std::string>()), first["ids"].get<Ids>());
  }
  // EOD: </s> for the SentencePiece layouts, <|endoftext|> for the byte-level ones.
  EXPECT_EQ(load_hf_tokenizer(folder("llama2"))->eod(), 2);
  auto llama3 = load_hf_tokenizer(folder("llama3"));
  EXPECT_EQ(llama3->eod(), *llama3->special_token_id("<|endoftext|>"));
}

}  // namespace
}  // namespace mfsdp
