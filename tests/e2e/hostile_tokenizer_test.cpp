// The hostile tokenizer.json corpus through mfsdp-preprocess: tests/e2e/hostile_tokenizers.py
// writes each case (nested Sequences, superlinear regexes, PCRE2 verbs, null steps, long Unigram
// pieces, expanding normalizers, deep JSON, and legitimate neighbours on large texts) and its
// expected outcome; the built tool (path in MFSDP_PREPROCESS_BIN, set by CMake) runs on it as a
// child process, and the test asserts the outcome (refused with the file and JSON path in a short
// message, or completed with the dataset written) and a bound on the child's peak RSS, taken from
// wait4()'s rusage. Times are printed, never asserted (the CI machine is a shared 2-core VM).
#include <signal.h>
#include <sys/resource.h>
#include <sys/time.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <fcntl.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "harness/run_command.h"
#include "harness/spawn_with_files.h"
#include "mfsdp/base/directory_tree.h"
#include "harness/temp_dir.h"

namespace mfsdp {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using mfsdp::testing::TempDir;

// The bound that is the point of the test: a hostile file must not make the tool take memory
// out of proportion to its input (the largest input here is 5 MB).
constexpr double kPeakRssBoundMiB = 1536;
// A refusal is one short line: a 2 MB regex must not be echoed into it.
constexpr size_t kMaxStderrBytes = 4096;
// Guards, not assertions on speed: a case still running after this long has hung (the bounds
// make every case finish in seconds), and the address-space limit makes a runaway allocation
// fail in the child instead of swapping the shared machine.
constexpr int kHangSeconds = 180;
constexpr rlim_t kAddressSpaceLimit = rlim_t{4} << 30;

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// At most `n` characters of `s`, for failure messages about outputs that may be megabytes.
std::string head(const std::string& s, size_t n = 600) {
  return s.size() <= n ? s : s.substr(0, n) + "... [" + std::to_string(s.size()) + " bytes in all]";
}

std::string python() {
  // The generator needs only the standard library: any python3 does when the reference
  // environment (MFSDP_PYTHON) has not been made.
  return fs::exists(MFSDP_PYTHON_PATH) ? MFSDP_PYTHON_PATH : "python3";
}

std::string tool_path() {
  const char* path = std::getenv("MFSDP_PREPROCESS_BIN");
  if (path != nullptr && *path != '\0') return path;
  // By hand (no ctest): the tool beside the tests' folder, build/tests/plain_tests -> build/.
  std::error_code ec;
  const fs::path beside = fs::read_symlink("/proc/self/exe", ec).parent_path().parent_path() / "mfsdp-preprocess";
  if (!ec && fs::exists(beside)) return beside.string();
  throw std::runtime_error(
      "MFSDP_PREPROCESS_BIN is not set: it must name the built mfsdp-preprocess binary (ctest sets it; "
      "by hand: MFSDP_PREPROCESS_BIN=build/mfsdp-preprocess build/tests/plain_tests "
      "--gtest_filter='HostileTokenizers.*')");
}

struct ChildRun {
  int exit_code = -1;  // 128 + signal when killed by one
  bool hung = false;   // killed by the hang guard
  double wall_s = 0, cpu_s = 0, peak_mib = 0;
  std::string err;
};

// Runs `argv` with stderr (and stdout) in `log_prefix`.{err,out}, under the address-space limit
// and the hang guard; the child's peak RSS and CPU time come from wait4().
ChildRun run_child(const std::vector<std::string>& args, const std::string& log_prefix) {
  const std::string out_path = log_prefix + ".out", err_path = log_prefix + ".err";
  const auto start = std::chrono::steady_clock::now();
  const pid_t pid = mfsdp::testing::spawn_with_files(args, out_path, err_path, [] {
    const rlimit as{kAddressSpaceLimit, kAddressSpaceLimit};
    const rlimit no_core{0, 0};  // a crash (a stack overflow) leaves no core of gigabytes
    setrlimit(RLIMIT_AS, &as);
    setrlimit(RLIMIT_CORE, &no_core);
  });
  ChildRun r;
  int status = 0;
  rusage usage{};
  for (;;) {
    const pid_t done = wait4(pid, &status, WNOHANG, &usage);
    if (done == pid) break;
    if (done < 0) throw std::runtime_error("wait4 failed");
    if (std::chrono::steady_clock::now() - start > std::chrono::seconds(kHangSeconds)) {
      kill(pid, SIGKILL);
      r.hung = true;
      wait4(pid, &status, 0, &usage);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  r.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.cpu_s = usage.ru_utime.tv_sec + usage.ru_stime.tv_sec + 1e-6 * (usage.ru_utime.tv_usec + usage.ru_stime.tv_usec);
  r.peak_mib = usage.ru_maxrss / 1024.0;  // ru_maxrss is in KiB on Linux
  r.err = read_file(err_path);
  return r;
}

std::string describe_exit(const ChildRun& r) {
  if (r.hung) return "still running after " + std::to_string(kHangSeconds) + " s: killed";
  if (r.exit_code > 128) {
    const int sig = r.exit_code - 128;
    return "killed by signal " + std::to_string(sig) + (sig == SIGSEGV ? " (SIGSEGV: stack overflow?)" : "");
  }
  return "exit " + std::to_string(r.exit_code);
}

class HostileTokenizers : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { dir_ = new TempDir("mfsdp-hostile"); }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }

  // Writes the files of `cases` with the generator and returns the manifest (of every case).
  static json generate(const std::vector<std::string>& cases) {
    std::string command = "\"" + python() + "\" \"" + std::string(MFSDP_SOURCE_DIR) +
                          "/tests/e2e/hostile_tokenizers.py\" \"" + dir_->path().string() + "\"";
    for (const std::string& c : cases) command += " --case " + c;
    const auto outcome = mfsdp::testing::run_command(command);
    if (outcome.exit_code != 0) {
      throw std::runtime_error("hostile_tokenizers.py failed (" + command + "):\n" + head(outcome.output, 4000));
    }
    return json::parse(read_file(dir_->file("manifest.json")));
  }

  // The tests of this suite, one per case (HOSTILE_CASE below).
  static std::vector<std::string> our_cases() {
    std::vector<std::string> names;
    const ::testing::TestSuite* suite = ::testing::UnitTest::GetInstance()->current_test_suite();
    for (int k = 0; k < suite->total_test_count(); ++k) names.push_back(suite->GetTestInfo(k)->name());
    return names;
  }

  void run_case(const std::string& name);

  static TempDir* dir_;
};
TempDir* HostileTokenizers::dir_ = nullptr;

void HostileTokenizers::run_case(const std::string& name) {
  json manifest;
  ASSERT_NO_THROW(manifest = generate({name}));
  json c;
  std::vector<std::string> listed;
  for (const json& e : manifest["cases"]) {
    listed.push_back(e["name"]);
    if (e["name"] == name) c = e;
  }
  std::vector<std::string> ours = our_cases();
  std::sort(listed.begin(), listed.end());
  std::sort(ours.begin(), ours.end());
  EXPECT_EQ(listed, ours) << "the HOSTILE_CASEs here and the cases of hostile_tokenizers.py differ";
  ASSERT_FALSE(c.is_null()) << name << " is not a case of hostile_tokenizers.py";
  // The case's files (up to 10 MB with the dataset) go when it ends, so that a run of the whole
  // suite in one process does not hold the corpus at once.
  struct RemoveCase {
    fs::path folder;
    ~RemoveCase() {
      std::error_code ignored;
      remove_tree(folder.string(), ignored);  // no std::filesystem walks (directory_tree.h)
    }
  } remove_case{fs::path(c["tokenizer"].get<std::string>()).parent_path()};
  const std::string expect = c["expect"], prefix = c["output_prefix"];
  const std::string input = c["input"], tokenizer = c["tokenizer"];
  std::string tool;
  ASSERT_NO_THROW(tool = tool_path());
  const ChildRun r = run_child({tool, "--input", input, "--output-prefix", prefix, "--tokenizer-type",
                           "HuggingFaceTokenizer", "--tokenizer-model", tokenizer, "--append-eod",
                           "--workers", "1", "--log-interval", "0"},
                          prefix + "_tool");
  const bool completed = r.exit_code == 0 && !r.hung;
  const char* outcome = r.hung ? "hung" : completed ? "completed" : r.exit_code < 128 ? "refused" : "crashed";
  char line[512];
  std::snprintf(line, sizeof line, "[hostile] %-30s expect %-9s -> %-9s %-24s wall %7.2f s  cpu %7.2f s  peak %8.1f MiB",
                name.c_str(), expect.c_str(), outcome, describe_exit(r).c_str(),
                r.wall_s, r.cpu_s, r.peak_mib);
  std::cout << line << "\n  " << c["note"].get<std::string>() << "\n  stderr (" << r.err.size()
            << " bytes): " << head(r.err, 300) << std::endl;

  SCOPED_TRACE(name + ": " + c["note"].get<std::string>());
  ASSERT_FALSE(r.hung) << "still running after " << kHangSeconds << " s (the hang guard killed it): " << head(r.err);
  EXPECT_LT(r.peak_mib, kPeakRssBoundMiB) << "peak RSS " << r.peak_mib << " MiB";
  if (expect == "completes" || (expect == "either" && completed)) {
    ASSERT_EQ(r.exit_code, 0) << describe_exit(r) << ": " << head(r.err);
    for (const char* suffix : {"_text_document.bin", "_text_document.idx"}) {
      EXPECT_TRUE(fs::exists(prefix + suffix)) << prefix + suffix << " was not written";
    }
    const std::string bin = prefix + "_text_document.bin";
    EXPECT_TRUE(fs::exists(bin) && fs::file_size(bin) > 0) << "no tokens in " << bin;
    return;
  }
  ASSERT_TRUE(expect == "refused" || expect == "either") << "unknown expectation " << expect;
  // Refused: an error exit (not a signal: a crash is no refusal), one short message naming the
  // file and the JSON path.
  EXPECT_TRUE(r.exit_code > 0 && r.exit_code < 128) << "expected a refusal, got " << describe_exit(r) << ": "
                                                    << head(r.err);
  EXPECT_LT(r.err.size(), kMaxStderrBytes) << "an error message of " << r.err.size() << " bytes: " << head(r.err);
  for (const json& s : c["contains"]) {
    EXPECT_NE(r.err.find(s.get<std::string>()), std::string::npos)
        << "the error does not name " << s << ": " << head(r.err);
  }
}

// One test per case of hostile_tokenizers.py, so that a failure names its case and ctest runs each
// in its own process, without Python at test discovery; each checks that the generator lists the
// same cases, so that a case added there is not left out here.
#define HOSTILE_CASE(name) \
  TEST_F(HostileTokenizers, name) { run_case(#name); }

HOSTILE_CASE(nested_normalizer_100)
HOSTILE_CASE(nested_normalizer_5000)
HOSTILE_CASE(nested_normalizer_20000)
HOSTILE_CASE(nested_normalizer_50000)
HOSTILE_CASE(nested_pre_tokenizer_100)
HOSTILE_CASE(nested_pre_tokenizer_5000)
HOSTILE_CASE(nested_pre_tokenizer_50000)
HOSTILE_CASE(nested_decoder_100)
HOSTILE_CASE(nested_decoder_5000)
HOSTILE_CASE(nested_decoder_50000)
HOSTILE_CASE(nested_post_processor_100)
HOSTILE_CASE(nested_post_processor_5000)
HOSTILE_CASE(nested_post_processor_50000)
HOSTILE_CASE(nested_unknown_key_50000)
HOSTILE_CASE(nested_tokenizer_config_50000)
HOSTILE_CASE(nested_jsonl_line_50000)
HOSTILE_CASE(regex_word_space_20k)
HOSTILE_CASE(regex_word_space_40k)
HOSTILE_CASE(regex_a_star_1mb)
HOSTILE_CASE(regex_a_star_runs_1mb)
HOSTILE_CASE(regex_dot_star_5mb)
HOSTILE_CASE(regex_2mb_uncompilable)
HOSTILE_CASE(verb_crlf)
HOSTILE_CASE(verb_no_jit)
HOSTILE_CASE(verb_limit_match)
HOSTILE_CASE(verb_accept)
HOSTILE_CASE(verb_commit)
HOSTILE_CASE(verb_in_normalizer)
HOSTILE_CASE(null_normalizer_entry)
HOSTILE_CASE(null_pre_tokenizer_entry)
HOSTILE_CASE(null_decoder_entry)
HOSTILE_CASE(unigram_long_pieces)
HOSTILE_CASE(replace_expand_64k)
HOSTILE_CASE(replace_expand_2x)
HOSTILE_CASE(gpt2_multilingual_5mb)
HOSTILE_CASE(run_spaces_1mb)
HOSTILE_CASE(run_newlines_1mb)
HOSTILE_CASE(run_digits_1mb)

}  // namespace
}  // namespace mfsdp
