// safetensors reader/writer and HF config (src/checkpoint). The expectations come from the format
// specification, checked with an independent reader and hand-built files written in this test
// (raw bytes, nlohmann::json header), never from the code under test.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "harness/file_bytes.h"
#include "harness/temp_dir.h"
#include "mfsdp/models/llama_hf_config.h"
#include "mfsdp/checkpoint/safetensors.h"
#include "mfsdp/base/directory_tree.h"

namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;
using mfsdp::testing::TempDir;
namespace fs = std::filesystem;

using mfsdp::testing::put;
using mfsdp::testing::slurp;

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

// Independent reader: the 8-byte little-endian length, the JSON header, the raw buffer.
struct Raw {
  uint64_t n = 0;
  std::string header_text;
  ordered_json header;
  std::string buffer;
  std::string bytes(const std::string& name) const {
    const auto& off = header.at(name).at("data_offsets");
    const uint64_t b = off[0].get<uint64_t>(), e = off[1].get<uint64_t>();
    return buffer.substr(b, e - b);
  }
};

Raw parse_raw(const std::string& path) {
  const std::string all = slurp(path);
  Raw r;
  if (all.size() < 8) {
    ADD_FAILURE() << "file shorter than 8 bytes";
    return r;
  }
  for (int i = 7; i >= 0; --i) r.n = (r.n << 8) | static_cast<unsigned char>(all[i]);
  r.header_text = all.substr(8, r.n);
  r.header = ordered_json::parse(r.header_text);
  r.buffer = all.substr(8 + r.n);
  return r;
}

// Independent writer: a file from a header and a buffer, optionally space-padded.
std::string build(const json& header, const std::string& buffer, bool pad = false) {
  std::string text = header.dump();
  if (pad) text.append((8 - text.size() % 8) % 8, ' ');
  return le64(text.size()) + text + buffer;
}

std::string tensor_bytes(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), c.numel() * c.element_size());
}

template <typename T>
std::string pod_bytes(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

// `fn` must throw std::invalid_argument whose message contains every one of `parts`.
void expect_invalid(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
    return;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
    return;
  }
  ADD_FAILURE() << "no exception; expected one naming " << (parts.empty() ? "" : parts.back());
}

std::vector<std::pair<std::string, at::Tensor>> sample_tensors() {
  at::manual_seed(7);
  std::vector<std::pair<std::string, at::Tensor>> t;
  t.push_back({"w.f32", at::randn({3, 5})});
  t.push_back({"w.bf16", at::randn({4, 3}).to(at::kBFloat16).t()});  // non-contiguous
  t.push_back({"ids.i64", at::tensor({INT64_MIN, int64_t{-1}, int64_t{0}, INT64_MAX, int64_t{1} << 40}, at::kLong)});
  t.push_back({"empty", at::empty({0, 4}, at::kFloat)});
  t.push_back({"scalar", at::scalar_tensor(3.25, at::kDouble)});
  t.push_back({"mask", at::tensor({1, 0, 1}, at::kLong).to(at::kBool)});
  t.push_back({"u8", at::arange(0, 250, 7, at::kLong).to(at::kByte)});
  t.push_back({"i8", at::tensor({-128, 0, 127}, at::kLong).to(at::kChar)});
  t.push_back({"i16", at::tensor({-32768, 5, 32767}, at::kLong).to(at::kShort)});
  t.push_back({"i32", at::tensor({-7, 70000}, at::kLong).to(at::kInt)});
  t.push_back({"f16", at::randn({5}).to(at::kHalf)});
  t.push_back({"nan", at::tensor({std::nanf(""), -0.0f, INFINITY})});
  return t;
}

TEST(Safetensors, RoundTripIsBitExact) {
  TempDir dir("st");
  const std::string path = dir.file("a.safetensors");
  const auto tensors = sample_tensors();
  mfsdp::write_safetensors(path, tensors, {{"format", "pt"}, {"note", "héllo"}});

  mfsdp::SafetensorsFile f(path);
  std::vector<std::string> expected_names;
  for (const auto& kv : tensors) expected_names.push_back(kv.first);
  std::sort(expected_names.begin(), expected_names.end());
  EXPECT_EQ(f.names(), expected_names);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(f.metadata().at("note"), "héllo");

  const Raw raw = parse_raw(path);  // independent view of the same file
  for (const auto& [name, t] : tensors) {
    SCOPED_TRACE(name);
    at::Tensor got = f.load(name);
    EXPECT_EQ(got.scalar_type(), t.scalar_type());
    EXPECT_EQ(got.sizes(), t.sizes());
    EXPECT_EQ(f.shape(name), t.sizes().vec());
    EXPECT_EQ(f.dtype(name), t.scalar_type());
    EXPECT_EQ(tensor_bytes(got), tensor_bytes(t));
    EXPECT_EQ(raw.bytes(name), tensor_bytes(t));
    EXPECT_EQ(raw.header.at(name).at("shape").get<std::vector<int64_t>>(), t.sizes().vec());
  }
  EXPECT_EQ(raw.header.at("w.bf16").at("dtype"), "BF16");
  EXPECT_EQ(raw.header.at("ids.i64").at("dtype"), "I64");
  EXPECT_EQ(raw.header.at("mask").at("dtype"), "BOOL");
  EXPECT_TRUE(raw.header.at("scalar").at("shape").is_array());
  EXPECT_EQ(raw.header.at("scalar").at("shape").size(), 0u);
  EXPECT_EQ(raw.header.at("__metadata__").at("note"), "héllo");
  // The loaded tensor is a copy, not a view of anything shared.
  at::Tensor a = f.load("w.f32");
  a.fill_(0);
  EXPECT_EQ(tensor_bytes(f.load("w.f32")), tensor_bytes(tensors[0].second));
}

TEST(Safetensors, HeaderIsPaddedSortedAndTilesTheBuffer) {
  TempDir dir("st");
  const std::string path = dir.file("a.safetensors");
  mfsdp::write_safetensors(path, sample_tensors(), {{"format", "pt"}});
  const Raw raw = parse_raw(path);
  EXPECT_EQ(raw.n % 8, 0u);
  const size_t close = raw.header_text.find_last_of('}');
  ASSERT_NE(close, std::string::npos);
  EXPECT_EQ(raw.header_text.substr(close + 1), std::string(raw.n - close - 1, ' '));
  EXPECT_LT(raw.n - close - 1, 8u);
  EXPECT_EQ(raw.header_text[0], '{');

  // Layout of the safetensors library: __metadata__ first, then entries in buffer order, sorted
  // by dtype (widest first, the library's Dtype order) and then by name, offsets contiguous.
  const std::map<std::string, int> rank{{"BOOL", 0}, {"U8", 1},  {"I8", 2},  {"I16", 3},  {"F16", 5},
                                        {"BF16", 6}, {"I32", 7}, {"F32", 9}, {"F64", 10}, {"I64", 11}};
  auto it = raw.header.begin();
  ASSERT_EQ(it.key(), "__metadata__");
  ++it;
  uint64_t pos = 0;
  int prev_rank = 1000;
  std::string prev_name;
  for (; it != raw.header.end(); ++it) {
    SCOPED_TRACE(it.key());
    const int r = rank.at(it.value().at("dtype").get<std::string>());
    EXPECT_TRUE(r < prev_rank || (r == prev_rank && it.key() > prev_name));
    const uint64_t b = it.value().at("data_offsets")[0], e = it.value().at("data_offsets")[1];
    EXPECT_EQ(b, pos);
    int64_t itemsize = 1;
    const std::string dt = it.value().at("dtype");
    if (dt == "I64" || dt == "F64") itemsize = 8;
    if (dt == "F32" || dt == "I32") itemsize = 4;
    if (dt == "BF16" || dt == "F16" || dt == "I16") itemsize = 2;
    EXPECT_EQ(b % itemsize, 0u) << "unaligned";
    pos = e;
    prev_rank = r;
    prev_name = it.key();
  }
  EXPECT_EQ(pos, raw.buffer.size());
  // Written through a temporary file: nothing else is left in the folder.
  EXPECT_EQ(mfsdp::list_directory(dir.path()).size(), 1u);
}

TEST(Safetensors, ReadsAHandBuiltFile) {
  TempDir dir("st");
  // Buffer order differs from name order; no metadata; header unpadded, then padded.
  const std::string b_bytes = pod_bytes(std::vector<int16_t>{1, -1, 300});
  const std::string a_bytes = pod_bytes(std::vector<float>{1.5f, -2.0f});
  const std::string c_bytes = pod_bytes(std::vector<uint16_t>{0x3f80});  // BF16 1.0, 0-D
  json h;
  h["b"] = {{"dtype", "I16"}, {"shape", {3}}, {"data_offsets", {0, 6}}};
  h["c"] = {{"dtype", "BF16"}, {"shape", json::array()}, {"data_offsets", {6, 8}}};
  h["a"] = {{"dtype", "F32"}, {"shape", {2, 1}}, {"data_offsets", {8, 16}}};
  h["e"] = {{"dtype", "U8"}, {"shape", {0, 3}}, {"data_offsets", {16, 16}}};
  for (bool pad : {false, true}) {
    SCOPED_TRACE(pad);
    const std::string path = dir.file(pad ? "padded.safetensors" : "plain.safetensors");
    put(path, build(h, b_bytes + c_bytes + a_bytes, pad));
    mfsdp::SafetensorsFile f(path);
    EXPECT_EQ(f.names(), (std::vector<std::string>{"a", "b", "c", "e"}));
    EXPECT_TRUE(f.metadata().empty());
    at::Tensor a = f.load("a");
    EXPECT_EQ(a.scalar_type(), at::kFloat);
    EXPECT_EQ(a.sizes().vec(), (std::vector<int64_t>{2, 1}));
    EXPECT_EQ(a[0][0].item<float>(), 1.5f);
    EXPECT_EQ(a[1][0].item<float>(), -2.0f);
    at::Tensor b = f.load("b");
    EXPECT_EQ(b.scalar_type(), at::kShort);
    EXPECT_EQ(b[0].item<int16_t>(), 1);
    EXPECT_EQ(b[1].item<int16_t>(), -1);
    EXPECT_EQ(b[2].item<int16_t>(), 300);
    at::Tensor c = f.load("c");
    EXPECT_EQ(c.scalar_type(), at::kBFloat16);
    EXPECT_EQ(c.dim(), 0);
    EXPECT_EQ(c.item<float>(), 1.0f);
    at::Tensor e = f.load("e");
    EXPECT_EQ(e.scalar_type(), at::kByte);
    EXPECT_EQ(e.sizes().vec(), (std::vector<int64_t>{0, 3}));
  }
  // An empty file with only "{}" is valid and holds nothing.
  const std::string empty = dir.file("empty.safetensors");
  put(empty, build(json::object(), ""));
  EXPECT_TRUE(mfsdp::SafetensorsFile(empty).names().empty());
}

TEST(Safetensors, CorruptFilesNameFileAndTensor) {
  TempDir dir("st");
  const std::string data = pod_bytes(std::vector<float>{1, 2, 3, 4});  // 16 bytes
  auto entry = [](const char* dtype, json shape, uint64_t b, uint64_t e) {
    return json{{"dtype", dtype}, {"shape", shape}, {"data_offsets", {b, e}}};
  };
  auto check = [&](const std::string& fname, const std::string& bytes, std::vector<std::string> parts) {
    SCOPED_TRACE(fname);
    const std::string path = dir.file(fname);
    put(path, bytes);
    parts.insert(parts.begin(), path);
    expect_invalid([&] { mfsdp::SafetensorsFile f(path); }, parts);
  };

  // Sanity: the well-formed version opens.
  json good;
  good["x"] = entry("F32", {2}, 0, 8);
  good["y"] = entry("F32", {2}, 8, 16);
  put(dir.file("good.safetensors"), build(good, data));
  EXPECT_NO_THROW(mfsdp::SafetensorsFile(dir.file("good.safetensors")));

  const std::string good_bytes = build(good, data);
  check("tiny.safetensors", std::string("\x05\x00\x00", 3), {"truncated"});
  check("truncated.safetensors", good_bytes.substr(0, good_bytes.size() - 3), {"'y'"});
  check("longheader.safetensors", le64(1000) + good.dump(), {"header length"});
  check("hugeheader.safetensors", le64(UINT64_MAX) + good.dump(), {"header length"});
  const std::string bad_json = "{\"x\": {\"dtype\": \"F32\",";
  check("badjson.safetensors", le64(bad_json.size()) + bad_json, {"JSON"});
  const std::string not_obj = "[1, 2]  ";
  check("notobject.safetensors", le64(not_obj.size()) + not_obj, {"{"});

  json h = good;
  h["y"] = entry("F8_XYZ", {2}, 8, 16);
  check("dtype.safetensors", build(h, data), {"'y'", "F8_XYZ"});
  h = good;
  h["y"] = entry("F32", {3}, 8, 16);  // 3 floats need 12 bytes, offsets give 8
  check("shape.safetensors", build(h, data), {"'y'", "need 12"});
  h = good;
  h["y"] = entry("F32", {-2}, 8, 16);
  check("negshape.safetensors", build(h, data), {"'y'", "negative"});
  h = good;
  h["y"] = entry("F32", {2}, 4, 12);  // overlaps x
  check("overlap.safetensors", build(h, data + std::string(4, '\0')), {"'y'", "overlap"});
  h = good;
  h["y"] = entry("F32", {2}, 16, 24);  // past the 16-byte buffer
  check("bounds.safetensors", build(h, data), {"'y'", "out of bounds"});
  h = good;
  h["y"] = entry("F32", {2}, 12, 20);  // gap 8..12
  check("gap.safetensors", build(h, data + std::string(4, '\0')), {"'y'", "gap"});
  check("trailing.safetensors", build(good, data + "junk"), {"trailing"});
  h = good;
  h["y"] = {{"dtype", "F32"}, {"shape", {2}}};
  check("nooffsets.safetensors", build(h, data), {"'y'", "data_offsets"});
  h = good;
  h["y"] = {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {8}}};
  check("shortoffsets.safetensors", build(h, data), {"'y'", "data_offsets"});
  h = good;
  h["__metadata__"] = {{"k", 3}};
  check("meta.safetensors", build(h, data), {"__metadata__"});
  const std::string dup =
      R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"x":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})";
  check("duplicate.safetensors", le64(dup.size()) + dup + data, {"'x'", "twice"});

  // A file truncated after open(): load() notices.
  const std::string later = dir.file("later.safetensors");
  put(later, good_bytes);
  mfsdp::SafetensorsFile f(later);
  put(later, good_bytes.substr(0, good_bytes.size() - 4));
  expect_invalid([&] { f.load("y"); }, {later, "'y'"});
  // Unknown tensor name.
  mfsdp::SafetensorsFile g(dir.file("good.safetensors"));
  expect_invalid([&] { g.load("nope"); }, {"good.safetensors", "'nope'"});
  // Missing file.
  expect_invalid([&] { mfsdp::SafetensorsFile m(dir.file("missing.safetensors")); }, {"missing.safetensors"});
}

TEST(Safetensors, WriterRejectsBadInput) {
  TempDir dir("st");
  const std::string path = dir.file("w.safetensors");
  at::Tensor t = at::ones({2});
  expect_invalid([&] { mfsdp::write_safetensors(path, {{"a", t}, {"a", t}}); }, {"'a'"});
  expect_invalid([&] { mfsdp::write_safetensors(path, {{"__metadata__", t}}); }, {"__metadata__"});
  expect_invalid([&] { mfsdp::write_safetensors(path, {{"c", at::ones({2}, at::kComplexFloat)}}); }, {"'c'"});
  EXPECT_FALSE(fs::exists(path));
  // Overwriting replaces the file.
  mfsdp::write_safetensors(path, {{"a", t}});
  mfsdp::write_safetensors(path, {{"b", t * 2}});
  EXPECT_EQ(mfsdp::SafetensorsFile(path).names(), std::vector<std::string>{"b"});
}

std::vector<std::pair<std::string, at::Tensor>> five_tensors() {
  std::vector<std::pair<std::string, at::Tensor>> t;
  for (int i = 0; i < 5; ++i) t.push_back({"layer." + std::to_string(i) + ".w", at::full({100}, float(i))});  // 400 B
  return t;
}

TEST(Safetensors, ShardedFolderSplitsBySizeAndIndexesEverything) {
  TempDir dir("st");
  const std::string d = dir.file("hf");
  const auto tensors = five_tensors();
  auto files = mfsdp::write_safetensors_sharded(d, tensors, 1000);  // 2 + 2 + 1 tensors
  EXPECT_EQ(files, (std::vector<std::string>{"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                                             "model-00003-of-00003.safetensors", "model.safetensors.index.json"}));
  EXPECT_FALSE(fs::exists(d + "/model.safetensors"));
  const json index = json::parse(slurp(d + "/model.safetensors.index.json"));
  EXPECT_EQ(index.at("metadata").at("total_size").get<uint64_t>(), 2000u);
  const json& wm = index.at("weight_map");
  EXPECT_EQ(wm.size(), tensors.size());
  std::map<std::string, std::set<std::string>> by_file;
  for (const auto& [name, t] : tensors) {
    ASSERT_TRUE(wm.contains(name)) << name;
    by_file[wm.at(name).get<std::string>()].insert(name);
  }
  ASSERT_EQ(by_file.size(), 3u);
  for (const auto& [file, names] : by_file) {
    SCOPED_TRACE(file);
    EXPECT_LE(fs::file_size(d + "/" + file), 1000u + 1000u);  // data at most 1000 B plus header
    const Raw raw = parse_raw(d + "/" + file);
    std::set<std::string> in_file;
    uint64_t data = 0;
    for (auto it = raw.header.begin(); it != raw.header.end(); ++it) {
      if (it.key() == "__metadata__") {
        EXPECT_EQ(it.value().at("format"), "pt");
        continue;
      }
      in_file.insert(it.key());
      data += it.value().at("data_offsets")[1].get<uint64_t>() - it.value().at("data_offsets")[0].get<uint64_t>();
    }
    EXPECT_EQ(in_file, names);
    EXPECT_LE(data, 1000u);
  }
  auto back = mfsdp::read_safetensors_folder(d);
  ASSERT_EQ(back.size(), tensors.size());
  for (const auto& [name, t] : tensors) EXPECT_TRUE(at::equal(back.at(name), t)) << name;

  // Small enough: one model.safetensors, and the earlier shards and index are cleaned away.
  files = mfsdp::write_safetensors_sharded(d, tensors, 2000);
  EXPECT_EQ(files, std::vector<std::string>{"model.safetensors"});
  EXPECT_FALSE(fs::exists(d + "/model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(d + "/model-00001-of-00003.safetensors"));
  const Raw single = parse_raw(d + "/model.safetensors");
  EXPECT_EQ(single.header.size(), tensors.size() + 1);  // + __metadata__
  back = mfsdp::read_safetensors_folder(d);
  ASSERT_EQ(back.size(), tensors.size());
  for (const auto& [name, t] : tensors) EXPECT_TRUE(at::equal(back.at(name), t)) << name;

  // A tensor larger than the limit gets a shard of its own.
  const std::string d2 = dir.file("big");
  files = mfsdp::write_safetensors_sharded(d2, {{"small", at::ones({10})}, {"big", at::ones({1000})}, {"tail", at::ones({10})}}, 100);
  EXPECT_EQ(files.size(), 4u);
}

TEST(Safetensors, ShardedFolderErrorsNameTheFile) {
  TempDir dir("st");
  const std::string d = dir.file("hf");
  mfsdp::write_safetensors_sharded(d, five_tensors(), 1000);
  expect_invalid([&] { mfsdp::read_safetensors_folder(dir.file("nothing")); }, {"nothing"});

  // Index maps a tensor to a file that does not hold it.
  json index = json::parse(slurp(d + "/model.safetensors.index.json"));
  const std::string real = index["weight_map"]["layer.0.w"];
  json bad = index;
  bad["weight_map"]["ghost"] = real;
  put(d + "/model.safetensors.index.json", bad.dump());
  expect_invalid([&] { mfsdp::read_safetensors_folder(d); }, {real, "'ghost'"});
  // Index points outside the folder.
  bad = index;
  bad["weight_map"]["layer.0.w"] = "../evil.safetensors";
  put(d + "/model.safetensors.index.json", bad.dump());
  expect_invalid([&] { mfsdp::read_safetensors_folder(d); }, {"'layer.0.w'", "evil"});
  // Missing shard.
  put(d + "/model.safetensors.index.json", index.dump());
  fs::remove(d + "/model-00003-of-00003.safetensors");
  expect_invalid([&] { mfsdp::read_safetensors_folder(d); }, {"model-00003-of-00003.safetensors"});
  // Corrupt shard.
  put(d + "/model-00003-of-00003.safetensors", std::string("garbage"));
  expect_invalid([&] { mfsdp::read_safetensors_folder(d); }, {"model-00003-of-00003.safetensors"});
  put(d + "/model.safetensors.index.json", "{not json");
  expect_invalid([&] { mfsdp::read_safetensors_folder(d); }, {"model.safetensors.index.json"});
}

mfsdp::LlamaConfig small_cfg() {
  mfsdp::LlamaConfig c;
  c.vocab_size = 128;
  c.hidden_size = 64;
  c.intermediate_size = 160;
  c.num_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 256;
  c.rope_theta = 500000;
  c.rms_norm_eps = 1e-6;
  c.tie_word_embeddings = true;
  c.init_std = 0.01;
  return c;
}

TEST(HfLlama, ConfigRoundTrip) {
  const mfsdp::LlamaConfig c = small_cfg();
  const json j = mfsdp::llama_hf_config(c, at::kBFloat16);
  EXPECT_EQ(j.at("architectures"), json::array({"LlamaForCausalLM"}));
  EXPECT_EQ(j.at("model_type"), "llama");
  EXPECT_EQ(j.at("hidden_act"), "silu");
  EXPECT_EQ(j.at("torch_dtype"), "bfloat16");
  EXPECT_EQ(j.at("num_hidden_layers"), 3);
  EXPECT_EQ(j.at("num_key_value_heads"), 2);
  EXPECT_EQ(j.at("intermediate_size"), 160);
  EXPECT_EQ(j.at("max_position_embeddings"), 256);
  EXPECT_EQ(j.at("rope_theta").get<double>(), 500000.0);
  EXPECT_EQ(j.at("rms_norm_eps").get<double>(), 1e-6);
  EXPECT_EQ(j.at("initializer_range").get<double>(), 0.01);
  EXPECT_EQ(j.at("tie_word_embeddings"), true);
  EXPECT_EQ(j.at("vocab_size"), 128);
  EXPECT_TRUE(!j.contains("bos_token_id") || j.at("bos_token_id").is_null());
  EXPECT_EQ(mfsdp::llama_hf_config(c, at::kFloat).at("torch_dtype"), "float32");
  expect_invalid([&] { mfsdp::llama_hf_config(c, at::kLong); }, {"torch_dtype"});

  // Through text, as config.json would be.
  const mfsdp::LlamaConfig b = mfsdp::llama_config_from_hf(json::parse(j.dump(2)));
  EXPECT_EQ(b.vocab_size, c.vocab_size);
  EXPECT_EQ(b.hidden_size, c.hidden_size);
  EXPECT_EQ(b.intermediate_size, c.intermediate_size);
  EXPECT_EQ(b.num_layers, c.num_layers);
  EXPECT_EQ(b.num_attention_heads, c.num_attention_heads);
  EXPECT_EQ(b.num_key_value_heads, c.num_key_value_heads);
  EXPECT_EQ(b.max_position_embeddings, c.max_position_embeddings);
  EXPECT_EQ(b.rope_theta, c.rope_theta);
  EXPECT_EQ(b.rms_norm_eps, c.rms_norm_eps);
  EXPECT_EQ(b.tie_word_embeddings, c.tie_word_embeddings);
  EXPECT_EQ(b.init_std, c.init_std);
}

TEST(HfLlama, ConfigErrorsNameTheField) {
  const json j = mfsdp::llama_hf_config(small_cfg(), at::kFloat);
  for (const char* field : {"hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size",
                            "num_attention_heads", "max_position_embeddings", "model_type"}) {
    json k = j;
    k.erase(std::string(field));
    expect_invalid([&] { mfsdp::llama_config_from_hf(k); }, {field, "missing"});
  }
  json k = j;
  k["hidden_size"] = "64";
  expect_invalid([&] { mfsdp::llama_config_from_hf(k); }, {"hidden_size"});
  k = j;
  k["num_key_value_heads"] = 3;  // does not divide 4 heads
  expect_invalid([&] { mfsdp::llama_config_from_hf(k); }, {"num_key_value_heads"});
  k = j;
  k["attention_bias"] = true;
  expect_invalid([&] { mfsdp::llama_config_from_hf(k); }, {"attention_bias"});
  k = j;
  k["hidden_act"] = "gelu";
  expect_invalid([&] { mfsdp::llama_config_from_hf(k); }, {"hidden_act"});
  k = j;
  k["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  expect_invalid([&] { mfsdp::llama_config_from_hf(k); }, {"rope_scaling"});
  k = j;
  k["model_type"] = "gpt2";
  expect_invalid([&] { mfsdp::llama_config_from_hf(k); }, {"model_type", "gpt2"});
  k = j;
  k["model_type"] = "mistral";
  k["architectures"] = {"MistralForCausalLM"};
  k["sliding_window"] = 4096;
  expect_invalid([&] { mfsdp::llama_config_from_hf(k); }, {"sliding_window"});
  k["sliding_window"] = nullptr;
  EXPECT_NO_THROW(mfsdp::llama_config_from_hf(k));

  // Qwen2-style: accepted (biases are the caller's check); defaults filled in.
  json q = {{"model_type", "qwen2"},        {"vocab_size", 100},          {"hidden_size", 32},
            {"intermediate_size", 64},      {"num_hidden_layers", 2},     {"num_attention_heads", 4},
            {"max_position_embeddings", 64}, {"use_sliding_window", false}, {"sliding_window", 4096}};
  const mfsdp::LlamaConfig qc = mfsdp::llama_config_from_hf(q);
  EXPECT_EQ(qc.num_key_value_heads, 4);
  EXPECT_EQ(qc.rms_norm_eps, 1e-6);
  EXPECT_EQ(qc.rope_theta, 10000.0);
  EXPECT_FALSE(qc.tie_word_embeddings);
  EXPECT_EQ(mfsdp::hf_bias_tensors({"model.layers.0.self_attn.q_proj.bias", "model.norm.weight"}),
            std::vector<std::string>{"model.layers.0.self_attn.q_proj.bias"});
}

}  // namespace
