// Reference test (ctest label "reference"): a model fine-tuned with mfsdp-sft and written with
// --export-hf (docs/sft.md "Evaluation and outputs") loads in the real transformers as it is and
// gives mfsdp's logits. The Python side is tests/reference/sft_export_reference.py.
//
// Each case trains a tiny GQA Llama for a few iterations on 2 ranks (mfsdp-run) with --save and
// --export-hf, then:
//   - the export holds the trained model: its tensors equal the checkpoint's (rounded to bf16
//     for a --bf16 export, which must be stored as bf16; an fp32 export as fp32);
//   - transformers' AutoModelForCausalLM (float32, eager attention) builds LlamaForCausalLM with
//     the model_type, vocabulary size and tie_word_embeddings that the flags ask for (a tied
//     model's lm_head is the embedding tensor itself);
//   - the logits transformers gives for the chat-templated ids of a few conversations equal
//     those of mfsdp::load_model on the same folder (fp32; a bf16 export is read by both sides
//     as the same bf16 values cast to fp32, so it must agree as tightly), and those of the
//     trained model read from the checkpoint (its weights rounded to bf16 for a bf16 export),
//     so a config field the export gets wrong cannot hide behind both sides reading it alike.
// Cases (three, to stay near a minute on a small machine): byte-level untied fp32, byte-level
// tied bf16, and HuggingFaceTokenizer tied fp32. That last one trains a byte-level BPE with the
// `tokenizers` library at test time (ChatML special tokens, the template in
// tokenizer_config.json); mfsdp-sft's template "auto" must pick chatml, the export must carry
// the tokenizer so AutoTokenizer.from_pretrained(export) loads it, and transformers'
// apply_chat_template must give the ids mfsdp trained on (apply_chat_template with
// load_hf_tokenizer).
//
// A missing reference Python or transformers is a failure (not a skip): these tests exist to run.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "harness/run_command.h"
#include "harness/temp_dir.h"
#include "mfsdp/checkpoint/load_model.h"
#include "mfsdp/checkpoint/safetensors.h"
#include "mfsdp/data/posttrain/chat_dataset.h"
#include "mfsdp/data/posttrain/chat_template.h"
#include "mfsdp/data/tokenizer.h"

namespace {

namespace fs = std::filesystem;
using mfsdp::testing::CommandOutcome;
using mfsdp::testing::TempDir;
using nlohmann::json;

const std::string kPython = MFSDP_PYTHON_PATH;
const std::string kScript = std::string(MFSDP_SOURCE_DIR) + "/tests/reference/sft_export_reference.py";

// Logits agree to this times max(1, max |logit|). Both sides run the same fp32 weights through
// the same operations in a different order; the reference test of mfsdp-ckpt export-hf sees
// ~1e-6 (tests/reference/hf_reference_test.cpp).
constexpr double kRelTol = 2e-5;

// Single-quoted for the shell.
std::string q(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// The reference Python with one thread: these tests share a small machine with builds.
std::string python() { return "env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 " + q(kPython) + " " + q(kScript); }

// Training conversations: additions, some with a system message, so a few steps move the weights.
std::vector<mfsdp::SftExample> training_set() {
  std::vector<mfsdp::SftExample> out;
  for (int i = 0; i < 16; ++i) {
    mfsdp::SftExample e;
    if (i % 4 == 0) e.messages.push_back({"system", "Add."});
    e.messages.push_back({"user", std::to_string(3 * i + 1) + "+" + std::to_string(7 * i % 20) + "="});
    e.messages.push_back({"assistant", std::to_string(3 * i + 1 + 7 * i % 20)});
    out.push_back(e);
  }
  return out;
}

// The conversations whose logits are compared: one from training, one not, one multi-turn.
std::vector<std::vector<mfsdp::ChatMessage>> probe_conversations() {
  return {{{"user", "4+7="}, {"assistant", "11"}},
          {{"system", "Add."}, {"user", "what is 12 + 30?"}, {"assistant", "42"}},
          {{"user", "1+1="}, {"assistant", "2"}, {"user", "and 2+2="}, {"assistant", "4"}}};
}

json messages_json(const std::vector<mfsdp::ChatMessage>& messages) {
  json out = json::array();
  for (const auto& m : messages) out.push_back({{"role", m.role}, {"content", m.content}});
  return out;
}

json read_json(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read " + path);
  return json::parse(in);
}

// Every tensor of an export, by name, as stored (dtype included).
std::map<std::string, at::Tensor> stored_tensors(const std::string& file) {
  mfsdp::SafetensorsFile f(file);
  std::map<std::string, at::Tensor> out;
  for (const auto& name : f.names()) out[name] = f.load(name);
  return out;
}

std::map<std::string, at::Tensor> parameters(const mfsdp::LoadedModel& m) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : m.model->named_parameters()) out[p.key()] = p.value().detach();
  return out;
}

class SftExportReference : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(fs::exists(kPython))
        << "the reference Python " << kPython << " (CMake's MFSDP_PYTHON) does not exist: run scripts/setup.sh, "
        << "which creates the project's .venv with torch, transformers, tokenizers and safetensors";
    // Looked up, not imported: importing torch takes seconds, and the test's own Python runs import them.
    CommandOutcome r = mfsdp::testing::run_command(
        q(kPython) + " -c 'import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in "
                     "(\"torch\", \"transformers\", \"tokenizers\", \"safetensors\")))'");
    ASSERT_EQ(r.exit_code, 0) << "the reference Python " << kPython
                              << " does not have torch, transformers, tokenizers and safetensors: run scripts/setup.sh\n"
                              << r.output;
  }
};

struct Case {
  bool tied = false;
  bool bf16 = false;
  std::string tokenizer_dir;  // non-empty: HuggingFaceTokenizer from this folder, else ByteLevel
};

// Trains and exports, then checks the export against the checkpoint, transformers' reading of
// the folder and its logits.
void check_case(const TempDir& dir, const Case& c) {
  const bool hf_tok = !c.tokenizer_dir.empty();
  const std::string hf = dir.file("hf"), ckpt = dir.file("ckpt");
  mfsdp::write_sft_jsonl(dir.file("train.jsonl"), training_set());

  // --init-method-std 0.2: logits of a few units, so a wrong weight shows (0.02 gives logits
  // near 0). A RoPE base and norm epsilon unlike transformers' defaults, so a config field lost
  // on the way shows. Byte-level: the vocabulary is exactly 257 rows; the HF tokenizer keeps
  // Megatron's default padding to a multiple of 128.
  const std::string flags =
      " --device cpu --train-files " + q(dir.file("train.jsonl")) +
      (hf_tok ? " --tokenizer-type HuggingFaceTokenizer --tokenizer-model " + q(c.tokenizer_dir)
              : std::string(" --tokenizer-type ByteLevelTokenizer --make-vocab-size-divisible-by 1")) +
      " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --group-query-attention --num-query-groups 2"
      " --swiglu --ffn-hidden-size 48 --max-length 64 --micro-batch-size 4 --train-iters 5 --lr 1e-2"
      " --init-method-std 0.2 --rotary-base 500000 --norm-epsilon 1e-4 --seed 5 --log-interval 1" +
      std::string(c.tied ? "" : " --untie-embeddings-and-output-weights") + (c.bf16 ? " --bf16" : "") +
      " --save " + q(ckpt) + " --export-hf " + q(hf);
  CommandOutcome train =
      mfsdp::testing::run_command(q(MFSDP_RUN_BIN_PATH) + " --nproc-per-node 2 " + q(MFSDP_SFT_BIN_PATH) + flags);
  ASSERT_EQ(train.exit_code, 0) << train.output;
  ASSERT_TRUE(fs::exists(hf + "/config.json")) << train.output;
  ASSERT_TRUE(fs::exists(hf + "/model.safetensors")) << train.output;

  // The tokenizer mfsdp trained with, and the template "auto" must have chosen for it.
  std::unique_ptr<mfsdp::Tokenizer> tokenizer;
  std::string template_name = "plain";
  if (hf_tok) {
    EXPECT_NE(train.output.find("chat template chatml"), std::string::npos)
        << "--chat-template auto with <|im_start|>/<|im_end|> in the tokenizer must pick chatml\n" << train.output;
    template_name = "chatml";
    for (const char* file : {"tokenizer.json", "tokenizer_config.json"})
      EXPECT_TRUE(fs::exists(fs::path(hf) / file)) << "the export lacks the tokenizer's " << file;
    tokenizer = mfsdp::load_hf_tokenizer(c.tokenizer_dir);
  } else {
    EXPECT_NE(train.output.find("chat template plain"), std::string::npos) << train.output;
    tokenizer = std::make_unique<mfsdp::ByteLevelTokenizer>();
  }

  // The export is the trained model, in the dtype --bf16 asks for.
  const auto exported = stored_tensors(hf + "/model.safetensors");
  const auto trained = parameters(mfsdp::load_model(ckpt));
  const at::ScalarType want_dtype = c.bf16 ? at::kBFloat16 : at::kFloat;
  EXPECT_EQ(exported.count("lm_head.weight"), c.tied ? 0u : 1u)
      << "a tied export stores the embedding only, an untied one lm_head.weight too";
  for (const auto& [name, t] : trained) {
    auto it = exported.find(name);
    if (c.tied && name == "lm_head.weight") continue;
    ASSERT_NE(it, exported.end()) << "the export lacks " << name;
    EXPECT_EQ(it->second.scalar_type(), want_dtype) << name;
    EXPECT_TRUE(at::equal(it->second.to(at::kFloat), t.to(want_dtype).to(at::kFloat)))
        << name << " differs from the checkpoint's (max |diff| "
        << (it->second.to(at::kFloat) - t).abs().max().item<double>() << ")";
  }
  for (const auto& [name, t] : exported) EXPECT_EQ(trained.count(name), 1u) << "the export has an extra tensor " << name;

  // The ids of the probe conversations, as mfsdp's training renders them.
  json request = {{"ids", json::array()}};
  std::vector<std::vector<int64_t>> rows;
  for (const auto& messages : probe_conversations()) {
    rows.push_back(mfsdp::apply_chat_template(*tokenizer, template_name, messages, false).ids);
    request["ids"].push_back(rows.back());
  }
  if (hf_tok) {
    request["conversations"] = json::array();
    for (const auto& messages : probe_conversations()) request["conversations"].push_back(messages_json(messages));
  }
  {
    std::ofstream out(dir.file("request.json"));
    out << request.dump();
  }
  const std::string out_dir = dir.file("transformers");
  CommandOutcome ref = mfsdp::testing::run_command(python() + " check " + q(hf) + " " + q(dir.file("request.json")) +
                                                   " " + q(out_dir));
  std::cout << ref.output;
  ASSERT_EQ(ref.exit_code, 0) << "transformers could not load or run " << hf;
  const json report = read_json(out_dir + "/report.json");

  // What transformers sees in config.json.
  const int64_t want_vocab = hf_tok ? (tokenizer->vocab_size() + 127) / 128 * 128 : 257;
  EXPECT_EQ(report["class"], "LlamaForCausalLM");
  EXPECT_EQ(report["model_type"], "llama");
  EXPECT_EQ(report["vocab_size"].get<int64_t>(), want_vocab);
  EXPECT_EQ(report["tie_word_embeddings"].get<bool>(), c.tied);
  EXPECT_EQ(report["lm_head_is_embedding"].get<bool>(), c.tied);
  EXPECT_EQ(report["dtype"], c.bf16 ? "bfloat16" : "float32");
  EXPECT_EQ(report["loaded_dtype"], "torch.float32");

  if (hf_tok) {
    const json& t = report["tokenizer"];
    ASSERT_TRUE(t.is_object()) << report.dump(1);
    EXPECT_EQ(t["len"].get<int64_t>(), tokenizer->vocab_size()) << "AutoTokenizer's vocabulary vs mfsdp's";
    for (const char* s : {"<|endoftext|>", "<|im_start|>", "<|im_end|>"})
      EXPECT_EQ(t["special"][s].get<int64_t>(), tokenizer->special_token_id(s).value_or(-1)) << s;
    ASSERT_TRUE(t["chat_template"].get<bool>()) << "AutoTokenizer found no chat template in the export " << hf;
    ASSERT_EQ(t["chat_ids"].size(), rows.size());
    for (size_t i = 0; i < rows.size(); ++i)
      EXPECT_EQ(t["chat_ids"][i].get<std::vector<int64_t>>(), rows[i])
          << "conversation " << i << ": transformers' apply_chat_template vs the ids mfsdp trains on";
  }

  // Logits. Two mfsdp models against transformers: the trained model from the checkpoint (its
  // own config and weights, rounded to bf16 for a bf16 export: a config field the export lost or
  // changed shows here), and mfsdp::load_model's reading of the export itself.
  torch::NoGradGuard no_grad;
  mfsdp::LoadedModel from_ckpt = mfsdp::load_model(ckpt), from_export = mfsdp::load_model(hf);
  if (c.bf16)
    for (auto& p : from_ckpt.model->parameters()) p.copy_(p.to(at::kBFloat16).to(at::kFloat));
  mfsdp::SafetensorsFile theirs(out_dir + "/logits.safetensors");
  for (auto* ours : {&from_ckpt, &from_export}) {
    const std::string which = ours == &from_ckpt ? "checkpoint " + ckpt : "export " + hf;
    ours->model->eval();
    for (size_t i = 0; i < rows.size(); ++i) {
      const auto n = static_cast<int64_t>(rows[i].size());
      const at::Tensor mine = ours->model->forward(torch::tensor(rows[i], torch::kLong).view({1, n}))[0];
      const at::Tensor ref_logits = theirs.load("logits_" + std::to_string(i));
      ASSERT_EQ(mine.sizes(), ref_logits.sizes()) << which << ", row " << i;
      const double diff = (mine.to(at::kDouble) - ref_logits.to(at::kDouble)).abs().max().item<double>();
      const double scale = ref_logits.abs().max().item<double>();
      std::cout << "mfsdp from the " << which << ", row " << i << " (" << n
                << " tokens): max |mfsdp - transformers| = " << diff << ", max |logit| = " << scale << "\n";
      EXPECT_GT(scale, 0.5) << "logits near 0 would compare little";
      EXPECT_LE(diff, kRelTol * std::max(1.0, scale)) << which << ", row " << i;
    }
  }
}

TEST_F(SftExportReference, ByteLevelUntiedFp32) {
  TempDir dir("mfsdp-sft-export");
  check_case(dir, {/*tied=*/false, /*bf16=*/false, ""});
}

TEST_F(SftExportReference, ByteLevelTiedBf16) {
  TempDir dir("mfsdp-sft-export");
  check_case(dir, {/*tied=*/true, /*bf16=*/true, ""});
}

TEST_F(SftExportReference, HuggingFaceTokenizerTiedFp32) {
  TempDir dir("mfsdp-sft-export");
  CommandOutcome tok = mfsdp::testing::run_command(python() + " train-tokenizer " + q(dir.file("tokenizer")));
  ASSERT_EQ(tok.exit_code, 0) << tok.output;
  check_case(dir, {/*tied=*/true, /*bf16=*/false, dir.file("tokenizer")});
}

}  // namespace
