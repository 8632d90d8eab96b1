#include "comm/collective_args.h"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include <algorithm>
#include <numeric>
#include <sstream>
#include <stdexcept>

namespace mfsdp {
namespace {

[[noreturn]] void bad_call(const char* op, const std::string& what) {
  throw std::invalid_argument(std::string(op) + ": " + what);
}

std::string join(const std::vector<int64_t>& v) {
  std::ostringstream s;
  for (size_t i = 0; i < v.size(); ++i) s << (i ? "," : "") << v[i];
  return s.str();
}

RankSlices checked_counts(const char* op, const std::vector<int64_t>& counts, int world) {
  if (static_cast<int>(counts.size()) != world)
    bad_call(op, "counts has " + std::to_string(counts.size()) + " entries, world size is " +
                     std::to_string(world));
  for (int64_t c : counts)
    if (c < 0) bad_call(op, "negative count in counts [" + join(counts) + "]");
  return slices_from_counts(counts);
}

}  // namespace

int64_t RankSlices::max_count() const {
  return counts.empty() ? 0 : *std::max_element(counts.begin(), counts.end());
}

RankSlices slices_from_counts(const std::vector<int64_t>& counts) {
  RankSlices s;
  s.counts = counts;
  s.offsets.resize(counts.size());
  for (size_t i = 0; i < counts.size(); ++i) {
    s.offsets[i] = s.total;
    s.total += counts[i];
  }
  return s;
}

RankSlices even_slices(int64_t numel, int world) {
  std::vector<int64_t> counts(world, numel / world);
  for (int64_t i = 0; i < numel % world; ++i) counts[i] += 1;
  return slices_from_counts(counts);
}

std::string device_mismatch(const at::Device& tensor, const at::Device& comm) {
  const bool index_differs = comm.has_index() && tensor.has_index() && tensor.index() != comm.index();
  if (tensor.type() == comm.type() && !index_differs) return "";
  std::ostringstream s;
  s << "is on " << tensor << ", this communicator works on ";
  if (comm.has_index()) {
    s << comm;
  } else {
    s << c10::DeviceTypeName(comm.type());
  }
  s << " tensors";
  return s.str();
}

void check_tensor(const char* op, const char* role, const at::Tensor& t, const at::Device& device) {
  if (!t.defined()) bad_call(op, std::string(role) + " tensor is undefined");
  const std::string mismatch = device_mismatch(t.device(), device);
  if (!mismatch.empty()) bad_call(op, std::string(role) + " tensor " + mismatch);
  if (!t.is_contiguous()) bad_call(op, std::string(role) + " tensor is not contiguous");
}

void check_tensor(const char* op, const char* role, const at::Tensor& t, c10::DeviceType device) {
  check_tensor(op, role, t, at::Device(device));
}

void check_p2p_ops(const std::vector<P2POp>& ops, int rank, int world, const at::Device& device) {
  for (size_t i = 0; i < ops.size(); ++i) {
    const P2POp& op = ops[i];
    const bool send = op.kind == P2POp::Kind::kSend;
    const std::string what = "op " + std::to_string(i) + " (" + (send ? "send to" : "recv from") + " rank " +
                             std::to_string(op.peer) + ")";
    if (op.peer < 0 || op.peer >= world)
      bad_call("send_recv", what + ": peer " + std::to_string(op.peer) + " is outside [0, " +
                                std::to_string(world) + ")");
    if (op.peer == rank)
      bad_call("send_recv", what + ": peer " + std::to_string(op.peer) + " is this rank itself");
    check_tensor("send_recv", what.c_str(), op.tensor, device);
  }
}

void check_p2p_ops(const std::vector<P2POp>& ops, int rank, int world, c10::DeviceType device) {
  check_p2p_ops(ops, rank, world, at::Device(device));
}

RankSlices all_gather_layout(const at::Tensor& output, const at::Tensor& input,
                             const AllGatherOptions& options, int rank, int world,
                             const at::Device& device) {
  const char* op = "all_gather";
  check_tensor(op, "output", output, device);
  check_tensor(op, "input", input, device);
  if (output.scalar_type() != input.scalar_type())
    bad_call(op, std::string("output dtype ") + c10::toString(output.scalar_type()) +
                     " differs from input dtype " + c10::toString(input.scalar_type()));
  RankSlices s = options.counts.empty()
                     ? slices_from_counts(std::vector<int64_t>(world, input.numel()))
                     : checked_counts(op, options.counts, world);
  if (s.counts[rank] != input.numel())
    bad_call(op, "rank " + std::to_string(rank) + " has " + std::to_string(input.numel()) +
                     " input elements but counts[" + std::to_string(rank) + "] is " +
                     std::to_string(s.counts[rank]));
  if (output.numel() != s.total)
    bad_call(op, "output has " + std::to_string(output.numel()) + " elements, expected " +
                     std::to_string(s.total) + " (counts [" + join(s.counts) + "])");
  return s;
}

RankSlices reduce_scatter_layout(const at::Tensor& output, const at::Tensor& input,
                                 const ReduceScatterOptions& options, int rank, int world,
                                 const at::Device& device) {
  const char* op = "reduce_scatter";
  check_tensor(op, "output", output, device);
  check_tensor(op, "input", input, device);
  if (output.scalar_type() != input.scalar_type())
    bad_call(op, std::string("output dtype ") + c10::toString(output.scalar_type()) +
                     " differs from input dtype " + c10::toString(input.scalar_type()));
  check_reduction(op, options.op, input.scalar_type(), options.prescale);
  RankSlices s;
  if (options.counts.empty()) {
    if (input.numel() % world != 0)
      bad_call(op, "input has " + std::to_string(input.numel()) +
                       " elements, not divisible by world size " + std::to_string(world) +
                       "; pass counts for uneven shards");
    s = slices_from_counts(std::vector<int64_t>(world, input.numel() / world));
  } else {
    s = checked_counts(op, options.counts, world);
  }
  if (input.numel() != s.total)
    bad_call(op, "input has " + std::to_string(input.numel()) + " elements, counts [" +
                     join(s.counts) + "] sum to " + std::to_string(s.total));
  if (output.numel() != s.counts[rank])
    bad_call(op, "output has " + std::to_string(output.numel()) + " elements, counts[" +
                     std::to_string(rank) + "] is " + std::to_string(s.counts[rank]));
  return s;
}

AllToAllLayout all_to_all_layout(const at::Tensor& output, const at::Tensor& input,
                                 const AllToAllOptions& options, int rank, int world,
                                 const at::Device& device) {
  const char* op = "all_to_all_single";
  const std::string me = "rank " + std::to_string(rank) + ": ";
  check_tensor(op, (me + "output").c_str(), output, device);
  check_tensor(op, (me + "input").c_str(), input, device);
  if (output.scalar_type() != input.scalar_type())
    bad_call(op, me + "output dtype " + c10::toString(output.scalar_type()) +
                     " differs from input dtype " + c10::toString(input.scalar_type()));
  if (input.dim() == 0 || output.dim() == 0)
    bad_call(op, me + "input and output need a dim 0 to split (got shapes " +
                     c10::str(input.sizes()) + " and " + c10::str(output.sizes()) + ")");
  if (input.sizes().slice(1) != output.sizes().slice(1))
    bad_call(op, me + "input rows have shape " + c10::str(input.sizes().slice(1)) +
                     ", output rows " + c10::str(output.sizes().slice(1)) +
                     " (input " + c10::str(input.sizes()) + ", output " +
                     c10::str(output.sizes()) + ")");
  // Writing received rows over rows still to be sent would corrupt them (meta tensors have no
  // memory to overlap).
  if (device.type() != c10::kMeta) {
    const auto overlap = at::get_overlap_status(output, input);
    if (overlap == at::MemOverlapStatus::Full || overlap == at::MemOverlapStatus::Partial)
      bad_call(op, me + "output and input overlap (it cannot run in place)");
  }
  auto split_rows = [&](const std::vector<int64_t>& splits, const char* name, int64_t dim0,
                        const char* role) {
    if (splits.empty()) {
      if (dim0 % world != 0)
        bad_call(op, me + role + " has " + std::to_string(dim0) +
                         " rows, not divisible by world size " + std::to_string(world) + "; pass " +
                         name + " for uneven splits");
      return std::vector<int64_t>(world, dim0 / world);
    }
    if (static_cast<int>(splits.size()) != world)
      bad_call(op, me + name + " has " + std::to_string(splits.size()) + " entries [" +
                       join(splits) + "], world size is " + std::to_string(world));
    int64_t sum = 0;
    for (int64_t c : splits) {
      if (c < 0) bad_call(op, me + "negative split in " + name + " [" + join(splits) + "]");
      sum += c;
    }
    if (sum != dim0)
      bad_call(op, me + name + " [" + join(splits) + "] sum to " + std::to_string(sum) + ", " +
                       role + " has " + std::to_string(dim0) + " rows");
    return splits;
  };
  const std::vector<int64_t> in =
      split_rows(options.input_split_sizes, "input_split_sizes", input.size(0), "input");
  const std::vector<int64_t> out =
      split_rows(options.output_split_sizes, "output_split_sizes", output.size(0), "output");
  if (in[rank] != out[rank])
    bad_call(op, me + "sends itself " + std::to_string(in[rank]) + " rows (input_split_sizes[" +
                     std::to_string(rank) + "]) but expects " + std::to_string(out[rank]) +
                     " from itself (output_split_sizes[" + std::to_string(rank) + "])");
  const int64_t row = c10::multiply_integers(input.sizes().slice(1));
  auto elements = [&](std::vector<int64_t> rows) {
    for (int64_t& c : rows) c *= row;
    return slices_from_counts(rows);
  };
  return {elements(in), elements(out)};
}

RankSlices all_gather_layout(const at::Tensor& output, const at::Tensor& input,
                             const AllGatherOptions& options, int rank, int world,
                             c10::DeviceType device) {
  return all_gather_layout(output, input, options, rank, world, at::Device(device));
}
RankSlices reduce_scatter_layout(const at::Tensor& output, const at::Tensor& input,
                                 const ReduceScatterOptions& options, int rank, int world,
                                 c10::DeviceType device) {
  return reduce_scatter_layout(output, input, options, rank, world, at::Device(device));
}
AllToAllLayout all_to_all_layout(const at::Tensor& output, const at::Tensor& input,
                                 const AllToAllOptions& options, int rank, int world,
                                 c10::DeviceType device) {
  return all_to_all_layout(output, input, options, rank, world, at::Device(device));
}

void check_reduction(const char* op, ReduceOp reduce, at::ScalarType dtype, double prescale) {
  if (dtype == at::kBool || c10::isComplexType(dtype))
    bad_call(op, std::string("cannot reduce dtype ") + c10::toString(dtype));
  bool floating = c10::isFloatingType(dtype);
  if (reduce == ReduceOp::kAvg && !floating)
    bad_call(op, std::string("average needs a floating-point dtype, got ") + c10::toString(dtype));
  if (prescale != 1.0 && !floating)
    bad_call(op, std::string("prescale needs a floating-point dtype, got ") + c10::toString(dtype));
}

GroupPlan plan_group(const std::vector<int>& ranks, const std::string& name, int rank, int size,
                     const std::vector<int>& global_ranks, std::map<std::string, int>& created) {
  GroupPlan plan;
  std::ostringstream key;
  key << "group/" << name << "/";
  for (size_t i = 0; i < ranks.size(); ++i) {
    int r = ranks[i];
    if (r < 0 || r >= size || (i > 0 && r <= ranks[i - 1]))
      throw std::invalid_argument("new_group '" + name + "': ranks must be ascending and within [0, " +
                                  std::to_string(size) + ")");
    if (r == rank) plan.my_index = static_cast<int>(i);
    plan.global_ranks.push_back(global_ranks[r]);
    key << r << ",";
  }
  if (plan.my_index < 0)
    throw std::invalid_argument("new_group '" + name + "': rank " + std::to_string(rank) +
                                " is not among the group's ranks");
  key << "#" << created[key.str()]++;
  plan.store_prefix = key.str();
  return plan;
}

at::ScalarType accumulation_dtype(at::ScalarType dtype) {
  return (dtype == at::kBFloat16 || dtype == at::kHalf) ? at::kFloat : dtype;
}

void reduce_in_rank_order(at::Tensor out, int n, const std::function<at::Tensor(int)>& part, ReduceOp op,
                          double prescale) {
  out.copy_(part(0));
  if (prescale != 1.0) out.mul_(prescale);
  for (int q = 1; q < n; ++q) {
    if (op == ReduceOp::kMax) {
      at::maximum_out(out, out, prescale == 1.0 ? part(q) : part(q).to(out.scalar_type()) * prescale);
    } else if (prescale == 1.0) {
      out.add_(part(q));  // integers take no scalar factor
    } else {
      out.add_(part(q), prescale);
    }
  }
}

}  // namespace mfsdp
