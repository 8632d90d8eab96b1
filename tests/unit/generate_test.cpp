// Generation: greedy decoding with the KV cache picks, at every step, the argmax of a full
// forward over everything so far (an independent recomputation); top-k 1 equals greedy;
// load_model reads a checkpoint and a Hugging Face folder (its safetensors file written here by
// hand from the format's specification) back bit for bit; bad options and folders are rejected.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "harness/expect_error.h"
#include "harness/temp_dir.h"
#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/models/llama_hf_config.h"
#include "mfsdp/checkpoint/load_model.h"
#include "mfsdp/models/generate.h"

namespace {
mfsdp::LlamaConfig tiny() {
  mfsdp::LlamaConfig c;
  c.vocab_size = 37;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 64;
  return c;
}

std::map<std::string, at::Tensor> seeded_state(uint64_t seed) {
  torch::manual_seed(seed);
  mfsdp::LlamaForCausalLM model(tiny());
  std::map<std::string, at::Tensor> state;
  for (auto& item : model->named_parameters()) state[item.key()] = item.value().detach().clone();
  return state;
}

// A safetensors file as the specification lays it out: an 8-byte little-endian header length, the
// JSON header (dtype, shape, data_offsets per tensor), then the raw little-endian data.
void write_safetensors_by_hand(const std::string& path, const std::map<std::string, at::Tensor>& tensors) {
  nlohmann::json header = nlohmann::json::object();
  std::string data;
  for (const auto& [name, t] : tensors) {
    const at::Tensor c = t.contiguous();
    const char* dtype = c.scalar_type() == at::kFloat ? "F32" : c.scalar_type() == at::kBFloat16 ? "BF16" : "?";
    const size_t begin = data.size();
    data.append(static_cast<const char*>(c.data_ptr()), c.nbytes());
    header[name] = {{"dtype", dtype}, {"shape", c.sizes().vec()}, {"data_offsets", {begin, data.size()}}};
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  char length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<char>((static_cast<uint64_t>(text.size()) >> (8 * i)) & 0xff);
  std::ofstream out(path, std::ios::binary);
  out.write(length, 8);
  out << text << data;
}

void expect_model_equals(const mfsdp::LoadedModel& loaded, const std::map<std::string, at::Tensor>& want,
                         const std::string& what) {
  ASSERT_EQ(loaded.model->named_parameters().size(), want.size()) << what;
  for (auto& item : loaded.model->named_parameters()) {
    EXPECT_EQ(item.value().scalar_type(), at::kFloat) << what << ": " << item.key();
    EXPECT_TRUE(at::equal(item.value(), want.at(item.key()).to(at::kFloat))) << what << ": " << item.key();
  }
}
}  // namespace

TEST(Generate, GreedyWithCacheEqualsArgmaxOfFullForward) {
  at::set_num_threads(1);
  torch::manual_seed(3);
  mfsdp::LlamaForCausalLM model(tiny());
  std::vector<int64_t> prompt = {1, 5, 9};
  mfsdp::GenerateOptions g;
  g.greedy = true;
  g.max_new_tokens = 12;
  auto out = mfsdp::generate(*model, prompt, g);
  ASSERT_EQ(out.size(), 12u);
  std::vector<int64_t> seq = prompt;
  torch::NoGradGuard no_grad;
  for (int64_t next : out) {
    at::Tensor logits = model->forward(torch::tensor(seq, torch::kLong).unsqueeze(0));
    EXPECT_EQ(logits[0][-1].argmax().item<int64_t>(), next);
    seq.push_back(next);
  }
  g.greedy = false;
  g.top_k = 1;
  EXPECT_EQ(mfsdp::generate(*model, prompt, g), out);
  g.top_k = 0;
  g.top_p = 1e-6;  // nucleus of one token
  EXPECT_EQ(mfsdp::generate(*model, prompt, g), out);
  g.top_p = 1.0;
  g.temperature = 0;
  EXPECT_THROW(mfsdp::generate(*model, prompt, g), std::invalid_argument);
  g.temperature = 1;
  EXPECT_THROW(mfsdp::generate(*model, {}, g), std::invalid_argument);
}

TEST(Generate, LoadModelReadsACheckpointBitForBit) {
  mfsdp::testing::TempDir dir("mfsdp-generate");
  const auto state = seeded_state(4);
  mfsdp::CheckpointInfo info;
  info.iteration = 3;
  info.model_config = mfsdp::llama_hf_config(tiny(), at::kFloat);
  info.args = {{"--tokenizer-type", "ByteLevelTokenizer"}};
  mfsdp::write_checkpoint(dir.file("ckpt"), state, info);
  for (const std::string& path : {dir.file("ckpt"), dir.file("ckpt/iter_0000003")}) {
    const auto loaded = mfsdp::load_model(path);
    expect_model_equals(loaded, state, path);
    EXPECT_EQ(loaded.tokenizer_type, "ByteLevelTokenizer") << path;
  }
}

TEST(Generate, LoadModelReadsAHandWrittenHuggingFaceFolder) {
  mfsdp::testing::TempDir dir("mfsdp-generate");
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    const std::string folder = dir.file(dtype == at::kFloat ? "fp32" : "bf16");
    std::filesystem::create_directories(folder);
    std::map<std::string, at::Tensor> state = seeded_state(5);
    for (auto& [name, t] : state) t = t.to(dtype);
    write_safetensors_by_hand(folder + "/model.safetensors", state);
    std::ofstream(folder + "/config.json") << mfsdp::llama_hf_config(tiny(), dtype).dump(2);
    const auto loaded = mfsdp::load_model(folder);
    expect_model_equals(loaded, state, folder);  // bf16 values are exact in fp32
    EXPECT_EQ(loaded.tokenizer_type, "") << "an HF folder names no tokenizer of ours";
  }
}

TEST(Generate, LoadModelRejectsOtherFoldersNamingWhatItReads) {
  mfsdp::testing::TempDir dir("mfsdp-generate");
  // The retired final-model layout (config.json + a pickled model.pt) is just another folder now.
  std::filesystem::create_directories(dir.file("old"));
  std::ofstream(dir.file("old/config.json")) << mfsdp::llama_hf_config(tiny(), at::kFloat).dump(2);
  std::ofstream(dir.file("old/model.pt")) << "not read";
  const std::string old = mfsdp::testing::error_of([&] { mfsdp::load_model(dir.file("old")); });
  mfsdp::testing::expect_contains(old, {dir.file("old"), "is neither a checkpoint", "Hugging Face",
                                        "latest_checkpointed_iteration.txt", "model.safetensors"});
  EXPECT_EQ(old.find("model.pt"), std::string::npos) << old;
  const std::string missing = mfsdp::testing::error_of([&] { mfsdp::load_model(dir.file("nothing")); });
  mfsdp::testing::expect_contains(missing, {dir.file("nothing"), "does not exist"});
  EXPECT_THROW(mfsdp::load_model(dir.file("old")), std::invalid_argument);
}
