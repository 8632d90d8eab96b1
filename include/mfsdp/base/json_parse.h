// JSON parsing with a nesting limit: how every JSON file or line that mfsdp reads is parsed
// (tokenizer.json, config.json, JSONL data, checkpoint metadata and indexes).
//
// nlohmann::json::parse accepts any nesting, and a deep document hurts long before it is used:
// 5,000 levels of nested Sequence normalizers in a 300 KB tokenizer.json took 4.7 GB and 15 s to
// load, and 50,000 levels crashed the recursive code that walks, copies, compares or dumps the
// parsed value (stack overflow). parse_json counts the levels while nlohmann's SAX parser reads
// (src/base/json_parse.cpp), so a document nested deeper than kMaxJsonDepth is refused at its
// 257th opening bracket (under a millisecond, however long the file), before anything deeper is
// built.
//
// Errors are nlohmann::json::exception, as json::parse throws them, so the call sites' existing
// `catch (const nlohmann::json::exception&)` name the file (or "FILE:LINE" for JSONL) in the
// exception type the site throws: syntax errors are json::parse's own (same type and text), and a
// refusal reads "JSON nested too deep at normalizer.normalizers[0].normalizers[0]... (257 levels;
// the limit is 256)" (the path cut to about 200 characters).
//
//   const nlohmann::json j = mfsdp::parse_json(text);     // or parse_json(std::ifstream&)
//   const nlohmann::json k = mfsdp::try_parse_json(line);  // discarded on any error
#pragma once

#include <functional>
#include <iosfwd>
#include <string>
#include <string_view>

#include <nlohmann/json_fwd.hpp>

namespace mfsdp {

// The deepest nesting of arrays and objects accepted: a document whose outermost container
// holds one that holds one ... 256 deep parses, 257 is refused. Legitimate files nest fewer than
// 20 levels (tokenizer.json's Sequences of Sequences included); the limit bounds the stack and
// memory of the code that walks what is parsed, not what a file may mean.
inline constexpr int kMaxJsonDepth = 256;

// Called with each object key as it is read (before its value), with the nesting depth of the
// object holding it: 1 for the top-level object's keys, as nlohmann's parser callbacks count.
// For checks that the parsed value cannot show, e.g. a duplicated key (the last one wins).
using JsonKeyObserver = std::function<void(int depth, const std::string& key)>;

// json::parse(text) (strict: one value, then only whitespace) with the nesting limit; throws
// nlohmann::json::exception (see above).
nlohmann::json parse_json(std::string_view text, const JsonKeyObserver& on_key = nullptr);
// The same from a stream (a file read as it is parsed: a refusal stops reading there).
nlohmann::json parse_json(std::istream& in, const JsonKeyObserver& on_key = nullptr);

// json::parse(text, nullptr, /*allow_exceptions=*/false) with the nesting limit: a discarded
// value (is_discarded()) for bad syntax, a number out of range or nesting past the limit.
nlohmann::json try_parse_json(std::string_view text);

// The same into nlohmann::ordered_json (keys in file order), for readers that write back what
// they read.
nlohmann::ordered_json parse_ordered_json(std::string_view text, const JsonKeyObserver& on_key = nullptr);
nlohmann::ordered_json try_parse_ordered_json(std::string_view text);

}  // namespace mfsdp
