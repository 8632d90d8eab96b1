// mfsdp-preprocess: text or JSONL -> Megatron indexed dataset (PREFIX_text_document.bin/.idx),
// like Megatron-LM's tools/preprocess_data.py. See docs/data.md.
//
//   mfsdp-preprocess --input corpus.jsonl --json-keys text --output-prefix data/corpus
//       --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt
//       --append-eod --workers 2
//
// Input: .jsonl/.json: one JSON object per line; each --json-keys field (a string, or a list of
// strings = sentences) is a document. Anything else is plain text: documents are separated by
// blank lines (one document per paragraph), or one document per line with --split-lines.
// Output: PREFIX_KEY_document.{bin,idx} per key (plain text uses the key "text").
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "mfsdp/base/json_parse.h"
#include "mfsdp/data/dataset_checksums.h"
#include "mfsdp/data/indexed_dataset.h"
#include "mfsdp/data/tokenizer.h"

namespace {

struct Args {
  std::string input;
  std::string input_format = "auto";
  std::vector<std::string> json_keys = {"text"};
  bool split_lines = false;
  std::string output_prefix;
  mfsdp::TokenizerOptions tokenizer;
  bool append_eod = false;
  int64_t train_vocab_size = 0;
  std::string train_model_type = "bpe";
  int workers = 1;
  int64_t log_interval = 10000;
};

// One input document: for each key, its sentences (plain text and JSON strings: one sentence).
using Document = std::vector<std::vector<std::string>>;  // [key][sentence]

bool is_blank(const std::string& line) {
  return std::all_of(line.begin(), line.end(),
                     [](unsigned char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\f' || c == '\v'; });
}

// Reads documents one at a time from a plain-text or JSONL file.
class DocumentReader {
 public:
  DocumentReader(const Args& args, bool jsonl) : args_(args), jsonl_(jsonl), in_(args.input, std::ios::binary) {
    if (!in_) throw std::runtime_error("--input " + args.input + ": cannot open for reading");
  }

  // False at the end of the input.
  bool next(Document& doc) {
    doc.assign(args_.json_keys.size(), {});
    return jsonl_ ? next_json(doc) : args_.split_lines ? next_line(doc) : next_paragraph(doc);
  }

  int64_t bytes_read() const { return bytes_; }

 private:
  bool getline(std::string& line) {
    if (!std::getline(in_, line)) {
      if (in_.bad()) throw std::runtime_error(args_.input + ": read error");
      return false;
    }
    ++line_no_;
    bytes_ += static_cast<int64_t>(line.size()) + 1;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    return true;
  }

  bool next_line(Document& doc) {
    std::string line;
    while (getline(line)) {
      if (is_blank(line)) continue;
      doc[0].push_back(line);
      return true;
    }
    return false;
  }

  bool next_paragraph(Document& doc) {
    std::string line, text;
    bool any = false;
    while (getline(line)) {
      if (is_blank(line)) {
        if (any) break;
        continue;
      }
      if (any) text += '\n';
      text += line;
      any = true;
    }
    if (any) doc[0].push_back(std::move(text));
    return any;
  }

  bool next_json(Document& doc) {
    std::string line;
    while (getline(line)) {
      if (is_blank(line)) continue;
      const std::string where = args_.input + ":" + std::to_string(line_no_);
      nlohmann::json object;
      try {
        object = mfsdp::parse_json(line);
      } catch (const nlohmann::json::exception& e) {
        throw std::runtime_error(where + ": invalid JSON: " + e.what());
      }
      if (!object.is_object()) throw std::runtime_error(where + ": expected a JSON object");
      for (size_t k = 0; k < args_.json_keys.size(); ++k) {
        const std::string& key = args_.json_keys[k];
        auto it = object.find(key);
        if (it == object.end()) {
          throw std::runtime_error(where + ": no key \"" + key + "\" (--json-keys)");
        }
        if (it->is_string()) {
          doc[k].push_back(it->get<std::string>());
        } else if (it->is_array() &&
                   std::all_of(it->begin(), it->end(), [](const nlohmann::json& s) { return s.is_string(); })) {
          for (const auto& s : *it) doc[k].push_back(s.get<std::string>());
        } else {
          throw std::runtime_error(where + ": key \"" + key +
                                   "\" is neither a string nor a list of strings");
        }
      }
      return true;
    }
    return false;
  }

  const Args& args_;
  bool jsonl_;
  std::ifstream in_;
  int64_t line_no_ = 0;
  int64_t bytes_ = 0;
};

// Megatron's Encoder.encode for one key: tokens of every non-empty sentence, one sequence per
// sentence, EOD appended to the last one.
struct Encoded {
  std::vector<int64_t> ids;
  std::vector<int32_t> lengths;
};

Encoded encode_sentences(const mfsdp::Tokenizer& tokenizer, const std::vector<std::string>& sentences,
                         bool append_eod) {
  Encoded out;
  for (const std::string& sentence : sentences) {
    std::vector<int64_t> ids = tokenizer.encode(sentence);
    if (ids.empty()) continue;
    out.ids.insert(out.ids.end(), ids.begin(), ids.end());
    out.lengths.push_back(static_cast<int32_t>(ids.size()));
  }
  if (!out.ids.empty() && append_eod) {
    out.ids.push_back(tokenizer.eod());
    out.lengths.back() += 1;
  }
  return out;
}

bool input_is_jsonl(const Args& args) {
  if (args.input_format == "jsonl") return true;
  if (args.input_format == "txt") return false;
  const auto dot = args.input.find_last_of('.');
  const std::string ext = dot == std::string::npos ? "" : args.input.substr(dot);
  return ext == ".jsonl" || ext == ".json";
}

// Trains PREFIX.model on every line of the input's documents.
void train_tokenizer(const Args& args, bool jsonl) {
  std::vector<std::string> sentences;
  DocumentReader reader(args, jsonl);
  Document doc;
  while (reader.next(doc)) {
    for (const auto& key_sentences : doc) {
      for (const std::string& text : key_sentences) {
        std::istringstream lines(text);
        std::string line;
        while (std::getline(lines, line)) {
          if (!is_blank(line)) sentences.push_back(line);
        }
      }
    }
  }
  mfsdp::SentencePieceTrainOptions options;
  options.vocab_size = args.train_vocab_size;
  options.model_type = args.train_model_type;
  options.extra["max_sentence_length"] = "1048576";
  options.extra["num_threads"] = std::to_string(std::max(1, args.workers));
  std::cerr << "training a SentencePiece " << args.train_model_type << " model, vocabulary "
            << args.train_vocab_size << ", on " << sentences.size() << " lines -> "
            << args.output_prefix << ".model\n";
  mfsdp::train_sentencepiece(sentences, args.output_prefix, options);
}

void run(Args args) {
  const bool jsonl = input_is_jsonl(args);
  if (!jsonl && (args.json_keys.size() != 1 || args.json_keys[0] != "text")) {
    throw std::invalid_argument("--json-keys applies to JSONL input; plain text has the one key "
                                "\"text\" (use --input-format jsonl for JSON lines)");
  }
  if (args.train_vocab_size > 0) {
    if (args.tokenizer.type != "SentencePieceTokenizer" &&
        args.tokenizer.type != "GPTSentencePieceTokenizer") {
      throw std::invalid_argument("--train-tokenizer-vocab-size trains a SentencePiece model; it "
                                  "needs --tokenizer-type SentencePieceTokenizer");
    }
    if (!args.tokenizer.model_file.empty()) {
      throw std::invalid_argument("--train-tokenizer-vocab-size writes PREFIX.model itself; do "
                                  "not also give --tokenizer-model");
    }
    train_tokenizer(args, jsonl);
    args.tokenizer.model_file = args.output_prefix + ".model";
  }
  const std::unique_ptr<mfsdp::Tokenizer> tokenizer = mfsdp::make_tokenizer(args.tokenizer);
  const mfsdp::TokenDType dtype = mfsdp::optimal_token_dtype(tokenizer->vocab_size());

  std::vector<std::string> prefixes;
  std::vector<std::unique_ptr<mfsdp::IndexedDatasetWriter>> writers;
  for (const std::string& key : args.json_keys) {
    prefixes.push_back(args.output_prefix + "_" + key + "_document");
    writers.push_back(std::make_unique<mfsdp::IndexedDatasetWriter>(prefixes.back(), dtype));
  }

  DocumentReader reader(args, jsonl);
  const size_t workers = static_cast<size_t>(std::max(1, args.workers));
  const size_t batch = 256 * workers;
  const auto start = std::chrono::steady_clock::now();
  int64_t documents = 0;
  int64_t next_log = args.log_interval;
  std::vector<Document> docs;
  std::vector<std::vector<Encoded>> encoded;
  bool more = true;
  while (more) {
    docs.clear();
    Document doc;
    while (docs.size() < batch && (more = reader.next(doc))) docs.push_back(std::move(doc));
    if (docs.empty()) break;

    // Encode the batch on `workers` threads (worker w takes documents w, w + workers, ...), then
    // write it in input order.
    encoded.assign(docs.size(), {});
    std::vector<std::string> errors(workers);
    auto encode_some = [&](size_t w) {
      try {
        for (size_t d = w; d < docs.size(); d += workers) {
          for (const auto& sentences : docs[d]) {
            encoded[d].push_back(encode_sentences(*tokenizer, sentences, args.append_eod));
          }
        }
      } catch (const std::exception& e) {
        errors[w] = e.what();
      }
    };
    std::vector<std::thread> threads;
    for (size_t w = 1; w < workers; ++w) threads.emplace_back(encode_some, w);
    encode_some(0);
    for (auto& t : threads) t.join();
    for (const std::string& e : errors) {
      if (!e.empty()) throw std::runtime_error(e);
    }
    for (size_t d = 0; d < docs.size(); ++d) {
      for (size_t k = 0; k < writers.size(); ++k) {
        writers[k]->add_document(encoded[d][k].ids, encoded[d][k].lengths);
      }
    }
    documents += static_cast<int64_t>(docs.size());
    if (args.log_interval > 0 && documents >= next_log) {
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::cerr << "Processed " << documents << " documents (" << documents / std::max(s, 1e-9)
                << " docs/s, " << reader.bytes_read() / std::max(s, 1e-9) / 1048576.0
                << " MB/s).\n";
      while (next_log <= documents) next_log += args.log_interval;
    }
  }

  for (size_t k = 0; k < writers.size(); ++k) {
    writers[k]->finalize();
    std::cout << "wrote " << prefixes[k] << ".bin/.idx/.checksums.json: " << writers[k]->num_documents()
              << " documents, " << writers[k]->num_sequences() << " sequences, "
              << writers[k]->num_tokens() << " tokens (" << mfsdp::token_dtype_name(dtype)
              << ", " << tokenizer->name() << ", vocabulary " << tokenizer->vocab_size()
              << ", eod " << tokenizer->eod() << ")\n";
  }
}

// mfsdp-preprocess --add-checksums PREFIX...: PREFIX.checksums.json for datasets written by
// other tools (Megatron's preprocess_data.py), after checking that each one opens.
int add_checksums_main(int argc, char** argv) {
  std::vector<std::string> prefixes;
  CLI::App app{"Add PREFIX.checksums.json (CRC-32C of the .idx and of each 1 MiB block of the .bin) to "
               "existing indexed datasets", "mfsdp-preprocess --add-checksums"};
  app.add_option("--add-checksums", prefixes, "Dataset path prefixes (without .bin/.idx)")->required();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);
    std::cerr << "mfsdp-preprocess: error: " << e.what() << "\nRun with --add-checksums --help for the options.\n";
    return 2;
  }
  try {
    for (const std::string& prefix : prefixes) {
      const mfsdp::IndexedDataset opened(prefix);  // its index and bounds are checked first
      mfsdp::write_dataset_checksums(prefix);
      std::cout << "wrote " << mfsdp::dataset_checksums_path(prefix) << " (" << opened.size() << " sequences)\n";
    }
  } catch (const std::exception& e) {
    std::cerr << "mfsdp-preprocess: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]) == "--add-checksums") return add_checksums_main(argc, argv);
  Args args;
  CLI::App app{"Tokenize text or JSONL into a Megatron indexed dataset (PREFIX_KEY_document.bin/.idx)",
               "mfsdp-preprocess"};
  app.add_option("--input", args.input, "Input file: .jsonl/.json (one JSON object per line) or plain text")
      ->required();
  app.add_option("--input-format", args.input_format, "auto (by extension), txt or jsonl")
      ->check(CLI::IsMember({"auto", "txt", "jsonl"}));
  app.add_option("--json-keys", args.json_keys, "JSON keys to extract, one dataset each (default: text)");
  app.add_flag("--split-lines", args.split_lines,
               "Plain text: one document per line (default: one per blank-line-separated paragraph)");
  app.add_option("--output-prefix", args.output_prefix, "Output path prefix, without suffix")->required();
  app.add_option("--tokenizer-type", args.tokenizer.type, "Tokenizer")
      ->required()
      ->check(CLI::IsMember({"ByteLevelTokenizer", "SentencePieceTokenizer",
                             "GPTSentencePieceTokenizer", "GPT2BPETokenizer",
                             "HuggingFaceTokenizer"}));
  app.add_option("--tokenizer-model", args.tokenizer.model_file,
                 "SentencePiece .model file; HuggingFaceTokenizer: tokenizer.json or its folder");
  app.add_option("--vocab-file", args.tokenizer.vocab_file, "GPT-2 BPE vocab.json");
  app.add_option("--merge-file", args.tokenizer.merge_file, "GPT-2 BPE merges.txt");
  app.add_flag("--append-eod", args.append_eod, "Append the end-of-document token to each document");
  app.add_option("--train-tokenizer-vocab-size", args.train_vocab_size,
                 "Train a SentencePiece model of this vocabulary size on the input first, into "
                 "PREFIX.model")
      ->check(CLI::PositiveNumber);
  app.add_option("--train-tokenizer-model-type", args.train_model_type,
                 "SentencePiece model type to train: bpe or unigram")
      ->check(CLI::IsMember({"bpe", "unigram"}));
  app.add_option("--workers", args.workers, "Encoding threads")->check(CLI::PositiveNumber);
  app.add_option("--log-interval", args.log_interval, "Report progress every N documents (0: never)")
      ->check(CLI::NonNegativeNumber);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::cerr << "mfsdp-preprocess: error: " << e.what() << "\nRun with --help for the options.\n";
    return 2;
  }
  try {
    run(std::move(args));
  } catch (const std::exception& e) {
    std::cerr << "mfsdp-preprocess: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
