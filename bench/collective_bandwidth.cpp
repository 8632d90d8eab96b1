#include <cstdlib>
// Collective bandwidth in the style of nccl-tests: for each size, the time of our Gloo
// communicator's all_gather / reduce_scatter / all_reduce, and in the same run the same operation
// through c10d's ProcessGroupGloo (1.13), which has no reduce-scatter and no flat all-gather, so
// it uses its usual workarounds: list allgather into views of one flat output, and alltoall_base
// followed by a local sum for reduce-scatter.
//
//   mfsdp-run --nproc-per-node 2 build/bench/collective_bandwidth [--min-bytes 1K] [--max-bytes 256M]
//
// size: bytes of the full (unsharded) buffer, as nccl-tests reports it. algbw = size / time;
// busbw = algbw * (n-1)/n for all_gather and reduce_scatter, * 2(n-1)/n for all_reduce.
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <string>

#include "comm/gloo_communicator.h"
#include "comm/store.h"
#include "mfsdp/comm.h"
#include "mfsdp/rendezvous.h"

namespace {

struct Args {
  int64_t min_bytes = 1 << 10;
  int64_t max_bytes = 256LL << 20;
  int64_t step_factor = 4;
  int trials = 9;
  std::vector<std::string> ops = {"all_gather", "reduce_scatter", "all_reduce"};
};

int64_t parse_size(const std::string& flag, const std::string& v) {
  size_t used = 0;
  long long n = 0;
  try {
    n = std::stoll(v, &used);
  } catch (const std::exception&) {
    throw std::invalid_argument(flag + ": '" + v + "' is not a size (e.g. 4096, 64K, 256M)");
  }
  std::string unit = v.substr(used);
  if (unit == "K") n <<= 10;
  else if (unit == "M") n <<= 20;
  else if (unit == "G") n <<= 30;
  else if (!unit.empty()) throw std::invalid_argument(flag + ": unknown unit in '" + v + "'");
  if (n <= 0) throw std::invalid_argument(flag + ": size must be positive, got '" + v + "'");
  return n;
}

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(flag + " needs a value");
      return argv[++i];
    };
    if (flag == "--min-bytes") a.min_bytes = parse_size(flag, value());
    else if (flag == "--max-bytes") a.max_bytes = parse_size(flag, value());
    else if (flag == "--step-factor") a.step_factor = parse_size(flag, value());
    else if (flag == "--op") a.ops = {value()};
    else if (flag == "--trials") a.trials = static_cast<int>(parse_size(flag, value()));
    else throw std::invalid_argument("unknown flag " + flag +
                                     " (flags: --min-bytes --max-bytes --step-factor --op --trials)");
  }
  if (a.step_factor < 2) throw std::invalid_argument("--step-factor must be >= 2");
  return a;
}

using Clock = std::chrono::steady_clock;

// Seconds per call of `op`: the mean over a trial of `iters` calls, slowest rank, after warm-up.
double time_trial(mfsdp::Communicator& comm, int64_t bytes, const std::function<void()>& op) {
  const int iters = static_cast<int>(std::clamp<int64_t>((64LL << 20) / bytes, 3, 50));
  comm.barrier();
  auto start = Clock::now();
  for (int i = 0; i < iters; ++i) op();
  double local = std::chrono::duration<double>(Clock::now() - start).count() / iters;
  at::Tensor t = at::full({1}, local, at::kDouble);
  comm.all_reduce(t, {mfsdp::ReduceOp::kMax});  // the slowest rank defines the collective's time
  return t.item<double>();
}

// Median over `trials` trials of each implementation, interleaved so that both see the same
// background load (this machine is small and noisy).
std::pair<double, double> time_pair(mfsdp::Communicator& comm, int64_t bytes,
                                    const std::function<void()>& ours,
                                    const std::function<void()>& base, int trials) {
  ours();
  base();  // warm-up: connections, buffers
  std::vector<double> a, b;
  for (int t = 0; t < trials; ++t) {
    a.push_back(time_trial(comm, bytes, ours));
    b.push_back(time_trial(comm, bytes, base));
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  return {median(a), median(b)};
}

struct Case {
  std::function<void()> ours;
  std::function<void()> c10d;
  double bus_factor;
};

Case make_case(const std::string& op, int64_t bytes, mfsdp::Communicator& comm,
               c10d::ProcessGroupGloo& pg) {
  const int n = comm.size();
  const int64_t numel = std::max<int64_t>(bytes / 4 / n, 1) * n;  // full buffer, divisible by n
  const int64_t shard = numel / n;
  at::Tensor full = at::randn({numel});
  at::Tensor part = at::randn({shard});
  const double ring = double(n - 1) / n;
  if (op == "all_gather") {
    std::vector<at::Tensor> views;
    for (int r = 0; r < n; ++r) views.push_back(full.narrow(0, r * shard, shard));
    return {[&comm, full, part] { comm.all_gather(full, part); },
            [&pg, views, part]() mutable {
              std::vector<std::vector<at::Tensor>> outs{views};
              std::vector<at::Tensor> ins{part};
              pg.allgather(outs, ins)->wait();
            },
            ring};
  }
  if (op == "reduce_scatter") {
    at::Tensor staging = at::empty({numel});
    return {[&comm, full, part] { comm.reduce_scatter(part, full); },
            [&pg, full, part, staging, n, shard]() mutable {
              std::vector<int64_t> splits;
              pg.alltoall_base(staging, full, splits, splits)->wait();
              at::sum_out(part, staging.view({n, shard}), {0});
            },
            ring};
  }
  if (op == "all_reduce") {
    return {[&comm, full] { comm.all_reduce(full); },
            [&pg, full]() mutable {
              std::vector<at::Tensor> ts{full};
              pg.allreduce(ts)->wait();
            },
            2 * ring};
  }
  throw std::invalid_argument("--op: unknown operation '" + op +
                              "' (all_gather, reduce_scatter, all_reduce)");
}

std::string human(int64_t bytes) {
  char buf[32];
  if (bytes >= (1 << 20)) std::snprintf(buf, sizeof buf, "%lldM", (long long)(bytes >> 20));
  else std::snprintf(buf, sizeof buf, "%lldK", (long long)(bytes >> 10));
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Args args = parse_args(argc, argv);
    at::set_num_threads(1);
    mfsdp::RendezvousInfo info = mfsdp::rendezvous_from_env();
    auto timeout = std::chrono::milliseconds(300000);
    auto store = mfsdp::connect_store(info, timeout);
    auto comm = mfsdp::make_gloo_communicator(store, info, timeout);

    auto pg_options = c10d::ProcessGroupGloo::Options::create();
    pg_options->timeout = timeout;
    pg_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(
        info.single_node() ? "127.0.0.1" : info.master_addr));
    auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(
        c10::make_intrusive<c10d::PrefixStore>("bench/c10d", store), info.rank, info.world_size,
        pg_options);

    const bool print = comm->rank() == 0;
    if (print) {
      const char* shm = std::getenv("MFSDP_SHM");
      std::printf("# mfsdp collective bandwidth, %d ranks, fp32, Gloo communicator (%s)\n",
                  comm->size(), shm != nullptr && std::string(shm) == "0"
                                    ? "TCP: MFSDP_SHM=0"
                                    : "shared memory when all ranks share a host, else TCP");
      std::printf("# ours: mfsdp Gloo communicator; c10d: ProcessGroupGloo (1.13) with workarounds\n");
      std::printf("# time: median of %d interleaved trials; speedup = c10d time / ours time (>1: ours faster)\n",
                  args.trials);
      std::printf("%-15s %8s | %10s %9s %9s | %10s %9s %9s | %7s\n", "op", "size", "ours us",
                  "algbw", "busbw", "c10d us", "algbw", "busbw", "speedup");
    }
    for (const std::string& op : args.ops) {
      for (int64_t bytes = args.min_bytes; bytes <= args.max_bytes; bytes *= args.step_factor) {
        Case c = make_case(op, bytes, *comm, *pg);
        auto [ours, base] = time_pair(*comm, bytes, c.ours, c.c10d, args.trials);
        if (print) {
          auto gbs = [&](double s) { return bytes / s / 1e9; };
          std::printf("%-15s %8s | %10.1f %9.3f %9.3f | %10.1f %9.3f %9.3f | %7.2f\n", op.c_str(),
                      human(bytes).c_str(), ours * 1e6, gbs(ours), gbs(ours) * c.bus_factor,
                      base * 1e6, gbs(base), gbs(base) * c.bus_factor, base / ours);
          std::fflush(stdout);
        }
      }
    }
    comm->barrier();
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "collective_bandwidth: " << e.what() << std::endl;
    return 1;
  }
}
