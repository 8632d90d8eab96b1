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
// Mixtures of experts (the script's --moe): a Qwen3-MoE (TEGroupedMLP, every layer MoE: stacked
// [layer, expert, ...] tensors) and a Qwen2-MoE (SequentialMLP, a gated shared expert and a dense
// layer: per-layer keys) as Megatron saves them with TP 2 and expert parallelism 2, converted: one
// tensor per expert under the saving model's names, each transformers' expert exactly (so a
// wrong expert index fails), optimizer state alike, and mfsdp's logits are transformers'.
// Expert tensors outside Megatron's layout, or disagreeing with num_experts, are refused by name.
// Tensor parallel sources (the script's --tensor-parallel 1, 2, 4: one .distcp per TP rank,
// column-parallel chunks by rows, row-parallel by columns, fc1 as apply_swiglu_sharded_factory's
// two [gate_r] / [up_r] chunks per rank, norms written by rank 0) convert to the same checkpoint.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <set>
#include <sstream>

#include "harness/dist_test.h"
#include "harness/expect_error.h"
#include "harness/run_command.h"
#include "harness/temp_dir.h"
#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/checkpoint/checkpoint_inspector.h"
#include "mfsdp/checkpoint/ckpt_operations.h"
#include "mfsdp/checkpoint/dcp.h"
#include "mfsdp/checkpoint/load_model.h"
#include "mfsdp/models/llama_hf_config.h"
#include "mfsdp/checkpoint/safetensors.h"
#include "mfsdp/fsdp/fully_shard.h"
#include "mfsdp/models/causal_lm.h"
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

// The converted checkpoint in d/converted, read as the model: transformers' fp32 weights of
// d/fixture/hf exactly, exp_avg / exp_avg_sq the fixture's 0.001 * w and its square.
void expect_hf_weights_and_state(const std::string& d) {
  mfsdp::CheckpointReader reader(d + "/converted");
  for (const auto& [name, w] : hf_weights(d)) {
    ASSERT_TRUE(reader.contains("model." + name)) << name;
    EXPECT_TRUE(at::equal(reader.read("model." + name), w)) << name;
    EXPECT_TRUE(at::allclose(reader.read("optimizer.state." + name + ".exp_avg"), w * 0.001, 1e-6, 0)) << name;
    EXPECT_TRUE(at::allclose(reader.read("optimizer.state." + name + ".exp_avg_sq"), (w * 0.001).pow(2), 1e-6, 0))
        << name;
  }
}

// mfsdp's model loaded from d/converted gives transformers' logits (d/fixture/reference_logits).
void expect_reference_logits(const std::string& d, const std::string& what) {
  const mfsdp::LoadedModel loaded = mfsdp::load_model(d + "/converted");
  mfsdp::SafetensorsFile reference(d + "/fixture/reference_logits.safetensors");
  at::Tensor logits;
  {
    at::NoGradGuard no_grad;
    logits = loaded.model->forward(reference.load("input_ids"));
  }
  const at::Tensor want = reference.load("logits");
  ASSERT_EQ(logits.sizes(), want.sizes());
  const double diff = (logits - want).abs().max().item<double>();
  EXPECT_LT(diff, 1e-4) << what << ": mfsdp's logits vs transformers' (largest " << want.abs().max().item<double>()
                        << ")";
  std::cout << what << ": mfsdp vs transformers logits max |diff| " << diff << "\n";
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
    expect_hf_weights_and_state(d);

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

// The fixture with `flags` (--moe ..., --tensor-parallel ...) in dir/fixture, converted with
// --swiglu and its param map into dir/converted/iter_0000003 by the tool; the tool's output.
std::string convert_fixture(const std::string& dir, const std::string& flags) {
  const auto outcome = mfsdp::testing::run_command("env OMP_NUM_THREADS=1 '" + kPython + "' '" + kScript + "' '" +
                                                   dir + "/fixture' " + flags);
  EXPECT_EQ(outcome.exit_code, 0) << outcome.output;
  const std::string ckpt = MFSDP_CKPT_BIN_PATH;
  const auto json = mfsdp::testing::run_command(ckpt + " print-torch-dcp-in-json " + dir + "/fixture/param_to_param_group_map");
  EXPECT_EQ(json.exit_code, 0) << json.output;
  const auto converted = mfsdp::testing::run_command(
      ckpt + " convert-torch-dist-to-fsdp-dtensor --swiglu " + dir + "/fixture/torch_dist/iter_0000003 " + dir +
      "/converted/iter_0000003 --param-to-param-group-map-json " + dir +
      "/fixture/param_to_param_group_map/param_to_param_group_map.json");
  EXPECT_EQ(converted.exit_code, 0) << converted.output;
  return converted.output;
}

// The converted MoE checkpoint holds transformers' weights (every expert under its own index) and
// the optimizer state of each, and mfsdp's model loaded from it gives transformers' logits.
void expect_transformers_model(const std::string& d, const std::string& model_type) {
  mfsdp::CheckpointReader reader(d + "/converted");
  EXPECT_EQ(reader.metadata()["model_config"]["model_type"], model_type);
  EXPECT_EQ(reader.metadata()["model_config"]["num_experts"], 4);
  EXPECT_EQ(reader.metadata()["optimizer"]["step"], 3);
  const auto hf = hf_weights(d);
  EXPECT_TRUE(hf.count("model.layers.0.mlp.experts.3.down_proj.weight"));
  expect_hf_weights_and_state(d);
  expect_reference_logits(d, model_type);
}

TEST(TorchDistReference, ConvertsGroupedGemmMoeThatMfsdpRunsAsTransformers) {
  mfsdp::testing::TempDir dir("mfsdp-torch-dist-moe");
  const std::string d = dir.path().string();
  convert_fixture(d, "--moe grouped --megatron-common-optimizer");
  if (HasFailure()) return;
  // Megatron-FSDP's names: per layer, per expert (TEGroupedMLP's weight<j>), SwiGLU split.
  mfsdp::dcp::Reader raw(d + "/converted/iter_0000003");
  const std::string m = "model.module.decoder.layers.", o = "optimizer.state.module.module.module.decoder.layers.";
  for (const std::string& key : {m + "1.mlp.experts.linear_fc1.weight3_w", m + "1.mlp.experts.linear_fc1.weight3_v",
                                 m + "0.mlp.experts.linear_fc2.weight2", m + "0.mlp.router.weight",
                                 m + "1.pre_mlp_layernorm.weight", m + "0.self_attention.q_layernorm.weight",
                                 o + "1.mlp.experts.linear_fc1.weight0_v.exp_avg_sq",
                                 o + "0.mlp.experts.linear_fc2.weight3.exp_avg"})
    EXPECT_TRUE(raw.contains_tensor(key)) << key;
  for (const auto& [key, entry] : raw.metadata().tensors) EXPECT_EQ(key.find("experts.experts"), std::string::npos) << key;
  EXPECT_EQ(raw.tensor(m + "1.mlp.experts.linear_fc1.weight3_w").shape, (std::vector<int64_t>{16, 32}));
  // Param groups from the ChainedOptimizer's common state: experts in the expert group (2).
  const std::string meta = "optimizer.param_to_group_meta.module.module.module.decoder.layers.";
  EXPECT_EQ(raw.read_object(meta + "1.mlp.experts.linear_fc1.weight3_w.is_expert_parallel"), true);
  EXPECT_EQ(raw.read_object(meta + "1.mlp.experts.linear_fc1.weight3_w.weight_decay"), 0.1);
  EXPECT_EQ(raw.read_object(meta + "1.mlp.router.weight.is_expert_parallel"), false);
  EXPECT_EQ(raw.read_object(meta + "1.self_attention.k_layernorm.weight.weight_decay"), 0.0);
  expect_transformers_model(d, "qwen3_moe");
}

TEST(TorchDistReference, ConvertsSequentialMoeWithSharedExpertAndDenseLayer) {
  mfsdp::testing::TempDir dir("mfsdp-torch-dist-moe");
  const std::string d = dir.path().string();
  convert_fixture(d, "--moe sequential");
  if (HasFailure()) return;
  // SequentialMLP's names (local_experts.<global j>); layer 1 is dense.
  mfsdp::dcp::Reader raw(d + "/converted/iter_0000003");
  const std::string m = "model.module.decoder.layers.";
  for (const std::string& key : {m + "0.mlp.experts.local_experts.3.linear_fc1.weight_w",
                                 m + "0.mlp.experts.local_experts.0.linear_fc2.weight",
                                 m + "0.mlp.shared_experts.linear_fc1.weight_v", m + "0.mlp.shared_experts.gate_weight",
                                 m + "1.mlp.linear_fc1.weight_w",
                                 std::string("optimizer.state.module.module.module.decoder.layers.0.mlp.experts."
                                             "local_experts.2.linear_fc1.weight_v.exp_avg")})
    EXPECT_TRUE(raw.contains_tensor(key)) << key;
  EXPECT_FALSE(raw.contains_tensor(m + "1.mlp.router.weight"));
  EXPECT_EQ(raw.read_object("optimizer.param_to_group_meta.module.module.module.decoder.layers.0.mlp.experts."
                            "local_experts.3.linear_fc1.weight_w.is_expert_parallel"), true);
  expect_transformers_model(d, "qwen2_moe");
}

// The same Llama saved by Megatron with TP 1, 2 and 4 converts to one checkpoint: every tensor
// equal to TP 1's bit for bit (transformers' weights: a chunk put at the wrong offset, or fc1's
// gate / up fragments read as one row block per rank, changes them), every other entry equal but
// the args (their TP) and mfsdp_metadata's converted_from; and the model loads and gives
// transformers' logits.
TEST(TorchDistReference, ConvertsTensorParallelSourcesToTheSameCheckpoint) {
  mfsdp::testing::TempDir dir("mfsdp-torch-dist-tp");
  const std::string d = dir.path().string();
  const std::vector<int> tps = {1, 2, 4};
  for (int tp : tps) convert_fixture(d + "/tp" + std::to_string(tp), "--tensor-parallel " + std::to_string(tp));
  if (HasFailure()) return;
  const std::string one_dir = d + "/tp1";
  const mfsdp::dcp::Reader one(one_dir + "/converted/iter_0000003");
  const nlohmann::json one_meta = one.read_object("mfsdp_metadata");
  for (int tp : tps) {
    const std::string t = d + "/tp" + std::to_string(tp);
    SCOPED_TRACE("TP " + std::to_string(tp));
    // The source as TP `tp` writes it: a file per TP rank, fc1 two chunks per rank and layer.
    const mfsdp::dcp::Reader source(t + "/fixture/torch_dist/iter_0000003");
    std::set<std::string> files;
    for (const auto& [key, entry] : source.metadata().tensors)
      for (const auto& chunk : entry.chunks) files.insert(chunk.location.file);
    EXPECT_EQ(files.size(), static_cast<size_t>(tp));
    EXPECT_EQ(source.tensor("decoder.layers.mlp.linear_fc1.weight").chunks.size(), static_cast<size_t>(2 * 2 * tp));
    EXPECT_EQ(source.tensor("output_layer.weight").chunks.size(), static_cast<size_t>(tp));
    EXPECT_EQ(source.tensor("decoder.final_layernorm.weight").chunks.size(), 1u);

    const mfsdp::dcp::Reader other(t + "/converted/iter_0000003");
    EXPECT_EQ(other.read_object("args", mfsdp::ObjectPolicy::kDescribeObjects)["tensor_model_parallel_size"], tp);
    if (tp == 1) continue;
    std::vector<std::string> one_keys, other_keys;
    for (const auto& [key, entry] : one.metadata().tensors) one_keys.push_back(key);
    for (const auto& [key, entry] : other.metadata().tensors) other_keys.push_back(key);
    ASSERT_EQ(one_keys, other_keys);
    for (const std::string& key : one_keys) {
      EXPECT_EQ(other.tensor(key).dtype, one.tensor(key).dtype) << key;
      EXPECT_TRUE(at::equal(other.read(key), one.read(key))) << key;
    }
    std::vector<std::string> one_objects, other_objects;
    for (const auto& [key, l] : one.metadata().bytes) one_objects.push_back(key);
    for (const auto& [key, l] : other.metadata().bytes) other_objects.push_back(key);
    ASSERT_EQ(one_objects, other_objects);
    for (const std::string& key : one_objects) {
      if (key == "args" || key == "mfsdp_metadata") continue;
      EXPECT_EQ(other.read_bytes(key), one.read_bytes(key)) << key;
    }
    nlohmann::json meta = other.read_object("mfsdp_metadata"), want = one_meta;
    meta["args"].erase("converted_from");
    want["args"].erase("converted_from");
    EXPECT_EQ(meta, want);
  }
  expect_hf_weights_and_state(one_dir);
  expect_hf_weights_and_state(d + "/tp4");
  expect_reference_logits(d + "/tp4", "TP 4 source");
}

TEST(TorchDistReference, RefusesExpertTensorsOutsideMegatronsLayoutNamingThem) {
  mfsdp::testing::TempDir dir("mfsdp-torch-dist-moe");
  const std::string d = dir.path().string();
  const auto outcome = mfsdp::testing::run_command("env OMP_NUM_THREADS=1 '" + kPython + "' '" + kScript + "' '" + d +
                                                   "/fixture' --moe grouped");
  ASSERT_EQ(outcome.exit_code, 0) << outcome.output;
  const std::string good = d + "/fixture/torch_dist/iter_0000003";
  std::ostringstream out;
  // One expert's own key (as singleton_local_shards would write it), not Megatron's stacked one.
  mfsdp::modify_dcp_state_dict(good, d + "/singleton", {"rename experts\\.experts\\.linear_fc2 experts.3.linear_fc2"}, out);
  mfsdp::testing::expect_contains(
      mfsdp::testing::error_of([&] { mfsdp::convert_torch_dist_to_fsdp_dtensor(d + "/singleton", d + "/a", {}, out); }),
      {"'decoder.layers.mlp.experts.3.linear_fc2.weight' is an expert tensor outside Megatron's torch_dist layout"});
  EXPECT_FALSE(fs::exists(d + "/a"));
  // Args that say 8 experts for tensors of 4.
  const auto edited = mfsdp::testing::run_command(
      "'" + kPython + "' -c \"import sys, torch; p = sys.argv[1]; c = torch.load(p, weights_only=False); "
      "c['args'].num_experts = 8; torch.save(c, p)\" '" + good + "/common.pt'");
  ASSERT_EQ(edited.exit_code, 0) << edited.output;
  mfsdp::testing::expect_contains(
      mfsdp::testing::error_of([&] { mfsdp::convert_torch_dist_to_fsdp_dtensor(good, d + "/b", {}, out); }),
      {"'optimizer.state.exp_avg.decoder.layers.mlp.experts.experts.linear_fc1.weight' holds 4 experts per layer, but "
       "common.pt's args have num_experts 8"});
  EXPECT_FALSE(fs::exists(d + "/b"));
}

}  // namespace
