// Argument checks and element layouts shared by the communicator backends, so every backend
// rejects the same bad calls with the same messages before any traffic starts.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "mfsdp/comm/comm.h"

namespace mfsdp {

// Per-rank element counts and their prefix offsets of one collective.
struct RankSlices {
  std::vector<int64_t> counts;   // [world]
  std::vector<int64_t> offsets;  // [world], offsets[r] = sum(counts[:r])
  int64_t total = 0;
  int64_t max_count() const;
};

RankSlices slices_from_counts(const std::vector<int64_t>& counts);
// numel split into `world` contiguous slices that differ by at most one element.
RankSlices even_slices(int64_t numel, int world);

// Why a tensor on `tensor` may not go to a communicator working on `comm`, "" when it may: the
// device types differ, or both name an index and the indexes differ. A `comm` without an index
// (at::kCPU, or a bare c10::DeviceType below) takes every index of its type. NCCL checks pointers
// only with NCCL_CHECK_POINTERS=1, so a tensor of another GPU would otherwise be an
// illegal-address crash rather than an error naming it.
std::string device_mismatch(const at::Device& tensor, const at::Device& comm);

// Throws std::invalid_argument naming `op` and `role` (and both devices) unless `t` is defined,
// contiguous and on `device` (device_mismatch). The c10::DeviceType forms check the type only.
void check_tensor(const char* op, const char* role, const at::Tensor& t, const at::Device& device);
void check_tensor(const char* op, const char* role, const at::Tensor& t, c10::DeviceType device);

// Validates an all-gather call (dtype match, counts, output size) and returns its layout.
RankSlices all_gather_layout(const at::Tensor& output, const at::Tensor& input,
                             const AllGatherOptions& options, int rank, int world,
                             const at::Device& device);
RankSlices all_gather_layout(const at::Tensor& output, const at::Tensor& input,
                             const AllGatherOptions& options, int rank, int world,
                             c10::DeviceType device);
// Validates a reduce-scatter call and returns its layout.
RankSlices reduce_scatter_layout(const at::Tensor& output, const at::Tensor& input,
                                 const ReduceScatterOptions& options, int rank, int world,
                                 const at::Device& device);
RankSlices reduce_scatter_layout(const at::Tensor& output, const at::Tensor& input,
                                 const ReduceScatterOptions& options, int rank, int world,
                                 c10::DeviceType device);
// An all-to-all in elements of the flat input and output: send.counts[r] elements (from
// send.offsets[r]) of the input go to rank r, recv.counts[q] elements of the output come from
// rank q. send.counts[rank] == recv.counts[rank] (checked: the own rows are a local copy).
struct AllToAllLayout {
  RankSlices send;
  RankSlices recv;
};
// Validates an all_to_all_single call (tensors, dtypes, trailing shapes, splits, no overlap) and
// returns its layout. The peers' splits cannot be checked here (the backends do what they can).
AllToAllLayout all_to_all_layout(const at::Tensor& output, const at::Tensor& input,
                                 const AllToAllOptions& options, int rank, int world,
                                 const at::Device& device);
AllToAllLayout all_to_all_layout(const at::Tensor& output, const at::Tensor& input,
                                 const AllToAllOptions& options, int rank, int world,
                                 c10::DeviceType device);
// Validates a send_recv batch (Communicator::send_recv_async): every op's peer is another rank
// of [0, world), its tensor defined, contiguous and on `device`; throws std::invalid_argument
// naming send_recv, the op's index and the problem.
void check_p2p_ops(const std::vector<P2POp>& ops, int rank, int world, const at::Device& device);
void check_p2p_ops(const std::vector<P2POp>& ops, int rank, int world, c10::DeviceType device);
// Rejects reductions the dtype cannot do (kAvg or a prescale on integers, bool, complex).
void check_reduction(const char* op, ReduceOp reduce, at::ScalarType dtype, double prescale);

// A subgroup of a communicator (Communicator::new_group), validated.
struct GroupPlan {
  int my_index = -1;             // this rank's rank in the group
  std::vector<int> global_ranks; // global rank of each member
  std::string store_prefix;      // unique per (ranks, name, creation count)
};
// Throws std::invalid_argument unless `ranks` is ascending, within [0, size) and contains
// `rank`. `created` counts earlier creations of the same group, so that creating it again does
// not read the first one's addresses from the store.
GroupPlan plan_group(const std::vector<int>& ranks, const std::string& name, int rank, int size,
                     const std::vector<int>& global_ranks, std::map<std::string, int>& created);

// The dtype reductions accumulate in: fp32 for bf16/fp16, the dtype itself otherwise.
at::ScalarType accumulation_dtype(at::ScalarType dtype);

// out = the reduction `op` (kSum or kMax; kAvg sums, the caller divides) of prescale x part(q)
// over q = 0 .. n-1, in rank order, in out's dtype (the accumulation dtype; parts may be in a
// lower one): every backend that combines received slices itself computes the same bits.
void reduce_in_rank_order(at::Tensor out, int n, const std::function<at::Tensor(int)>& part, ReduceOp op,
                          double prescale);

}  // namespace mfsdp
