// What checksums cost (docs/checkpoints.md "Checksums", docs/data.md): CRC-32C throughput next
// to memcpy, and reading a DCP checkpoint and an indexed dataset with their checksums verified
// against the same files read unverified (the checksums file moved away), in one process. By
// default the files are in the page cache (the worst case for the relative cost: no disk time
// to hide it); --cold drops the page cache before every read (root only), so reads come from
// the disk.
//
//   build/bench/checksum_cost [--mib 512] [--repeats 3] [--cold]
#include <ATen/ATen.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "mfsdp/checkpoint/dcp.h"
#include "mfsdp/base/crc32c.h"
#include "mfsdp/data/dataset_checksums.h"
#include "mfsdp/base/directory_tree.h"
#include "mfsdp/data/indexed_dataset.h"

namespace {

namespace fs = std::filesystem;

bool cold = false;

void drop_page_cache() {
  ::sync();
  std::FILE* f = std::fopen("/proc/sys/vm/drop_caches", "w");
  if (f == nullptr || std::fputs("3\n", f) < 0 || std::fclose(f) != 0) {
    std::fprintf(stderr, "checksum_cost: --cold needs to write /proc/sys/vm/drop_caches (root)\n");
    std::exit(2);
  }
}

template <typename F>
double best_seconds(int repeats, F&& f) {
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    if (cold) drop_page_cache();
    const auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t mib = 512;
  int repeats = 3;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--cold") cold = true;
    else if (a == "--mib" && i + 1 < argc) mib = std::stoll(argv[++i]);
    else if (a == "--repeats" && i + 1 < argc) repeats = std::stoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: checksum_cost [--mib N] [--repeats N] [--cold]\n");
      return 2;
    }
  }
  at::set_num_threads(1);
  const size_t bytes = static_cast<size_t>(mib) << 20;
  const fs::path dir = fs::temp_directory_path() / ("mfsdp-checksum-cost-" + std::to_string(::getpid()));
  fs::create_directories(dir);

  // 1. CRC-32C against memcpy of the same bytes.
  std::vector<unsigned char> src(bytes), dst(bytes);
  for (size_t i = 0; i < bytes; ++i) src[i] = static_cast<unsigned char>(i * 2654435761u >> 24);
  volatile uint32_t sink = 0;
  const bool was_cold = cold;
  cold = false;  // in-memory work: nothing to drop
  const double t_memcpy = best_seconds(repeats, [&] { std::memcpy(dst.data(), src.data(), bytes); });
  const double t_crc = best_seconds(repeats, [&] { sink = sink + mfsdp::crc32c(src.data(), bytes); });
  const double t_crc_tables =
      best_seconds(repeats, [&] { sink = sink + mfsdp::crc32c_extend_portable(0, src.data(), bytes); });
  cold = was_cold;
  src.clear();
  src.shrink_to_fit();
  dst.clear();
  dst.shrink_to_fit();

  // 2. A DCP checkpoint of `mib` MiB in 64 tensors, read whole, verified and unverified.
  const std::string ckpt = (dir / "ckpt").string();
  const int64_t per_tensor = static_cast<int64_t>(bytes / 4 / 64);
  {
    mfsdp::dcp::DirectoryWriter w(ckpt);
    for (int t = 0; t < 64; ++t) w.tensor("model.w" + std::to_string(t), at::randn({per_tensor}));
    w.finish();
  }
  auto read_ckpt = [&] {
    mfsdp::dcp::Reader r(ckpt);
    for (int t = 0; t < 64; ++t) r.read("model.w" + std::to_string(t));
  };
  const std::string sums = ckpt + "/" + mfsdp::dcp::kChecksumsFile;
  const double t_ckpt_verified = best_seconds(repeats, read_ckpt);
  fs::rename(sums, sums + ".away");
  const double t_ckpt_plain = best_seconds(repeats, read_ckpt);
  fs::rename(sums + ".away", sums);

  // 3. An indexed dataset of `mib` MiB of uint16 tokens in 4096-token documents, every token read.
  const std::string prefix = (dir / "corpus").string();
  const int64_t tokens = static_cast<int64_t>(bytes / 2), doc = 4096;
  {
    mfsdp::IndexedDatasetWriter w(prefix, mfsdp::TokenDType::kUInt16);
    std::vector<int64_t> d(doc);
    for (int64_t at = 0; at < tokens; at += doc) {
      for (int64_t k = 0; k < doc; ++k) d[k] = (at + k) % 50000;
      w.add_document(d);
    }
    w.finalize();
  }
  std::vector<int64_t> out(doc);
  auto read_data = [&] {
    mfsdp::IndexedDataset ds(prefix);  // fresh: every block verified again
    for (int64_t i = 0; i < ds.size(); ++i) ds.read(i, 0, ds.sequence_length(i), out.data());
  };
  const std::string dsums = mfsdp::dataset_checksums_path(prefix);
  const double t_data_verified = best_seconds(repeats, read_data);
  fs::rename(dsums, dsums + ".away");
  const double t_data_plain = best_seconds(repeats, read_data);
  mfsdp::remove_tree(dir);

  const double gb = static_cast<double>(bytes) / 1e9;
  std::printf("checksum cost, %lld MiB, best of %d (1 thread, files %s)\n", static_cast<long long>(mib), repeats,
              cold ? "read from disk: page cache dropped before each read" : "in the page cache");
  std::printf("%-38s %10s %10s %9s\n", "what", "verified", "baseline", "ratio");
  std::printf("%-38s %8.2f GB/s %6.2f GB/s %8.2fx   (baseline: memcpy)\n", "CRC-32C throughput", gb / t_crc,
              gb / t_memcpy, t_crc / t_memcpy);
  std::printf("%-38s %8.2f GB/s %6.2f GB/s %8.2fx   (baseline: memcpy)\n", "CRC-32C, table path (CPUs without crc32)",
              gb / t_crc_tables, gb / t_memcpy, t_crc_tables / t_memcpy);
  std::printf("%-38s %9.3f s %9.3f s %8.2fx   (baseline: no .checksums.json)\n", "read a DCP checkpoint", t_ckpt_verified,
              t_ckpt_plain, t_ckpt_verified / t_ckpt_plain);
  std::printf("%-38s %9.3f s %9.3f s %8.2fx   (baseline: no PREFIX.checksums.json)\n", "read every token of a dataset",
              t_data_verified, t_data_plain, t_data_verified / t_data_plain);
  return sink == 42 ? 1 : 0;
}
