// Generation: greedy decoding with the KV cache picks, at every step, the argmax of a full
// forward over everything so far (an independent recomputation); top-k 1 equals greedy; the
// saved final model loads back bit for bit; bad options and files are rejected.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <filesystem>

#include "mfsdp/generate.h"

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

TEST(Generate, FinalModelRoundTrip) {
  torch::manual_seed(4);
  mfsdp::LlamaForCausalLM model(tiny());
  std::map<std::string, at::Tensor> state;
  for (auto& item : model->named_parameters()) state[item.key()] = item.value().detach().clone();
  auto dir = std::filesystem::temp_directory_path() / ("mfsdp_final_" + std::to_string(::getpid()));
  mfsdp::save_final_model(dir.string(), tiny(), "ByteLevelTokenizer", state);
  auto loaded = mfsdp::load_final_model(dir.string());
  EXPECT_EQ(loaded.tokenizer_type, "ByteLevelTokenizer");
  for (auto& item : loaded.model->named_parameters())
    EXPECT_TRUE(at::equal(item.value(), state.at(item.key()))) << item.key();
  std::filesystem::remove(dir / "model.pt");
  try {
    mfsdp::load_final_model(dir.string());
    ADD_FAILURE() << "missing model.pt accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("model.pt"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}
