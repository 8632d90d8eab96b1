// Reference test (ctest label "reference"): the migration path of Megatron-FSDP's user guide,
// torch_dist -> fsdp_dtensor -> training with mfsdp. tests/reference/make_torch_dist_checkpoint.py
// writes, with the environment's torch and transformers, a Llama (transformers, fp32) and the
// same weights as Megatron-LM's torch_dist checkpoint of a GPTModel with tensor parallelism 2
// (stacked layers, fused and group-interleaved linear_qkv, [gate; up] linear_fc1, bf16 model
// weights, fp32_param / exp_avg / exp_avg_sq optimizer state, common.pt with args and param
// groups), and the --dump-param-to-param-group-map folder. Then:
//   - print-torch-dcp-in-json turns the map folder into the JSON the converter takes;
//   - convert-torch-dist-to-fsdp-dtensor --swiglu gives per-layer Megatron-FSDP keys, each param's
//     optimizer group, and a checkpoint whose Llama tensors (read through the Megatron GPT names)
//     equal transformers' fp32 weights exactly, with the optimizer state mapped alike;
//   - mfsdp loads it on 2 ranks under ZeRO-3 and holds those weights and the AdamW step;
//   - inspect, print-tensor, compare-two-checkpoint and modify-state-dict report what they should.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <sstream>

#include "harness/dist_test.h"
#include "harness/expect_error.h"
#include "harness/run_command.h"
#include "harness/temp_dir.h"
#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/checkpoint/checkpoint_inspector.h"
#include "mfsdp/checkpoint/ckpt_operations.h"
#include "mfsdp/checkpoint/dcp.h"
#include "mfsdp/models/llama_hf_config.h"
#include "mfsdp/checkpoint/safetensors.h"
#include "mfsdp/fsdp/fully_shard.h"
#include "mfsdp/models/llama.h"

namespace {

namespace fs = std::filesystem;
using mfsdp::testing::expect_contains;

const std::string kPython = MFSDP_PYTHON_PATH;
const std::string kScript = MFSDP_FIXTURE_SCRIPT;

std::shared_ptr<mfsdp::Communicator> borrow(mfsdp::Communicator& comm) {
  return std::shared_ptr<mfsdp::Communicator>(&comm, [](mfsdp::Communicator*) {});
}

// The fixture and its conversion, made once by the parent process into `dir`.
void make_fixture(const std::string& dir) {
  const auto outcome = mfsdp::testing::run_command("env OMP_NUM_THREADS=1 '" + kPython + "' '" + kScript + "' '" +
                                                   dir + "/fixture' --megatron-common-optimizer");
  std::cout << outcome.output;
  ASSERT_EQ(outcome.exit_code, 0) << outcome.output;
  // The README's commands, through the tool.
  const std::string ckpt = MFSDP_CKPT_BIN_PATH;
  const auto json = mfsdp::testing::run_command(ckpt + " print-torch-dcp-in-json " + dir + "/fixture/param_to_param_group_map");
  ASSERT_EQ(json.exit_code, 0) << json.output;
  expect_contains(json.output, {"\"model.module.decoder.layers.1.mlp.linear_fc1.weight\":0",
                                "Saved converted param_to_param_group_map to:"});
  const std::string map = dir + "/fixture/param_to_param_group_map/param_to_param_group_map.json";
  const auto converted = mfsdp::testing::run_command(
      ckpt + " convert-torch-dist-to-fsdp-dtensor --swiglu " + dir + "/fixture/torch_dist/iter_0000003 " + dir +
      "/converted/iter_0000003 --param-to-param-group-map-json " + map);
  ASSERT_EQ(converted.exit_code, 0) << converted.output;
  expect_contains(converted.output, {"Converted checkpoint saved to"});
  EXPECT_EQ(mfsdp::latest_checkpoint_iteration(dir + "/converted"), 3);
}

std::map<std::string, at::Tensor> hf_weights(const std::string& dir) {
  return mfsdp::SafetensorsFile(dir + "/fixture/hf/model.safetensors").load_all();
}

TEST(TorchDistReference, ConvertsToFsdpDtensorThatMfsdpTrainsFrom) {
  mfsdp::testing::TempDir dir("mfsdp-torch-dist");
  const std::string d = dir.path().string();
  if (!mfsdp::testing::is_rank_process()) {
    make_fixture(d);
    if (HasFatalFailure()) return;
    // Megatron-FSDP's names, one tensor per layer, SwiGLU split, each parameter's group.
    mfsdp::dcp::Reader raw(d + "/converted/iter_0000003");
    for (const char* key : {"model.module.decoder.layers.1.self_attention.linear_qkv.weight",
                            "model.module.decoder.layers.0.mlp.linear_fc1.weight_w",
                            "model.module.decoder.layers.0.mlp.linear_fc1.weight_v",
                            "optimizer.state.module.module.module.decoder.layers.1.mlp.linear_fc1.weight_v.exp_avg",
                            "model.module.embedding.word_embeddings.weight", "model.module.output_layer.weight"})
      EXPECT_TRUE(raw.contains_tensor(key)) << key;
    EXPECT_EQ(raw.tensor("model.module.decoder.layers.1.self_attention.linear_qkv.weight").shape,
              (std::vector<int64_t>{64, 32}));
    EXPECT_EQ(raw.tensor("model.module.decoder.layers.0.mlp.linear_fc1.weight_w").dtype, at::kFloat);  // fp32_param
    EXPECT_EQ(raw.read_object("optimizer.param_to_group_meta.module.module.module.decoder.layers.0."
                              "self_attention.linear_qkv.weight.weight_decay"), 0.1);
    EXPECT_EQ(raw.read_object("optimizer.param_to_group_meta.module.module.module.decoder.layers.0."
                              "mlp.linear_fc1.layer_norm_weight.weight_decay"), 0.0);
    EXPECT_EQ(raw.read_object("iteration"), 3);

    // Read as the Llama: transformers' fp32 weights exactly, the optimizer state alike.
    mfsdp::CheckpointReader reader(d + "/converted");
    EXPECT_EQ(reader.metadata()["iteration"], 3);
    EXPECT_EQ(reader.metadata()["model_config"]["num_key_value_heads"], 2);
    EXPECT_EQ(reader.metadata()["optimizer"]["step"], 3);
    for (const auto& [name, w] : hf_weights(d)) {
      ASSERT_TRUE(reader.contains("model." + name)) << name;
      EXPECT_TRUE(at::equal(reader.read("model." + name), w)) << name;
      EXPECT_TRUE(at::allclose(reader.read("optimizer.state." + name + ".exp_avg"), w * 0.001, 1e-6, 0)) << name;
      EXPECT_TRUE(at::allclose(reader.read("optimizer.state." + name + ".exp_avg_sq"), (w * 0.001).pow(2), 1e-6, 0))
          << name;
    }

    // The inspector's commands.
    std::ostringstream out;
    mfsdp::inspect_dcp_checkpoint(d + "/fixture/torch_dist", false, out);
    expect_contains(out.str(), {"\"sharded_backend\": \"torch_dist\"", "COMMON STATE", "Total Tensors:",
                                "decoder.layers.self_attention.linear_qkv.weight [torch.bfloat16, shape=(2, 64, 32)]"});
    out.str("");
    mfsdp::print_dcp_tensor(d + "/converted", "model.module.decoder.final_layernorm.weight", out);
    expect_contains(out.str(), {"Shape: torch.Size([32])", "Dtype: torch.float32"});
    out.str("");
    const mfsdp::TensorSource converted(d + "/converted");
    EXPECT_TRUE(mfsdp::compare_tensors(converted, converted).same);
    mfsdp::modify_dcp_state_dict(d + "/converted", d + "/modified",
                                 {"remove output_layer", "rename final_layernorm final_norm"}, out);
    const mfsdp::ComparisonReport report = mfsdp::compare_tensors(converted, mfsdp::TensorSource(d + "/modified"));
    EXPECT_FALSE(report.same);
    // Tensors by the names mfsdp trains them under (output_layer: lm_head, final_layernorm:
    // model.norm); a name it does not know keeps Megatron's, less the module prefix.
    expect_contains(report.table(), {"ONLY-A    -             model.lm_head.weight\n",
                                     "ONLY-A    -             model.model.norm.weight\n",
                                     "ONLY-B    -             model.decoder.final_norm.weight\n", "(object)"});
    mfsdp::dcp::Reader modified(d + "/modified");
    EXPECT_TRUE(at::equal(modified.read("model.module.decoder.final_norm.weight"),
                          raw.read("model.module.decoder.final_layernorm.weight")));
  }

  // mfsdp trains from it: 2 ranks, ZeRO-3, the weights and the AdamW step of the checkpoint.
  mfsdp::testing::DistOptions options;
  options.world_sizes = {2};
  options.shared_dir = d;
  mfsdp::testing::run_distributed(options, [&](mfsdp::Communicator& comm) {
    const std::string shared = mfsdp::testing::shared_temp_dir();
    mfsdp::CheckpointReader reader(shared + "/converted");
    const mfsdp::LlamaConfig config = mfsdp::llama_config_from_hf(reader.metadata()["model_config"]);
    mfsdp::LlamaForCausalLM model(config, mfsdp::LlamaOptions{});
    mfsdp::FullyShardOptions o;
    o.comm = borrow(comm);
    mfsdp::FsdpHandle root = mfsdp::shard_llama(model, o);
    auto optimizer = mfsdp::make_adamw(root, mfsdp::AdamWOptions{});
    const auto got = mfsdp::load_checkpoint(shared + "/converted", borrow(comm), root, optimizer.get());
    EXPECT_EQ(got.iteration, 3);
    EXPECT_TRUE(got.optimizer_loaded);
    EXPECT_EQ(optimizer->steps(), 3);
    const auto full = root.full_state_dict(/*all_ranks=*/true);
    for (const auto& [name, w] : hf_weights(shared)) EXPECT_TRUE(at::equal(full.at(name), w)) << name;
  });
}

}  // namespace
