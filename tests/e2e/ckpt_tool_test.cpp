// mfsdp-ckpt end to end (the binary) plus its library side (include/mfsdp/checkpoint/hf_interop.h,
// ckpt_operations.h, tensor_source.h). Checkpoints are built in this process with
// write_checkpoint from a tiny seeded LlamaForCausalLM; exported folders are checked with a
// safetensors parser written here, and the folders the lossless round trip starts from with a
// safetensors writer written here, both from the format's specification and independent of
// src/checkpoint/formats/safetensors.cpp.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "harness/expect_error.h"
#include "harness/file_bytes.h"
#include "harness/run_command.h"
#include "harness/temp_dir.h"
#include "mfsdp/checkpoint/checkpoint.h"
#include "mfsdp/checkpoint/ckpt_operations.h"
#include "mfsdp/checkpoint/hf_interop.h"
#include "mfsdp/models/llama_hf_config.h"
#include "mfsdp/checkpoint/safetensors.h"
#include "mfsdp/checkpoint/tensor_source.h"
#include "mfsdp/models/llama.h"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;
using mfsdp::testing::error_of;
using mfsdp::testing::expect_contains;
using mfsdp::testing::TempDir;
using Tensors = std::map<std::string, at::Tensor>;

using Outcome = mfsdp::testing::CommandOutcome;

// stdout and stderr together, or stdout alone (for output that must parse as JSON).
Outcome run(const std::string& command, bool with_stderr = true) {
  return mfsdp::testing::run_command(with_stderr ? command : "{ " + command + " 2>/dev/null; }");
}

// The built tool: the environment overrides the path CMake compiled in.
std::string tool() {
  if (const char* v = std::getenv("MFSDP_CKPT_BIN")) return v;
  return MFSDP_CKPT_BIN_PATH;
}

Outcome ckpt(const std::string& args, bool with_stderr = true) { return run(tool() + " " + args, with_stderr); }

mfsdp::LlamaConfig tiny_config(bool tied) {
  mfsdp::LlamaConfig c;
  c.vocab_size = 64;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 32;
  c.rope_theta = 500000;
  c.rms_norm_eps = 1e-5;
  c.tie_word_embeddings = tied;
  return c;
}

// The model's parameters by HF name (copies), seeded.
Tensors model_tensors(const mfsdp::LlamaConfig& cfg, uint64_t seed = 1234) {
  mfsdp::LlamaOptions options;
  options.init_seed = seed;
  mfsdp::LlamaForCausalLM model(cfg, options);
  Tensors out;
  for (const auto& p : model->named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

mfsdp::CheckpointInfo info_for(const mfsdp::LlamaConfig& cfg, int64_t iteration = 5) {
  mfsdp::CheckpointInfo info;
  info.iteration = iteration;
  info.consumed_samples = iteration * 8;
  info.args = {{"--seed", "1234"}};
  info.model_config = mfsdp::llama_hf_config(cfg, at::kFloat);
  info.scheduler = {{"max_lr", 0.001}};
  return info;
}

// Every "model." tensor of a checkpoint, without the prefix.
Tensors read_model(const std::string& path) {
  mfsdp::CheckpointReader reader(path);
  Tensors out;
  for (const auto& n : reader.tensor_names())
    if (n.rfind("model.", 0) == 0) out[n.substr(6)] = reader.read(n);
  return out;
}

void expect_bit_equal(const Tensors& got, const Tensors& want, const std::string& what) {
  std::set<std::string> a, b;
  for (const auto& kv : got) a.insert(kv.first);
  for (const auto& kv : want) b.insert(kv.first);
  ASSERT_EQ(a, b) << what;
  for (const auto& [name, t] : want) {
    const at::Tensor& g = got.at(name);
    EXPECT_EQ(g.scalar_type(), t.scalar_type()) << what << ": " << name;
    EXPECT_EQ(g.sizes(), t.sizes()) << what << ": " << name;
    EXPECT_TRUE(g.scalar_type() == t.scalar_type() && g.sizes() == t.sizes() && at::equal(g, t))
        << what << ": " << name << " differs";
  }
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// ---- Independent safetensors parser (the format specification, not src/checkpoint) ----------

struct RawTensor {
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
};
struct RawFile {
  ordered_json metadata;
  std::map<std::string, RawTensor> tensors;
  std::string buffer;
};

RawFile parse_safetensors(const std::string& path) {
  RawFile f;
  const std::string all = slurp(path);
  EXPECT_GE(all.size(), 8u) << path;
  if (all.size() < 8) return f;
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(all[static_cast<size_t>(i)]);
  EXPECT_LE(8 + n, all.size()) << path;
  EXPECT_EQ(n % 8, 0u) << path << ": header not padded to 8 bytes";
  const ordered_json header = ordered_json::parse(all.substr(8, n));
  f.buffer = all.substr(8 + n);
  const std::map<std::string, uint64_t> item = {{"F32", 4}, {"BF16", 2}, {"F16", 2}, {"F64", 8},
                                                {"I64", 8}, {"I32", 4},  {"U8", 1},  {"BOOL", 1}};
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& [name, e] : header.items()) {
    if (name == "__metadata__") {
      f.metadata = e;
      continue;
    }
    RawTensor t;
    t.dtype = e.at("dtype").get<std::string>();
    t.shape = e.at("shape").get<std::vector<int64_t>>();
    t.begin = e.at("data_offsets")[0].get<uint64_t>();
    t.end = e.at("data_offsets")[1].get<uint64_t>();
    EXPECT_TRUE(item.count(t.dtype)) << path << ": " << name << " dtype " << t.dtype;
    uint64_t numel = 1;
    for (int64_t s : t.shape) numel *= static_cast<uint64_t>(s);
    EXPECT_EQ(t.end - t.begin, numel * (item.count(t.dtype) ? item.at(t.dtype) : 0)) << path << ": " << name;
    ranges.emplace_back(t.begin, t.end);
    f.tensors[name] = t;
  }
  std::sort(ranges.begin(), ranges.end());
  uint64_t next = 0;
  for (const auto& [b, e] : ranges) {
    EXPECT_EQ(b, next) << path << ": data_offsets not contiguous";
    next = e;
  }
  EXPECT_EQ(next, f.buffer.size()) << path << ": the last tensor does not end at the end of the file";
  return f;
}

// The tensor's little-endian bytes as the spec lays them out.
std::string bytes_of(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), c.numel() * c.element_size());
}

// The specification's layout, written here: an 8-byte little-endian header length, the JSON header
// (padded with spaces to 8 bytes), the tensors' bytes in header order. The tensors named in
// `left_out_of_header` keep their bytes but have no header entry: a header a tensor was deleted from.
void write_safetensors_by_hand(const std::string& path, const Tensors& tensors,
                               const std::set<std::string>& left_out_of_header = {}) {
  const std::map<at::ScalarType, std::string> names = {{at::kFloat, "F32"}, {at::kBFloat16, "BF16"}, {at::kHalf, "F16"}};
  ordered_json header = {{"__metadata__", {{"format", "pt"}}}};
  std::string data;
  for (const auto& [name, t] : tensors) {
    const uint64_t begin = data.size();
    data += bytes_of(t);
    if (!left_out_of_header.count(name))
      header[name] = {{"dtype", names.at(t.scalar_type())}, {"shape", t.sizes().vec()}, {"data_offsets", {begin, data.size()}}};
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string length(8, '\0');
  for (int i = 0; i < 8; ++i) length[i] = static_cast<char>((static_cast<uint64_t>(text.size()) >> (8 * i)) & 0xff);
  std::ofstream(path, std::ios::binary) << length << text << data;
}

// config.json as transformers' LlamaConfig.save_pretrained writes it (the fields that matter here).
json hand_written_config(const mfsdp::LlamaConfig& c, const std::string& torch_dtype) {
  return {{"architectures", {"LlamaForCausalLM"}},
          {"model_type", "llama"},
          {"vocab_size", c.vocab_size},
          {"hidden_size", c.hidden_size},
          {"intermediate_size", c.intermediate_size},
          {"num_hidden_layers", c.num_layers},
          {"num_attention_heads", c.num_attention_heads},
          {"num_key_value_heads", c.num_key_value_heads},
          {"max_position_embeddings", c.max_position_embeddings},
          {"rope_theta", c.rope_theta},
          {"rms_norm_eps", c.rms_norm_eps},
          {"tie_word_embeddings", c.tie_word_embeddings},
          {"hidden_act", "silu"},
          {"torch_dtype", torch_dtype}};
}

void write_hf_folder(const std::string& dir, const Tensors& tensors, const json& config) {
  fs::create_directories(dir);
  mfsdp::write_safetensors(dir + "/model.safetensors", {tensors.begin(), tensors.end()}, {{"format", "pt"}});
  std::ofstream(dir + "/config.json") << config.dump(2);
}

}  // namespace

// ---- export-hf / import-hf -------------------------------------------------------------------

TEST(CkptTool, ExportImportRoundTripIsBitExactTiedAndUntied) {
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    TempDir tmp("mfsdp-ckpt");
    const auto cfg = tiny_config(tied);
    const Tensors original = model_tensors(cfg);
    EXPECT_EQ(original.count("lm_head.weight"), tied ? 0u : 1u);
    mfsdp::write_checkpoint(tmp.file("ckpt"), original, info_for(cfg));

    Outcome e = ckpt("export-hf " + tmp.file("ckpt") + " " + tmp.file("hf") + " --dtype fp32");
    ASSERT_EQ(e.exit_code, 0) << e.output;
    const RawFile raw = parse_safetensors(tmp.file("hf/model.safetensors"));
    EXPECT_EQ(raw.tensors.size(), original.size());
    EXPECT_EQ(raw.tensors.count("lm_head.weight"), tied ? 0u : 1u);

    Outcome i = ckpt("import-hf " + tmp.file("hf") + " " + tmp.file("back"));
    ASSERT_EQ(i.exit_code, 0) << i.output;
    expect_bit_equal(read_model(tmp.file("back")), original, "import(export(ckpt))");

    mfsdp::CheckpointReader back(tmp.file("back"));
    EXPECT_EQ(back.metadata()["iteration"], 0);
    EXPECT_EQ(back.metadata()["consumed_samples"], 0);
    EXPECT_TRUE(back.metadata()["optimizer"].is_null());
    EXPECT_EQ(back.metadata()["args"]["imported_from"], tmp.file("hf"));
    EXPECT_EQ(back.metadata()["model_config"], mfsdp::llama_hf_config(cfg, at::kFloat));
    for (const auto& n : back.tensor_names()) EXPECT_EQ(n.rfind("model.", 0), 0u) << "not a model tensor: " << n;

    Outcome c = ckpt("compare " + tmp.file("ckpt") + " " + tmp.file("back"));
    EXPECT_EQ(c.exit_code, 0) << c.output;
    expect_contains(c.output, {"SAME", "model.model.embed_tokens.weight"});
    Outcome h = ckpt("compare " + tmp.file("ckpt") + " " + tmp.file("hf"));
    EXPECT_EQ(h.exit_code, 0) << h.output;
    expect_contains(h.output, {"model.<name>", std::to_string(original.size()) + " tensors: " +
                                                   std::to_string(original.size()) + " equal"});
  }
}

TEST(CkptTool, Bf16ExportEqualsTheBf16RoundedOriginal) {
  TempDir tmp("mfsdp-ckpt");
  const auto cfg = tiny_config(false);
  const Tensors original = model_tensors(cfg);
  mfsdp::write_checkpoint(tmp.file("ckpt"), original, info_for(cfg));
  Outcome e = ckpt("export-hf " + tmp.file("ckpt") + " " + tmp.file("hf") + " --dtype bfloat16");
  ASSERT_EQ(e.exit_code, 0) << e.output;
  EXPECT_EQ(json::parse(slurp(tmp.file("hf/config.json")))["torch_dtype"], "bfloat16");
  const RawFile raw = parse_safetensors(tmp.file("hf/model.safetensors"));
  for (const auto& [name, t] : raw.tensors) EXPECT_EQ(t.dtype, "BF16") << name;

  ASSERT_EQ(ckpt("import-hf " + tmp.file("hf") + " " + tmp.file("back")).exit_code, 0);
  Tensors rounded;
  for (const auto& [name, t] : original) rounded[name] = t.to(at::kBFloat16);
  expect_bit_equal(read_model(tmp.file("back")), rounded, "bf16 export");
  EXPECT_EQ(mfsdp::CheckpointReader(tmp.file("back")).metadata()["model_config"]["torch_dtype"], "bfloat16");

  Outcome exact = ckpt("compare " + tmp.file("ckpt") + " " + tmp.file("hf"));
  EXPECT_EQ(exact.exit_code, 1) << exact.output;
  expect_contains(exact.output, {"DIFFERENT", "dtype F32 vs BF16"});
  Outcome loose = ckpt("compare " + tmp.file("ckpt") + " " + tmp.file("hf") + " --atol 0.01");
  EXPECT_EQ(loose.exit_code, 0) << loose.output;
}

// Without --dtype an export keeps the checkpoint's dtype, so HF -> import-hf -> export-hf gives
// back the folder's bytes (fp32 and bf16 alike); --dtype still casts.
TEST(CkptTool, ImportThenExportWithoutDtypeGivesBackTheFolderByteForByte) {
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    const bool fp32 = dtype == at::kFloat;
    SCOPED_TRACE(fp32 ? "fp32" : "bf16");
    TempDir tmp("mfsdp-ckpt");
    const auto cfg = tiny_config(false);
    Tensors original;
    for (const auto& [name, t] : model_tensors(cfg)) original[name] = t.to(dtype);
    fs::create_directories(tmp.file("in"));
    write_safetensors_by_hand(tmp.file("in/model.safetensors"), original);
    std::ofstream(tmp.file("in/config.json")) << hand_written_config(cfg, fp32 ? "float32" : "bfloat16").dump(2);

    ASSERT_EQ(ckpt("import-hf " + tmp.file("in") + " " + tmp.file("ckpt")).exit_code, 0);
    Outcome e = ckpt("export-hf " + tmp.file("ckpt") + " " + tmp.file("out"));
    ASSERT_EQ(e.exit_code, 0) << e.output;
    expect_contains(e.output, {fp32 ? "fp32 safetensors" : "bf16 safetensors"});
    EXPECT_EQ(json::parse(slurp(tmp.file("out/config.json")))["torch_dtype"], fp32 ? "float32" : "bfloat16");
    const RawFile in = parse_safetensors(tmp.file("in/model.safetensors"));
    const RawFile out = parse_safetensors(tmp.file("out/model.safetensors"));
    ASSERT_EQ(out.tensors.size(), in.tensors.size());
    for (const auto& [name, r] : in.tensors) {
      ASSERT_TRUE(out.tensors.count(name)) << name;
      const RawTensor& w = out.tensors.at(name);
      EXPECT_EQ(w.dtype, r.dtype) << name;
      EXPECT_EQ(w.shape, r.shape) << name;
      EXPECT_EQ(out.buffer.substr(w.begin, w.end - w.begin), in.buffer.substr(r.begin, r.end - r.begin))
          << name << ": bytes differ";
    }
  }
  // --dtype bfloat16 on an fp32 checkpoint: every tensor rounded to bf16 (torch's rounding).
  TempDir tmp("mfsdp-ckpt");
  const auto cfg = tiny_config(true);
  const Tensors original = model_tensors(cfg);
  mfsdp::write_checkpoint(tmp.file("ckpt"), original, info_for(cfg));
  ASSERT_EQ(ckpt("export-hf " + tmp.file("ckpt") + " " + tmp.file("bf16") + " --dtype bfloat16").exit_code, 0);
  const RawFile raw = parse_safetensors(tmp.file("bf16/model.safetensors"));
  ASSERT_EQ(raw.tensors.size(), original.size());
  for (const auto& [name, t] : original) {
    ASSERT_TRUE(raw.tensors.count(name)) << name;
    const RawTensor& r = raw.tensors.at(name);
    EXPECT_EQ(r.dtype, "BF16") << name;
    EXPECT_EQ(raw.buffer.substr(r.begin, r.end - r.begin), bytes_of(t.to(at::kBFloat16))) << name;
  }
}

// The embedding's dtype decides when the model's tensors disagree; one with no safetensors export
// dtype (float64) needs --dtype.
TEST(CkptTool, ExportDtypeOfMixedAndFloat64Checkpoints) {
  TempDir tmp("mfsdp-ckpt");
  const auto cfg = tiny_config(false);
  Tensors mixed = model_tensors(cfg);
  mixed["model.norm.weight"] = mixed["model.norm.weight"].to(at::kBFloat16);
  mfsdp::write_checkpoint(tmp.file("mixed"), mixed, info_for(cfg));
  ASSERT_EQ(ckpt("export-hf " + tmp.file("mixed") + " " + tmp.file("out")).exit_code, 0);
  const RawFile raw = parse_safetensors(tmp.file("out/model.safetensors"));
  for (const auto& [name, t] : mixed) {
    ASSERT_TRUE(raw.tensors.count(name)) << name;
    const RawTensor& r = raw.tensors.at(name);
    EXPECT_EQ(r.dtype, "F32") << name;
    EXPECT_EQ(raw.buffer.substr(r.begin, r.end - r.begin), bytes_of(t.to(at::kFloat))) << name;
  }

  Tensors wide;
  for (const auto& [name, t] : model_tensors(cfg)) wide[name] = t.to(at::kDouble);
  mfsdp::write_checkpoint(tmp.file("f64"), wide, info_for(cfg));
  Outcome r = ckpt("export-hf " + tmp.file("f64") + " " + tmp.file("out64"));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  expect_contains(r.output, {"'model.model.embed_tokens.weight' is F64", "--dtype"});
  EXPECT_FALSE(fs::exists(tmp.file("out64")));
  EXPECT_EQ(ckpt("export-hf " + tmp.file("f64") + " " + tmp.file("out64") + " --dtype fp32").exit_code, 0);
}

TEST(CkptTool, ExportedFolderPassesAnIndependentParserAndConfigMatches) {
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    TempDir tmp("mfsdp-ckpt");
    const auto cfg = tiny_config(tied);
    const Tensors original = model_tensors(cfg);
    mfsdp::write_checkpoint(tmp.file("ckpt"), original, info_for(cfg));
    ASSERT_EQ(ckpt("export-hf " + tmp.file("ckpt") + " " + tmp.file("hf") + " --dtype fp32").exit_code, 0);

    EXPECT_FALSE(fs::exists(tmp.file("hf/model.safetensors.index.json")));
    const RawFile raw = parse_safetensors(tmp.file("hf/model.safetensors"));
    EXPECT_EQ(raw.metadata, ordered_json({{"format", "pt"}}));
    ASSERT_EQ(raw.tensors.size(), original.size());
    for (const auto& [name, t] : original) {
      ASSERT_TRUE(raw.tensors.count(name)) << name;
      const RawTensor& r = raw.tensors.at(name);
      EXPECT_EQ(r.dtype, "F32") << name;
      EXPECT_EQ(r.shape, t.sizes().vec()) << name;
      EXPECT_EQ(raw.buffer.substr(r.begin, r.end - r.begin), bytes_of(t)) << name << ": bytes differ";
    }

    const json config = json::parse(slurp(tmp.file("hf/config.json")));
    EXPECT_EQ(config["architectures"], json::array({"LlamaForCausalLM"}));
    EXPECT_EQ(config["model_type"], "llama");
    EXPECT_EQ(config["hidden_size"], cfg.hidden_size);
    EXPECT_EQ(config["num_hidden_layers"], cfg.num_layers);
    EXPECT_EQ(config["num_attention_heads"], cfg.num_attention_heads);
    EXPECT_EQ(config["num_key_value_heads"], cfg.num_key_value_heads);
    EXPECT_EQ(config["intermediate_size"], cfg.intermediate_size);
    EXPECT_EQ(config["vocab_size"], cfg.vocab_size);
    EXPECT_EQ(config["max_position_embeddings"], cfg.max_position_embeddings);
    EXPECT_EQ(config["rope_theta"].get<double>(), cfg.rope_theta);
    EXPECT_EQ(config["rms_norm_eps"].get<double>(), cfg.rms_norm_eps);
    EXPECT_EQ(config["tie_word_embeddings"], tied);
    EXPECT_EQ(config["torch_dtype"], "float32");
    EXPECT_NE(slurp(tmp.file("hf/config.json")).find("\n  \"architectures\""), std::string::npos)
        << "config.json is not pretty-printed";
  }
}

TEST(CkptTool, ShardedExportHasACompleteIndexAndImportsBitExact) {
  TempDir tmp("mfsdp-ckpt");
  const auto cfg = tiny_config(false);
  const Tensors original = model_tensors(cfg);
  mfsdp::write_checkpoint(tmp.file("ckpt"), original, info_for(cfg));
  Outcome e = ckpt("export-hf " + tmp.file("ckpt") + " " + tmp.file("hf") + " --dtype fp32 --max-shard-size 4KB");
  ASSERT_EQ(e.exit_code, 0) << e.output;
  EXPECT_FALSE(fs::exists(tmp.file("hf/model.safetensors")));
  const json index = json::parse(slurp(tmp.file("hf/model.safetensors.index.json")));
  std::set<std::string> mapped, files;
  for (const auto& [name, file] : index["weight_map"].items()) {
    mapped.insert(name);
    files.insert(file.get<std::string>());
  }
  std::set<std::string> expected;
  uint64_t total = 0;
  for (const auto& [name, t] : original) {
    expected.insert(name);
    total += static_cast<uint64_t>(t.numel()) * 4;
  }
  EXPECT_EQ(mapped, expected);
  EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), total);
  EXPECT_GT(files.size(), 2u);
  for (const std::string& file : files) {
    const RawFile raw = parse_safetensors(tmp.file("hf/" + file));
    EXPECT_EQ(raw.metadata, ordered_json({{"format", "pt"}})) << file;
    uint64_t data = 0;
    for (const auto& [name, t] : raw.tensors) {
      EXPECT_EQ(index["weight_map"][name], file) << name;
      EXPECT_EQ(raw.buffer.substr(t.begin, t.end - t.begin), bytes_of(original.at(name))) << name;
      data += t.end - t.begin;
    }
    // A shard holds at most 4000 bytes unless one tensor alone is larger (the 4096-byte embedding).
    EXPECT_TRUE(data <= 4000 || raw.tensors.size() == 1) << file << " holds " << data << " bytes";
  }
  ASSERT_EQ(ckpt("import-hf " + tmp.file("hf") + " " + tmp.file("back")).exit_code, 0);
  expect_bit_equal(read_model(tmp.file("back")), original, "sharded round trip");
  Outcome c = ckpt("compare " + tmp.file("hf") + " " + tmp.file("back"));
  EXPECT_EQ(c.exit_code, 0) << c.output;
}

TEST(CkptTool, ImportRejectsFoldersThatDoNotMatchTheConfigAndWritesNothing) {
  TempDir tmp("mfsdp-ckpt");
  const auto cfg = tiny_config(false);
  const Tensors good = model_tensors(cfg);
  const json config = mfsdp::llama_hf_config(cfg, at::kFloat);
  struct Case {
    std::string label;
    Tensors tensors;
    json config;
    std::vector<std::string> expected;
  };
  std::vector<Case> cases;
  {
    Case c{"missing", good, config, {"'model.layers.1.mlp.down_proj.weight'", "missing"}};
    c.tensors.erase("model.layers.1.mlp.down_proj.weight");
    cases.push_back(c);
  }
  {
    Case c{"extra", good, config, {"'model.layers.0.self_attn.extra.weight'", "unexpected"}};
    c.tensors["model.layers.0.self_attn.extra.weight"] = at::zeros({2});
    cases.push_back(c);
  }
  {
    Case c{"shape", good, config, {"'model.norm.weight' has shape [17], the config expects [16]"}};
    c.tensors["model.norm.weight"] = at::ones({17});
    cases.push_back(c);
  }
  {
    Case c{"bias", good, config, {"bias", "'model.layers.0.self_attn.q_proj.bias'", "'model.layers.1.self_attn.k_proj.bias'"}};
    c.config["model_type"] = "qwen2";
    c.config["architectures"] = {"Qwen2ForCausalLM"};
    c.tensors["model.layers.0.self_attn.q_proj.bias"] = at::zeros({16});
    c.tensors["model.layers.1.self_attn.k_proj.bias"] = at::zeros({8});
    cases.push_back(c);
  }
  {
    Case c{"gpt2", good, config, {"model_type", "'gpt2'", "config.json"}};
    c.config["model_type"] = "gpt2";
    cases.push_back(c);
  }
  {
    Case c{"tied but different", good, config, {"tie_word_embeddings", "'lm_head.weight'"}};
    c.config["tie_word_embeddings"] = true;
    cases.push_back(c);
  }
  for (const auto& c : cases) {
    SCOPED_TRACE(c.label);
    const std::string in = tmp.file("in_" + std::to_string(&c - cases.data()));
    const std::string out = tmp.file("out_" + std::to_string(&c - cases.data()));
    write_hf_folder(in, c.tensors, c.config);
    Outcome r = ckpt("import-hf " + in + " " + out);
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_EQ(r.output.rfind("mfsdp-ckpt: ", 0), 0u) << r.output;
    for (const std::string& part : c.expected) expect_contains(r.output, {part});
    EXPECT_FALSE(fs::exists(out)) << "something was written to " << out;
  }
}

// A Qwen3-MoE folder's errors in the file's words: config.json's keys (not MoeConfig's top_k,
// moe_layers, topk_scaling_factor, expert_bias) and, for an expert whose header entry was deleted
// (its bytes left behind), the tensor's name rather than only the gap its bytes leave.
TEST(CkptTool, ImportOfAnMoeFolderNamesConfigKeysAndTheMissingExpert) {
  TempDir tmp("mfsdp-ckpt");
  mfsdp::LlamaConfig cfg = tiny_config(false);
  cfg.qk_norm = true;
  cfg.moe.num_experts = 4;
  cfg.moe.top_k = 2;
  cfg.moe.ffn_hidden_size = 8;
  cfg.moe.norm_topk_prob = false;
  const Tensors tensors = model_tensors(cfg);
  const json config = mfsdp::llama_hf_config(cfg, at::kFloat);
  ASSERT_EQ(config["model_type"], "qwen3_moe");
  {
    write_hf_folder(tmp.file("good"), tensors, config);
    Outcome r = ckpt("import-hf " + tmp.file("good") + " " + tmp.file("good_out"));
    ASSERT_EQ(r.exit_code, 0) << r.output;  // the folder the cases below break
  }
  struct Case {
    std::string key;
    json value;
    std::vector<std::string> expected;
  };
  const std::vector<Case> cases = {
      {"num_experts_per_tok", 5, {"'num_experts_per_tok'", "num_experts (4)", "found 5"}},
      {"decoder_sparse_step", 3, {"'decoder_sparse_step'", "3 leaves no MoE layer"}},
      {"mlp_only_layers", {0, 1}, {"'mlp_only_layers'", "[0,1] leaves no MoE layer"}},
      {"moe_router_topk_scaling_factor", -1.5, {"'moe_router_topk_scaling_factor'", "found -1.5"}},
      {"moe_router_enable_expert_bias", true, {"'moe_router_enable_expert_bias'", "sigmoid"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.key);
    const std::string in = tmp.file("in_" + c.key), out = tmp.file("out_" + c.key);
    json bad = config;
    bad[c.key] = c.value;
    write_hf_folder(in, tensors, bad);
    Outcome r = ckpt("import-hf " + in + " " + out);
    EXPECT_EQ(r.exit_code, 1) << r.output;
    expect_contains(r.output, {"mfsdp-ckpt: Hugging Face folder '" + in + "'", "config.json"});
    for (const std::string& part : c.expected) expect_contains(r.output, {part});
    for (const char* internal : {"'top_k'", "'moe_layers'", "'topk_scaling_factor'", "'expert_bias'"})
      EXPECT_EQ(r.output.find(internal), std::string::npos) << r.output;
    EXPECT_FALSE(fs::exists(out));
  }

  const std::string lost = "model.layers.0.mlp.experts.3.down_proj.weight";
  ASSERT_TRUE(tensors.count(lost));
  const std::string in = tmp.file("in_lost"), out = tmp.file("out_lost");
  fs::create_directories(in);
  write_safetensors_by_hand(in + "/model.safetensors", tensors, {lost});
  std::ofstream(in + "/config.json") << config.dump(2);
  Outcome r = ckpt("import-hf " + in + " " + out);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  expect_contains(r.output, {"mfsdp-ckpt: Hugging Face folder '" + in + "': missing tensor(s) '" + lost + "'"});
  EXPECT_FALSE(fs::exists(out));
}

TEST(CkptTool, ImportAcceptsTiedHeadsRopeBuffersAndQwen2WithoutBiases) {
  TempDir tmp("mfsdp-ckpt");
  const auto cfg = tiny_config(true);
  Tensors tensors = model_tensors(cfg);
  const Tensors expected = tensors;
  tensors["lm_head.weight"] = tensors.at("model.embed_tokens.weight").clone();  // saved tied: equal copy
  tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = at::ones({2});
  json config = mfsdp::llama_hf_config(cfg, at::kFloat);
  config["model_type"] = "qwen2";
  config["architectures"] = {"Qwen2ForCausalLM"};
  write_hf_folder(tmp.file("hf"), tensors, config);
  Outcome r = ckpt("import-hf " + tmp.file("hf") + " " + tmp.file("out"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_bit_equal(read_model(tmp.file("out")), expected, "tied import");
  EXPECT_EQ(mfsdp::CheckpointReader(tmp.file("out")).metadata()["model_config"]["model_type"], "llama");
}

TEST(CkptTool, ExportRefusesCheckpointsWithoutConfigOrWithOtherTensors) {
  TempDir tmp("mfsdp-ckpt");
  const auto cfg = tiny_config(false);
  Tensors tensors = model_tensors(cfg);
  mfsdp::CheckpointInfo no_config = info_for(cfg);
  no_config.model_config = json::object();
  mfsdp::write_checkpoint(tmp.file("bare"), tensors, no_config);
  Outcome r = ckpt("export-hf " + tmp.file("bare") + " " + tmp.file("out1"));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  expect_contains(r.output, {"mfsdp-ckpt: ", tmp.file("bare"), "model_config"});
  EXPECT_FALSE(fs::exists(tmp.file("out1")));

  tensors["model.layers.0.mlp.extra.weight"] = at::zeros({3});
  tensors["model.norm.weight"] = at::ones({15});
  mfsdp::write_checkpoint(tmp.file("odd"), tensors, info_for(cfg));
  r = ckpt("export-hf " + tmp.file("odd") + " " + tmp.file("out2"));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  expect_contains(r.output, {"'model.layers.0.mlp.extra.weight'", "'model.norm.weight' has shape [15]"});
  EXPECT_FALSE(fs::exists(tmp.file("out2")));
}

// ---- convert ---------------------------------------------------------------------------------

TEST(CkptTool, ConvertReadsTorchSaveFiles) {
  const std::string fixtures = std::string(MFSDP_FIXTURES_DIR) + "/torch_save/";
  ASSERT_TRUE(fs::exists(fixtures + "state_dict.pt") && fs::exists(fixtures + "nested.pt"))
      << "the torch.save fixtures (ctest setup test TorchSaveFixtures) are missing from " << fixtures;
  TempDir tmp("mfsdp-ckpt");
  // state_dict.pt: Linear(4, 3) + LayerNorm(3) (scripts/make_torch_save_fixtures.py).
  Outcome r = ckpt("convert " + fixtures + "state_dict.pt " + tmp.file("sd") +
                   " --remove 'norm\\..*' --rename proj.=fc. --iteration 3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(mfsdp::is_checkpoint(tmp.file("sd/iter_0000003"))) << r.output;
  const Tensors sd = read_model(tmp.file("sd"));
  ASSERT_EQ(sd.size(), 2u) << r.output;
  EXPECT_TRUE(at::equal(sd.at("fc.weight"), at::arange(12, at::kFloat).reshape({3, 4}) / 8));
  EXPECT_TRUE(at::equal(sd.at("fc.bias"), at::arange(3, at::kFloat) - 1));
  EXPECT_EQ(mfsdp::CheckpointReader(tmp.file("sd")).metadata()["iteration"], 3);

  // nested.pt: flattened keys, views of one storage, other dtypes; the optimizer part removed.
  r = ckpt("convert " + fixtures + "nested.pt " + tmp.file("nested") + " --remove 'optim\\..*'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const Tensors nested = read_model(tmp.file("nested"));
  for (const auto& [name, t] : nested) EXPECT_EQ(name.rfind("model.", 0), 0u) << name;
  const at::Tensor base = at::arange(24, at::kFloat).reshape({4, 6});
  EXPECT_TRUE(at::equal(nested.at("model.row"), base[2]));
  EXPECT_TRUE(at::equal(nested.at("model.t_slice"), base.t().slice(0, 1, 4).slice(1, 0, 4, 2)));
  EXPECT_TRUE(at::equal(nested.at("model.one.only"), at::arange(4, at::kInt)));
  EXPECT_TRUE(at::equal(nested.at("model.bf16"), (at::arange(6, at::kFloat).reshape({2, 3}) - 2.5).to(at::kBFloat16)));
}

TEST(CkptTool, ConvertSplitsSwigluRenamesAndRemoves) {
  TempDir tmp("mfsdp-ckpt");
  // Megatron-style names in a checkpoint (convert also accepts checkpoints), kept as they are: in
  // mfsdp's own layout, since a fsdp_dtensor (DCP) checkpoint's Megatron GPT names are read as the
  // Llama's (src/checkpoint/megatron_gpt_names.h) and would not reach the transforms raw.
  const Tensors megatron = {
      {"decoder.layers.0.mlp.linear_fc1.weight", at::arange(24, at::kFloat).reshape({6, 4})},
      {"decoder.layers.0.mlp.linear_fc2.weight", at::arange(12, at::kFloat).reshape({4, 3}) * -1},
      {"decoder.layers.0.mlp.linear_fc1.layer_norm_weight", at::ones({4})},
      {"decoder.layers.0.self_attention.linear_qkv._extra_state", at::zeros({5}, at::kByte)},
      {"decoder.layers.1.mlp.fc1.weight", at::arange(8, at::kFloat).reshape({4, 2}) + 100},
      {"decoder.final_layernorm.weight", at::full({4}, 2.0)},
  };
  mfsdp::CheckpointInfo info;
  info.iteration = 9;
  info.model_config = {{"model_type", "megatron-gpt"}};
  mfsdp::write_checkpoint(tmp.file("in"), megatron, info, mfsdp::CheckpointFormat::kMfsdp);

  Outcome r = ckpt("convert " + tmp.file("in") + " " + tmp.file("out") +
                   " --swiglu --op 'remove _extra_state$' --op 'rename ^decoder\\.(.*)\\.linear_fc2\\. model.\\1.down_proj.'"
                   " --rename '^decoder\\.=model.'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const Tensors out = read_model(tmp.file("out"));
  std::set<std::string> names;
  for (const auto& kv : out) names.insert(kv.first);
  EXPECT_EQ(names, (std::set<std::string>{"model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
                                          "model.layers.0.mlp.down_proj.weight",
                                          "model.layers.0.mlp.linear_fc1.layer_norm_weight",
                                          "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight",
                                          "model.final_layernorm.weight"}));
  const at::Tensor fc1 = megatron.at("decoder.layers.0.mlp.linear_fc1.weight");
  EXPECT_TRUE(at::equal(out.at("model.layers.0.mlp.gate_proj.weight"), fc1.slice(0, 0, 3)));
  EXPECT_TRUE(at::equal(out.at("model.layers.0.mlp.up_proj.weight"), fc1.slice(0, 3, 6)));
  EXPECT_TRUE(at::equal(out.at("model.layers.1.mlp.gate_proj.weight"),
                        at::arange(4, at::kFloat).reshape({2, 2}) + 100));
  EXPECT_TRUE(at::equal(out.at("model.layers.1.mlp.up_proj.weight"),
                        at::arange(4, 8, at::kFloat).reshape({2, 2}) + 100));
  EXPECT_TRUE(at::equal(out.at("model.layers.0.mlp.down_proj.weight"),
                        megatron.at("decoder.layers.0.mlp.linear_fc2.weight")));
  mfsdp::CheckpointReader reader(tmp.file("out"));
  EXPECT_EQ(reader.metadata()["model_config"], info.model_config) << "model_config not copied";
  EXPECT_EQ(reader.metadata()["iteration"], 0);
  EXPECT_TRUE(reader.metadata()["optimizer"].is_null());

  // Two tensors renamed onto one name: both named, nothing written.
  r = ckpt("convert " + tmp.file("in") + " " + tmp.file("collide") + " --rename fc2=fc1");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  expect_contains(r.output, {"'decoder.layers.0.mlp.linear_fc1.weight'", "'decoder.layers.0.mlp.linear_fc2.weight'"});
  EXPECT_FALSE(fs::exists(tmp.file("collide")));
  // A split half landing on an existing name.
  r = ckpt("convert " + tmp.file("in") + " " + tmp.file("collide") + " --swiglu --rename up_proj=gate_proj");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  expect_contains(r.output, {"'decoder.layers.0.mlp.gate_proj.weight'"});

  // An odd first dimension cannot be split.
  mfsdp::write_checkpoint(tmp.file("odd"), {{"layers.0.mlp.linear_fc1.weight", at::zeros({5, 4})}}, {});
  r = ckpt("convert " + tmp.file("odd") + " " + tmp.file("odd_out") + " --swiglu");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  expect_contains(r.output, {"'layers.0.mlp.linear_fc1.weight'", "[5, 4]"});
  EXPECT_FALSE(fs::exists(tmp.file("odd_out")));

  // An HF folder as input: its config.json becomes the model_config.
  write_hf_folder(tmp.file("hf"), {{"model.layers.0.mlp.fc1.weight", at::arange(8, at::kFloat).reshape({4, 2})}},
                  {{"model_type", "custom"}});
  r = ckpt("convert " + tmp.file("hf") + " " + tmp.file("from_hf") + " --swiglu");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const Tensors from_hf = read_model(tmp.file("from_hf"));
  EXPECT_EQ(from_hf.size(), 2u);
  EXPECT_TRUE(at::equal(from_hf.at("model.layers.0.mlp.up_proj.weight"), at::arange(4, 8, at::kFloat).reshape({2, 2})));
  EXPECT_EQ(mfsdp::CheckpointReader(tmp.file("from_hf")).metadata()["model_config"]["model_type"], "custom");
}

TEST(CkptTool, StateTransformLibrary) {
  // Megatron's modify-state-dict semantics; the expected names are what Python's re gives for the
  // same ops (re.search to remove; the first rename whose pattern is found, re.sub, then break).
  mfsdp::StateTransform t;
  for (const char* op : {"remove ^b\\.", "rename ^layers\\.(\\d+)\\.fc(\\d) blocks.\\1.mlp\\g<2>0$", "rename a x",
                         "rename x y"})
    t.ops.add(op);
  Tensors in;
  for (const char* name : {"aa.w", "b.w", "xb.w", "c.ab.w2", "layers.3.fc1.weight", "layers.12.fc2.bias"})
    in.emplace(name, at::zeros({1}));
  const Tensors out = mfsdp::apply_state_transform(in, t);
  std::set<std::string> names;
  for (const auto& kv : out) names.insert(kv.first);
  // "aa.w": only the first matching rename applies, though its result "xx.w" matches "x".
  EXPECT_EQ(names, (std::set<std::string>{"xx.w", "yb.w", "c.xb.w2", "blocks.3.mlp10$.weight", "blocks.12.mlp20$.bias"}));

  mfsdp::StateDictOps ops;
  expect_contains(error_of([&] { ops.add("remove (", "--op"); }), {"--op 'remove ('", "'('", "not a valid regular"});
  expect_contains(error_of([&] { ops.add("rename a"); }), {"--op 'rename a'", "expected"});
  expect_contains(error_of([&] { ops.add("prune a"); }), {"--op 'prune a'", "expected"});
  expect_contains(error_of([&] { ops.add_rename("a", "\\g<x>", "--rename"); }), {"--rename", "group number"});
  expect_contains(error_of([&] { ops.add_rename("a", "\\q", "--rename"); }), {"--rename", "bad escape"});
  EXPECT_TRUE(ops.empty());
  ops.add_rename("w$", "\\\\$&", "--rename");  // Python: a backslash, then a literal "$&"
  EXPECT_EQ(ops.renamed("a.w"), "a.\\$&");

  EXPECT_EQ(mfsdp::parse_byte_size("500MB"), 500000000u);
  EXPECT_EQ(mfsdp::parse_byte_size("2GB"), 2000000000u);
  EXPECT_EQ(mfsdp::parse_byte_size("1.5gb"), 1500000000u);
  EXPECT_EQ(mfsdp::parse_byte_size("64KiB"), 65536u);
  EXPECT_EQ(mfsdp::parse_byte_size("12345"), 12345u);
  for (const char* bad : {"", "GB", "5XB", "-1", "1.2.3", "0"})
    expect_contains(error_of([&] { mfsdp::parse_byte_size(bad); }), {"not a size"});
}

// ---- inspect / print-tensor / compare ----------------------------------------------------------

TEST(CkptTool, InspectPrintsTheMetadataAndTensorsAsJson) {
  TempDir tmp("mfsdp-ckpt");
  const auto cfg = tiny_config(false);
  const Tensors original = model_tensors(cfg);
  mfsdp::write_checkpoint(tmp.file("ckpt"), original, info_for(cfg, 7));
  // checkpoint_inspector.py's report: DCP keys, torch dtypes and shapes.
  Outcome text = ckpt("inspect " + tmp.file("ckpt"), false);
  ASSERT_EQ(text.exit_code, 0) << text.output;
  expect_contains(text.output, {"=== SHARDED TENSORS METADATA ===", "Total Tensors: " + std::to_string(original.size()),
                                "model.module.model.norm.weight [torch.float32, shape=(16,)]",
                                "mfsdp_metadata [BYTES]", "iteration [BYTES]"});
  for (const std::string& path : {tmp.file("ckpt"), tmp.file("ckpt/iter_0000007")}) {
    Outcome r = ckpt("inspect --json " + path, /*with_stderr=*/false);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const json j = json::parse(r.output);
    EXPECT_EQ(j["format"], "mfsdp.fsdp_dtensor");
    EXPECT_EQ(j["iteration"], 7);
    EXPECT_EQ(j["consumed_samples"], 56);
    EXPECT_EQ(j["world_size"], 1);
    EXPECT_EQ(j["args"]["--seed"], "1234");
    EXPECT_EQ(j["model_config"]["hidden_size"], 16);
    EXPECT_EQ(j["scheduler"]["max_lr"], 0.001);
    EXPECT_TRUE(j.contains("optimizer"));
    ASSERT_EQ(j["tensors"].size(), original.size());
    int64_t params = 0;
    for (const auto& [name, t] : original) {
      const json& e = j["tensors"]["model." + name];
      EXPECT_EQ(e["shape"].get<std::vector<int64_t>>(), t.sizes().vec()) << name;
      EXPECT_EQ(e["dtype"], "F32") << name;
      EXPECT_EQ(e["chunks"], 1) << name;
      params += t.numel();
    }
    EXPECT_EQ(j["summary"]["model_parameters"], params);
    EXPECT_EQ(r.output.find("\"bytes\""), std::string::npos) << "byte offsets without --chunks";
  }
  Outcome r = ckpt("inspect --json --chunks " + tmp.file("ckpt"), false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const json chunks = json::parse(r.output)["tensors"]["model.model.norm.weight"]["chunks"];
  ASSERT_TRUE(chunks.is_array() && chunks.size() == 1) << chunks;
  // The chunk's extent as the format records it: a count of elements (mfsdp's metadata.json) or
  // a DCP chunk's sizes (fsdp_dtensor, the default).
  const json& c = chunks[0];
  EXPECT_TRUE(c.contains("numel") ? c["numel"] == 16 : c["sizes"] == json::array({16})) << c;
  EXPECT_TRUE(c.contains("bytes")) << c;
}

// verify: every byte against the save's checksums, both formats; a flipped byte anywhere fails
// naming the file and range; a checkpoint without checksums cannot pass.
TEST(CkptTool, VerifyChecksEveryByteAgainstTheSavedChecksums) {
  TempDir tmp("mfsdp-ckpt");
  const auto cfg = tiny_config(false);
  const Tensors original = model_tensors(cfg);
  for (auto format : {mfsdp::CheckpointFormat::kFsdpDtensor, mfsdp::CheckpointFormat::kMfsdp}) {
    const bool dcp = format == mfsdp::CheckpointFormat::kFsdpDtensor;
    const std::string dir = tmp.file(dcp ? "dcp" : "old");
    mfsdp::write_checkpoint(dir, original, info_for(cfg, 0), format);
    Outcome good = ckpt("verify " + dir);
    ASSERT_EQ(good.exit_code, 0) << good.output;
    // DCP: every tensor plus the non-tensor entries; the earlier format: one chunk per tensor.
    expect_contains(good.output, {"iter_0000000: ", " bytes match their CRC-32C"});
    const std::string file = dir + "/iter_0000000/" + (dcp ? "__0_0.distcp" : "rank_00000.safetensors");
    std::string bytes = mfsdp::testing::slurp(file);
    const size_t at = bytes.size() / 2;
    bytes[at] = static_cast<char>(bytes[at] ^ 0x40);
    mfsdp::testing::put(file, bytes);
    Outcome bad = ckpt("verify " + dir);
    EXPECT_EQ(bad.exit_code, 1);
    expect_contains(bad.output, {file, "bytes [", "tensor '", "do not match their checksum"});
  }
  fs::remove(tmp.file("dcp/iter_0000000/.checksums.json"));
  Outcome none = ckpt("verify " + tmp.file("dcp"));
  EXPECT_EQ(none.exit_code, 1);
  expect_contains(none.output, {".checksums.json", "cannot be verified"});
}

TEST(CkptTool, PrintTensorShowsValuesAndStatistics) {
  TempDir tmp("mfsdp-ckpt");
  const auto cfg = tiny_config(false);
  Tensors tensors = model_tensors(cfg);
  tensors["model.norm.weight"] = at::arange(16, at::kFloat);
  tensors["model.embed_tokens.weight"] = (at::arange(64 * 16, at::kFloat) / 4).reshape({64, 16});
  mfsdp::write_checkpoint(tmp.file("ckpt"), tensors, info_for(cfg));

  Outcome r = ckpt("print-tensor " + tmp.file("ckpt") + " model.model.norm.weight");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_contains(r.output, {"model.model.norm.weight", "F32", "[16]", "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15\n",
                             "min     0\n", "max     15\n", "mean    7.5\n"});
  EXPECT_EQ(r.output.find("first"), std::string::npos) << r.output;

  r = ckpt("print-tensor " + tmp.file("ckpt") + " model.norm.weight --max-elements 4");  // "model." left out
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_contains(r.output, {"model.model.norm.weight", "the first 4 of 16", "0 1 2 3 ...\n", "max     15\n"});

  r = ckpt("print-tensor " + tmp.file("ckpt/iter_0000005") + " model.model.embed_tokens.weight --max-elements 20");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_contains(r.output, {"[64, 16]", "[0, :]  0 0.25 0.5 0.75 1", "[1, :]  4 4.25 4.5 4.75 ...\n",
                             "max     255.75\n"});

  r = ckpt("print-tensor " + tmp.file("ckpt") + " model.no.such.weight");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  expect_contains(r.output, {"mfsdp-ckpt: ", "'model.no.such.weight'"});
}

TEST(CkptTool, CompareReportsEveryDifference) {
  TempDir tmp("mfsdp-ckpt");
  const auto cfg = tiny_config(false);
  const Tensors original = model_tensors(cfg);
  mfsdp::write_checkpoint(tmp.file("a"), original, info_for(cfg));
  Tensors changed = original;
  changed["model.norm.weight"] = changed["model.norm.weight"].clone();
  changed["model.norm.weight"][3] += 0.5;
  changed["model.extra"] = at::zeros({2});
  mfsdp::write_checkpoint(tmp.file("b"), changed, info_for(cfg));
  Tensors reshaped = original;
  reshaped["lm_head.weight"] = at::zeros({63, 16});
  mfsdp::write_checkpoint(tmp.file("c"), reshaped, info_for(cfg));

  Outcome same = ckpt("compare " + tmp.file("a") + " " + tmp.file("a/iter_0000005"));
  EXPECT_EQ(same.exit_code, 0) << same.output;
  expect_contains(same.output, {"SAME", std::to_string(original.size()) + " equal"});

  Outcome diff = ckpt("compare " + tmp.file("a") + " " + tmp.file("b"));
  EXPECT_EQ(diff.exit_code, 1) << diff.output;
  expect_contains(diff.output, {"DIFFERENT 0.5           model.model.norm.weight\n", "ONLY-B    -             model.model.extra\n",
                                "1 different", "1 only in B"});
  // Within --atol the changed tensor counts as equal, the extra one still does not.
  Outcome loose = ckpt("compare " + tmp.file("a") + " " + tmp.file("b") + " --atol 0.5");
  EXPECT_EQ(loose.exit_code, 1) << loose.output;
  expect_contains(loose.output, {"0 different", "1 only in B"});

  Outcome shape = ckpt("compare " + tmp.file("a") + " " + tmp.file("c"));
  EXPECT_EQ(shape.exit_code, 1) << shape.output;
  expect_contains(shape.output, {"SHAPE", "model.lm_head.weight  shape [64, 16] vs [63, 16]"});

  // The library call agrees.
  mfsdp::CompareOptions exact;
  exact.atol = exact.rtol = 0;
  const auto report = mfsdp::compare_tensors(mfsdp::TensorSource(tmp.file("a")), mfsdp::TensorSource(tmp.file("b")), exact);
  EXPECT_FALSE(report.same);
  for (const auto& row : report.rows)
    if (row.name == "model.model.norm.weight") {
      EXPECT_EQ(row.max_abs_diff, 0.5);
    }
}

// compare-two-checkpoint is Megatron's name and `compare` its alias: one command, one output.
// Its default is Megatron's allclose (rtol 1e-5, atol 1e-8): a change of one part in 10^7 passes,
// one in 10^4 does not; --atol 0 --rtol 0 asks for the same bits.
TEST(CkptTool, CompareTwoCheckpointIsAllcloseAndCompareItsAlias) {
  TempDir tmp("mfsdp-ckpt");
  const auto cfg = tiny_config(false);
  const Tensors original = model_tensors(cfg);
  mfsdp::write_checkpoint(tmp.file("a"), original, info_for(cfg));
  for (const auto& [name, scale] : {std::pair{"tiny", 1 + 1e-7}, std::pair{"small", 1 + 1e-4}}) {
    Tensors changed = original;
    changed["model.norm.weight"] = (changed["model.norm.weight"].to(at::kDouble) * scale).to(at::kFloat);
    mfsdp::write_checkpoint(tmp.file(name), changed, info_for(cfg));
  }
  Outcome tiny = ckpt("compare-two-checkpoint " + tmp.file("a") + " " + tmp.file("tiny"));
  EXPECT_EQ(tiny.exit_code, 0) << tiny.output;
  expect_contains(tiny.output, {"Comparing checkpoints...", "(allclose: rtol 1e-05, atol 1e-08): SAME",
                                "Comparison between " + tmp.file("a") + " and " + tmp.file("tiny") + " completed."});
  Outcome alias = ckpt("compare " + tmp.file("a") + " " + tmp.file("tiny"));
  EXPECT_EQ(alias.exit_code, 0);
  EXPECT_EQ(alias.output, tiny.output);

  Outcome bits = ckpt("compare " + tmp.file("a") + " " + tmp.file("tiny") + " --atol 0 --rtol 0");
  EXPECT_EQ(bits.exit_code, 1) << bits.output;
  expect_contains(bits.output, {"DIFFERENT", "model.model.norm.weight", "1 different"});

  Outcome small = ckpt("compare-two-checkpoint " + tmp.file("a") + " " + tmp.file("small"));
  EXPECT_EQ(small.exit_code, 1) << small.output;
  expect_contains(small.output, {"DIFFERENT", "1 different"});
  EXPECT_EQ(ckpt("compare-two-checkpoint " + tmp.file("a") + " " + tmp.file("small") + " --rtol 1e-3").exit_code, 0);
}

TEST(CkptTool, BadUsageExitsTwoNamingTheProblem) {
  TempDir tmp("mfsdp-ckpt");
  struct Case {
    std::string args, expected;
  } cases[] = {
      {"", "subcommand"},
      {"frobnicate x", "'frobnicate'"},
      {"inspect", "CKPT"},
      {"inspect x --bogus", "--bogus"},
      {"compare a", "B"},
      {"compare-two-checkpoint a b --rtol -1", "--rtol"},
      {"compare-two-checkpoint a b --atol x", "--atol"},
      {"print-tensor a b --max-elements -1", "--max-elements"},
      {"export-hf a b --dtype int8", "--dtype"},
      {"export-hf a b --max-shard-size lots", "--max-shard-size"},
      {"convert a b --rename nothing", "--rename"},
      {"convert a b --remove '('", "--remove"},
      {"convert a b --op 'remove'", "--op"},
      {"convert a b --op 'rename (x y'", "--op"},
      {"convert a b --iteration -3", "--iteration"},
      {"convert a b --iteration 1e20", "--iteration"},
      {"convert a b --iteration 1000000000", "--iteration"},
      {"import-hf onlyone", "OUT_CKPT"},
  };
  for (const auto& c : cases) {
    Outcome r = ckpt(c.args);
    EXPECT_EQ(r.exit_code, 2) << c.args << "\n" << r.output;
    expect_contains(r.output, {"mfsdp-ckpt: ", c.expected});
  }
  // A well-formed command on something that is not a checkpoint is a failure (1), not bad usage.
  Outcome r = ckpt("inspect " + tmp.file("nothing"));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  expect_contains(r.output, {"mfsdp-ckpt: ", tmp.file("nothing")});
  r = ckpt("compare " + tmp.file("nothing") + " " + tmp.file("nothing"));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  expect_contains(r.output, {"neither a checkpoint", tmp.file("nothing")});
  EXPECT_EQ(ckpt("--help").exit_code, 0);
}
