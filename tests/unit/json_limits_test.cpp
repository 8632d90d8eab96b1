// The JSON nesting limit (mfsdp/base/json_parse.h): documents nested past kMaxJsonDepth are
// refused while they are read, naming the JSON path, however deep they go (50,000 and 1,000,000
// levels, which crashed json::parse's users); every other document parses exactly as
// nlohmann::json::parse parses it (the reference: same dumps, same errors). Also the readers that
// parse through it in mfsdp_data (JSONL datasets, rewards, dataset checksums) name the file.
// Times are printed, not asserted.
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "harness/temp_dir.h"
#include "mfsdp/base/json_parse.h"
#include "mfsdp/data/dataset_checksums.h"
#include "mfsdp/data/posttrain/chat_dataset.h"
#include "mfsdp/data/posttrain/rewards.h"

namespace {

using mfsdp::kMaxJsonDepth;
using mfsdp::parse_json;
using mfsdp::try_parse_json;
using nlohmann::json;

std::string repeat(const std::string& s, size_t n) {
  std::string out;
  out.reserve(s.size() * n);
  for (size_t i = 0; i < n; ++i) out += s;
  return out;
}

// `levels` nested arrays around 0, closed or left open (a hostile file need not be complete).
std::string nested_arrays(size_t levels, bool closed = true) {
  return repeat("[", levels) + "0" + (closed ? repeat("]", levels) : "");
}
// `levels` nested objects {"a":{"a":...1...}}.
std::string nested_objects(size_t levels, bool closed = true) {
  return repeat("{\"a\":", levels) + "1" + (closed ? repeat("}", levels) : "");
}
// A tokenizer.json whose normalizer is a Sequence of Sequences `levels` deep: the file of issue
// 45's report (the normalizer object, then its list, per level).
std::string nested_normalizers(size_t levels) {
  std::string s = "{\"version\":\"1.0\",\"normalizer\":";
  for (size_t i = 0; i < levels; ++i) s += "{\"type\":\"Sequence\",\"normalizers\":[";
  s += "{\"type\":\"NFC\"}";
  for (size_t i = 0; i < levels; ++i) s += "]}";
  return s + ",\"model\":{\"type\":\"BPE\",\"vocab\":{},\"merges\":[]}}";
}

// Runs `f`, expecting a nlohmann::json::exception; returns its what(), and prints how long it took.
template <class F>
std::string refusal_of(const std::string& what, F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  try {
    f();
  } catch (const json::exception& e) {
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    std::cout << "  " << what << ": refused in " << ms << " ms: " << e.what() << "\n";
    return e.what();
  }
  ADD_FAILURE() << what << ": not refused";
  return "";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST(JsonLimits, LimitBoundary) {
  // kMaxJsonDepth levels parse, one more is refused: arrays, objects and mixed.
  EXPECT_EQ(parse_json(nested_arrays(kMaxJsonDepth)).dump(), json::parse(nested_arrays(kMaxJsonDepth)).dump());
  EXPECT_EQ(parse_json(nested_objects(kMaxJsonDepth)).dump(), json::parse(nested_objects(kMaxJsonDepth)).dump());
  const std::string mixed = repeat("[{\"k\":", kMaxJsonDepth / 2) + "null" + repeat("}]", kMaxJsonDepth / 2);
  EXPECT_EQ(parse_json(mixed), json::parse(mixed));
  EXPECT_FALSE(try_parse_json(nested_arrays(kMaxJsonDepth)).is_discarded());

  const std::string a = refusal_of("257 arrays", [] { parse_json(nested_arrays(kMaxJsonDepth + 1)); });
  EXPECT_TRUE(contains(a, "JSON nested too deep at [0][0][0]")) << a;
  EXPECT_TRUE(contains(a, "(257 levels; the limit is 256)")) << a;
  const std::string o = refusal_of("257 objects", [] { parse_json(nested_objects(kMaxJsonDepth + 1)); });
  EXPECT_TRUE(contains(o, "JSON nested too deep at a.a.a.a")) << o;
  EXPECT_TRUE(contains(o, "(257 levels; the limit is 256)")) << o;
  EXPECT_TRUE(try_parse_json(nested_arrays(kMaxJsonDepth + 1)).is_discarded());
  EXPECT_TRUE(try_parse_json(nested_objects(kMaxJsonDepth + 1)).is_discarded());
  // Depth counts open containers, not how many were seen: many siblings at depth 256 are fine.
  const std::string wide = repeat("[", kMaxJsonDepth - 1) + "[1],[2],[3]" + repeat("]", kMaxJsonDepth - 1);
  EXPECT_EQ(parse_json(wide), json::parse(wide));
}

TEST(JsonLimits, PathNamesWhereItWentTooDeep) {
  const std::string m = refusal_of("tokenizer.json, 5,000 nested Sequence normalizers",
                                   [] { parse_json(nested_normalizers(5000)); });
  EXPECT_EQ(m.rfind("JSON nested too deep at normalizer.normalizers[0].normalizers[0].normalizers[0]", 0), 0u) << m;
  EXPECT_TRUE(contains(m, "... (257 levels; the limit is 256)")) << m;
  EXPECT_LT(m.size(), 400u) << "the path is cut";

  // Indexes count the elements before; keys that are not plain names are quoted and cut.
  const std::string doc = "{\"model.layers.0\":[1,2," + nested_arrays(kMaxJsonDepth) + "]}";
  const std::string q = refusal_of("quoted key, third element", [&] { parse_json(doc); });
  EXPECT_EQ(q.rfind("JSON nested too deep at [\"model.layers.0\"][2][0][0]", 0), 0u) << q;
  const std::string long_key(10000, 'k');
  const std::string q2 = refusal_of("10,000-character key", [&] { parse_json("{\"" + long_key + "\":" + nested_arrays(300) + "}"); });
  EXPECT_LT(q2.size(), 400u) << q2;
  EXPECT_TRUE(contains(q2, "(257 levels; the limit is 256)")) << q2;
  // A key cut inside a multi-byte character is cut before it (messages stay valid UTF-8).
  const std::string accented = repeat("\xC3\xA9", 100);  // é x 100
  const std::string q3 = refusal_of("key of é", [&] { parse_json("{\"" + accented + "\":" + nested_arrays(300) + "}"); });
  EXPECT_NO_THROW(json(q3).dump()) << "invalid UTF-8 in the message";
}

TEST(JsonLimits, VeryDeepDocumentsRefusedWithoutCrashing) {
  // What crashed the tools (stack overflow at 50,000 levels); each is refused at level 257.
  for (size_t levels : {size_t{50000}, size_t{1000000}}) {
    for (bool closed : {true, false}) {
      const std::string n = std::to_string(levels) + (closed ? " closed" : " unclosed");
      const std::string arrays = nested_arrays(levels, closed), objects = nested_objects(levels, closed);
      EXPECT_TRUE(contains(refusal_of(n + " arrays", [&] { parse_json(arrays); }), "(257 levels; the limit is 256)"));
      EXPECT_TRUE(contains(refusal_of(n + " objects", [&] { parse_json(objects); }), "(257 levels; the limit is 256)"));
      EXPECT_TRUE(try_parse_json(arrays).is_discarded());
      EXPECT_TRUE(try_parse_json(objects).is_discarded());
    }
  }
  // From a stream, the refusal stops reading at the refused bracket: the rest of the file is
  // never read.
  std::istringstream in(nested_arrays(1000000));
  refusal_of("1,000,000 arrays from a stream", [&] { parse_json(in); });
  in.clear();
  EXPECT_LE(static_cast<int64_t>(in.tellg()), kMaxJsonDepth + 1);
}

// Documents of every kind of value, nesting and error: parse_json gives what json::parse gives.
std::vector<std::string> documents() {
  std::vector<std::string> docs = {
      "{}", "[]", "null", "true", "false", "0", "-0", "-0.0", "1.5e300", "-1e-300", "3.141592653589793",
      "9223372036854775807", "-9223372036854775808", "18446744073709551615", "18446744073709551616",
      "\"\"", "\"plain\"", R"("esc \" \\ \/ \b \f \n \r \t \u0000 \u00e9 \ud83d\ude00")", "\"\xC3\xA9\xE2\x82\xAC\"",
      " \t\r\n {\"a\" : [ 1 , 2 ] } \n", R"({"b":1,"a":2,"c":{"z":[],"y":{}}})", R"({"dup":1,"dup":[2,3]})",
      R"({"":"empty key","a.b":"dotted"})", R"([1,"two",3.0,null,true,{"x":[{"y":[[]]}]}])",
      R"({"version":"1.0","truncation":null,"added_tokens":[{"id":0,"content":"<s>","special":true}],)"
      R"("normalizer":{"type":"Sequence","normalizers":[{"type":"NFKC"},{"type":"Replace","pattern":{"String":" "},"content":"\u2581"}]},)"
      R"("pre_tokenizer":{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":true},)"
      R"("model":{"type":"BPE","dropout":null,"vocab":{"a":0,"b":1,"ab":2},"merges":[["a","b"]]}})",
      // Syntax errors and out-of-range numbers: the same exception and text.
      "", " ", "{", "[1,]", "{\"a\" 1}", "{\"a\":1,}", "nul", "01", "1.", "\"\\x\"", "\"\xFF\"", "{} x", "[] []",
      "1e999999", "-1e999999", "[1e400]", "{\"a\":\"\x01\"}", "/* c */ {}", "[" + std::string(300, ']'),
  };
  // A big flat document (a vocabulary) and a 255-deep mixed one.
  std::string vocab = "{";
  for (int i = 0; i < 20000; ++i) vocab += (i ? "," : "") + std::string("\"piece") + std::to_string(i) + "\":" + std::to_string(i);
  docs.push_back(vocab + "}");
  docs.push_back(repeat("{\"n\":[", 127) + "1.25" + repeat("]}", 127));
  return docs;
}

// "ok <dump>" or "<exception type id> <what>" of parsing `text`.
template <class Parse>
std::string outcome(Parse&& parse, const std::string& text) {
  try {
    return "ok " + parse(text).dump();
  } catch (const json::exception& e) {
    return std::to_string(e.id) + " " + e.what();
  }
}

TEST(JsonLimits, ParsesAsNlohmannParses) {
  for (const std::string& doc : documents()) {
    const std::string label = doc.substr(0, 60);
    const std::string want = outcome([](const std::string& t) { return json::parse(t); }, doc);
    EXPECT_EQ(outcome([](const std::string& t) { return parse_json(t); }, doc), want) << label;
    EXPECT_EQ(outcome([](const std::string& t) { std::istringstream in(t); return parse_json(in); }, doc),
              outcome([](const std::string& t) { std::istringstream in(t); return json::parse(in); }, doc))
        << label;
    const json lenient = json::parse(doc, nullptr, /*allow_exceptions=*/false);
    const json mine = try_parse_json(doc);
    EXPECT_EQ(mine.is_discarded(), lenient.is_discarded()) << label;
    if (!lenient.is_discarded()) EXPECT_EQ(mine.dump(), lenient.dump()) << label;
    // Equal values, not only equal text: integer, unsigned and float kinds preserved.
    if (want.rfind("ok ", 0) == 0) EXPECT_EQ(parse_json(doc), json::parse(doc)) << label;
  }
}

TEST(JsonLimits, KeyObserverSeesEveryKeyWithItsDepth) {
  std::vector<std::pair<int, std::string>> seen;
  const json j = parse_json(R"({"a":{"b":[{"c":1}]},"a":2,"d":3})",
                            [&](int depth, const std::string& key) { seen.emplace_back(depth, key); });
  const std::vector<std::pair<int, std::string>> want = {{1, "a"}, {2, "b"}, {4, "c"}, {1, "a"}, {1, "d"}};
  EXPECT_EQ(seen, want);
  EXPECT_EQ(j.dump(), R"({"a":2,"d":3})");
}

TEST(JsonLimits, LargeDocumentTimes) {
  // A tokenizer.json-sized document (150,000 vocabulary entries and merges): printed times of
  // both parsers, for the note; the values must be equal.
  std::string text = "{\"model\":{\"vocab\":{";
  for (int i = 0; i < 150000; ++i) text += (i ? "," : "") + std::string("\"tok") + std::to_string(i) + "\":" + std::to_string(i);
  text += "},\"merges\":[";
  for (int i = 0; i < 150000; ++i) text += (i ? "," : "") + std::string("[\"t") + std::to_string(i) + "\",\"k\"]";
  text += "]}}";
  auto time = [&](auto&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    json j = f();
    return std::make_pair(std::move(j), std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  };
  auto [reference, ref_ms] = time([&] { return json::parse(text); });
  auto [mine, my_ms] = time([&] { return parse_json(text); });
  std::cout << "  " << text.size() << " bytes: json::parse " << ref_ms << " ms, parse_json " << my_ms << " ms\n";
  EXPECT_EQ(mine, reference);
}

TEST(JsonLimits, ReadersNameTheFileAndLine) {
  mfsdp::testing::TempDir dir("json-limits");
  auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir.file(name), std::ios::binary) << text;
    return dir.file(name);
  };
  // JSONL datasets: the line, as for any invalid JSON, with the path.
  const std::string ok_line = R"({"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"yo"}]})";
  const std::string sft = write("sft.jsonl", ok_line + "\n" + nested_objects(50000) + "\n");
  try {
    mfsdp::read_sft_jsonl(sft);
    ADD_FAILURE() << "not refused";
  } catch (const std::invalid_argument& e) {
    std::cout << "  " << e.what() << "\n";
    EXPECT_EQ(std::string(e.what()).rfind(sft + ":2: ", 0), 0u) << e.what();
    EXPECT_TRUE(contains(e.what(), "JSON nested too deep at a.a.a")) << e.what();
  }
  const std::string rl = write("rl.jsonl", nested_arrays(1000000, false) + "\n");
  EXPECT_THROW(mfsdp::read_rl_jsonl(rl), std::invalid_argument);
  // A countdown ground truth nested too deep is not valid JSON to the reward.
  EXPECT_THROW(mfsdp::countdown_reward("1+2", nested_objects(100000)), std::invalid_argument);
  // Dataset checksums: std::runtime_error naming the file.
  const std::string prefix = dir.file("data");
  write("data.checksums.json", nested_arrays(50000));
  try {
    mfsdp::DatasetChecksums::load(prefix);
    ADD_FAILURE() << "not refused";
  } catch (const std::runtime_error& e) {
    std::cout << "  " << e.what() << "\n";
    EXPECT_TRUE(contains(e.what(), mfsdp::dataset_checksums_path(prefix))) << e.what();
    EXPECT_TRUE(contains(e.what(), "(257 levels; the limit is 256)")) << e.what();
  }
}

}  // namespace
