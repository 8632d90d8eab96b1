// Collective bandwidth in the style of nccl-tests: for each size, the time of our communicator's
// all_gather / reduce_scatter / all_reduce / all_to_all_single (fp32, equal splits): the CPU communicator (--backend gloo, the
// default) or the NCCL one on CUDA tensors (--backend nccl, one GPU per rank: cuda:LOCAL_RANK).
// bench/collective_bandwidth.sh runs it and the c10d baseline (bench/torch_collective_bandwidth.py:
// ProcessGroupGloo or ProcessGroupNCCL of the same torch) round after round and prints both with
// the ratio.
//
//   mfsdp-run --nproc-per-node 2 build/bench/collective_bandwidth [--min-bytes 1K] [--max-bytes 256M]
//   mfsdp-run --nproc-per-node <GPUs> build/bench/collective_bandwidth --backend nccl
//
// NCCL: a collective's wait() only orders the caller's stream after it, so each timed trial ends
// with a synchronisation of the device (device-agnostic, at::accelerator: no CUDA headers here,
// and the file builds against a CPU-only LibTorch too). One GPU gives a world of 1 rank: a valid
// but degenerate measurement (no data moves between GPUs; busbw is 0).
// size: bytes of the full (unsharded) buffer, as nccl-tests reports it. algbw = size / time;
// busbw = algbw * (n-1)/n for all_gather, reduce_scatter and all_to_all_single (whose size is
// each rank's input, as nccl-tests' alltoall), * 2(n-1)/n for all_reduce.
#include <ATen/ATen.h>
#include <ATen/DeviceAccelerator.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "mfsdp/comm/comm.h"
namespace {

struct Args {
  int64_t min_bytes = 1 << 10;
  int64_t max_bytes = 256LL << 20;
  int64_t step_factor = 4;
  int trials = 9;
  std::string backend = "gloo";
  std::vector<std::string> ops = {"all_gather", "reduce_scatter", "all_reduce", "all_to_all_single"};
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
    else if (flag == "--backend") a.backend = value();
    else throw std::invalid_argument(
        "unknown flag " + flag + " (flags: --min-bytes --max-bytes --step-factor --op --trials --backend)");
  }
  if (a.step_factor < 2) throw std::invalid_argument("--step-factor must be >= 2");
  if (a.backend != "gloo" && a.backend != "nccl")
    throw std::invalid_argument("--backend: '" + a.backend + "' is not gloo or nccl");
  return a;
}

using Clock = std::chrono::steady_clock;

// The communicator and where its tensors live: the CPU (gloo) or this rank's GPU (nccl).
struct Bench {
  std::shared_ptr<mfsdp::Communicator> comm;
  at::Device device = at::kCPU;

  at::TensorOptions options(at::ScalarType dtype = at::kFloat) const {
    return at::TensorOptions().dtype(dtype).device(device);
  }
  // Returns once every collective issued so far has finished on this rank. CPU: wait() already
  // blocked. GPU: wait() only made the current stream wait, so synchronise the whole device (the
  // communicator's own stream included).
  void sync() const {
    if (device.is_cuda()) at::accelerator::synchronizeDevice(device.index());
  }
};

// Seconds per call of `op`: the mean over a trial of `iters` calls, slowest rank, after warm-up.
double time_trial(const Bench& b, int64_t bytes, const std::function<void()>& op) {
  const int iters = static_cast<int>(std::clamp<int64_t>((64LL << 20) / bytes, 3, 50));
  b.comm->barrier();
  b.sync();
  auto start = Clock::now();
  for (int i = 0; i < iters; ++i) op();
  b.sync();
  double local = std::chrono::duration<double>(Clock::now() - start).count() / iters;
  at::Tensor t = at::full({1}, local, b.options(at::kDouble));
  b.comm->all_reduce(t, {mfsdp::ReduceOp::kMax});  // the slowest rank defines the collective's time
  return t.item<double>();  // (a copy to the host: on a GPU it waits for the all_reduce)
}

// Median over `trials` trials, after a warm-up call (connections, buffers).
double time_median(const Bench& b, int64_t bytes, const std::function<void()>& op, int trials) {
  op();
  b.sync();
  std::vector<double> t;
  for (int i = 0; i < trials; ++i) t.push_back(time_trial(b, bytes, op));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

struct Case {
  std::function<void()> run;
  double bus_factor;
};

Case make_case(const std::string& op, int64_t bytes, const Bench& b) {
  mfsdp::Communicator& comm = *b.comm;
  const int n = comm.size();
  const int64_t numel = std::max<int64_t>(bytes / 4 / n, 1) * n;  // full buffer, divisible by n
  at::Tensor full = at::randn({numel}, b.options());
  at::Tensor part = at::randn({numel / n}, b.options());
  const double ring = double(n - 1) / n;
  if (op == "all_gather") return {[&comm, full, part] { comm.all_gather(full, part); }, ring};
  if (op == "reduce_scatter") return {[&comm, full, part] { comm.reduce_scatter(part, full); }, ring};
  if (op == "all_reduce") return {[&comm, full] { comm.all_reduce(full); }, 2 * ring};
  if (op == "all_to_all_single") {
    at::Tensor out = at::empty_like(full);
    return {[&comm, out, full] { comm.all_to_all_single(out, full); }, ring};
  }
  throw std::invalid_argument("--op: unknown operation '" + op +
                              "' (all_gather, reduce_scatter, all_reduce, all_to_all_single)");
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
    mfsdp::CommOptions options;
    options.backend = args.backend;
    options.timeout = std::chrono::milliseconds(300000);
    Bench b;
    if (args.backend == "nccl") {
      // One GPU per rank: cuda:LOCAL_RANK (mfsdp-run sets it; 0 when unset, as for a single
      // process), named explicitly so that the communicator and our tensors agree.
      const char* local = std::getenv("LOCAL_RANK");
      const int index = local != nullptr ? std::atoi(local) : 0;
      options.device_index = index;
      b.device = at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(index));
    }
    b.comm = mfsdp::init_communicator(options);
    const std::shared_ptr<mfsdp::Communicator>& comm = b.comm;
    if (comm->rank() == 0) {
      if (args.backend == "nccl") {
        std::printf("# mfsdp NCCL communicator, %d ranks, fp32, one GPU per rank\n", comm->size());
      } else {
        const char* shm = std::getenv("MFSDP_SHM");
        std::printf("# mfsdp CPU communicator (%s), %d ranks, fp32\n",
                    shm != nullptr && std::string(shm) == "0"
                        ? "TCP: MFSDP_SHM=0"
                        : "shared memory when all ranks share a host, else TCP",
                    comm->size());
      }
      std::printf("# time: median of %d trials\n", args.trials);
      std::printf("%-17s %8s | %10s %9s %9s\n", "op", "size", "us", "algbw", "busbw");
    }
    for (const std::string& op : args.ops) {
      for (int64_t bytes = args.min_bytes; bytes <= args.max_bytes; bytes *= args.step_factor) {
        Case c = make_case(op, bytes, b);
        double secs = time_median(b, bytes, c.run, args.trials);
        if (comm->rank() == 0) {
          double gbs = bytes / secs / 1e9;
          std::printf("%-17s %8s | %10.1f %9.3f %9.3f\n", op.c_str(), human(bytes).c_str(),
                      secs * 1e6, gbs, gbs * c.bus_factor);
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
