#include <gtest/gtest.h>
#include <torch/torch.h>

#include "comm/collective_args.h"
#include "mfsdp/comm/simulated_comm.h"

TEST(CollectiveArgs, EvenSlicesDifferByAtMostOne) {
  auto s = mfsdp::even_slices(10, 4);
  EXPECT_EQ(s.counts, (std::vector<int64_t>{3, 3, 2, 2}));
  EXPECT_EQ(s.offsets, (std::vector<int64_t>{0, 3, 6, 8}));
  EXPECT_EQ(s.total, 10);
  EXPECT_EQ(s.max_count(), 3);
  auto z = mfsdp::even_slices(1, 3);
  EXPECT_EQ(z.counts, (std::vector<int64_t>{1, 0, 0}));
}

TEST(CollectiveArgs, AccumulationDtype) {
  EXPECT_EQ(mfsdp::accumulation_dtype(at::kBFloat16), at::kFloat);
  EXPECT_EQ(mfsdp::accumulation_dtype(at::kHalf), at::kFloat);
  EXPECT_EQ(mfsdp::accumulation_dtype(at::kFloat), at::kFloat);
  EXPECT_EQ(mfsdp::accumulation_dtype(at::kDouble), at::kDouble);
  EXPECT_EQ(mfsdp::accumulation_dtype(at::kLong), at::kLong);
}

TEST(CollectiveArgs, UnevenReduceScatterLayout) {
  mfsdp::ReduceScatterOptions o;
  o.counts = {2, 0, 5};
  auto s = mfsdp::reduce_scatter_layout(at::empty({5}), at::empty({7}), o, 2, 3, c10::kCPU);
  EXPECT_EQ(s.offsets, (std::vector<int64_t>{0, 2, 2}));
  EXPECT_THROW(mfsdp::reduce_scatter_layout(at::empty({4}), at::empty({7}), o, 2, 3, c10::kCPU),
               std::invalid_argument);
  o.counts = {2, -1, 6};
  EXPECT_THROW(mfsdp::reduce_scatter_layout(at::empty({6}), at::empty({7}), o, 2, 3, c10::kCPU),
               std::invalid_argument);
}

namespace {

mfsdp::AllToAllOptions splits(std::vector<int64_t> in, std::vector<int64_t> out) {
  mfsdp::AllToAllOptions o;
  o.input_split_sizes = std::move(in);
  o.output_split_sizes = std::move(out);
  return o;
}

// The call is rejected with std::invalid_argument naming the op, the rank and every `part`.
void expect_a2a_rejected(const at::Tensor& output, const at::Tensor& input,
                         const mfsdp::AllToAllOptions& o, std::vector<std::string> parts) {
  parts.insert(parts.end(), {"all_to_all_single", "rank 1"});
  try {
    mfsdp::all_to_all_layout(output, input, o, /*rank=*/1, /*world=*/3, c10::kCPU);
    ADD_FAILURE() << "accepted; expected an error naming " << parts.back();
  } catch (const std::invalid_argument& e) {
    for (const std::string& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

}  // namespace

// Rank 1 of 3 sends rows {2, 0, 3} of 2 elements and receives rows {1, 0, 3}.
TEST(CollectiveArgs, AllToAllLayoutInElements) {
  auto l = mfsdp::all_to_all_layout(at::empty({4, 2}), at::empty({5, 2}), splits({2, 0, 3}, {1, 0, 3}),
                                    1, 3, c10::kCPU);
  EXPECT_EQ(l.send.counts, (std::vector<int64_t>{4, 0, 6}));
  EXPECT_EQ(l.send.offsets, (std::vector<int64_t>{0, 4, 4}));
  EXPECT_EQ(l.recv.counts, (std::vector<int64_t>{2, 0, 6}));
  EXPECT_EQ(l.recv.offsets, (std::vector<int64_t>{0, 2, 2}));
  // No split vectors: equal splits of dim 0, rows of 2 x 3 elements.
  auto e = mfsdp::all_to_all_layout(at::empty({6, 2, 3}, at::kBool), at::empty({6, 2, 3}, at::kBool),
                                    splits({}, {3, 2, 1}), 1, 3, c10::kCPU);
  EXPECT_EQ(e.send.counts, (std::vector<int64_t>{12, 12, 12}));
  EXPECT_EQ(e.recv.counts, (std::vector<int64_t>{18, 12, 6}));
}

TEST(CollectiveArgs, AllToAllLayoutTakesEmptyRowsAndMetaTensors) {
  auto z = mfsdp::all_to_all_layout(at::empty({0, 4}), at::empty({0, 4}), splits({0, 0, 0}, {}), 1, 3,
                                    c10::kCPU);
  EXPECT_EQ(z.send.total, 0);
  EXPECT_EQ(z.recv.counts, (std::vector<int64_t>{0, 0, 0}));
  auto meta = at::TensorOptions().device(at::kMeta);
  auto m = mfsdp::all_to_all_layout(at::empty({6, 8}, meta), at::empty({3, 8}, meta), splits({1, 1, 1}, {2, 1, 3}),
                                    1, 3, c10::kMeta);
  EXPECT_EQ(m.recv.counts, (std::vector<int64_t>{16, 8, 24}));
}

TEST(CollectiveArgs, AllToAllLayoutRejectsBadCalls) {
  const at::Tensor in = at::empty({5, 2}), out = at::empty({4, 2});
  expect_a2a_rejected(out, in, splits({2, 3}, {1, 0, 3}), {"input_split_sizes has 2 entries [2,3]", "world size is 3"});
  expect_a2a_rejected(out, in, splits({2, 0, 3}, {1, 0, 3, 0}), {"output_split_sizes has 4 entries"});
  expect_a2a_rejected(out, in, splits({2, 0, 2}, {1, 0, 3}), {"input_split_sizes [2,0,2] sum to 4", "input has 5 rows"});
  expect_a2a_rejected(out, in, splits({2, 0, 3}, {1, 0, 4}), {"output_split_sizes [1,0,4] sum to 5", "output has 4 rows"});
  expect_a2a_rejected(out, in, splits({3, -1, 3}, {1, -1, 4}), {"negative split in input_split_sizes [3,-1,3]"});
  expect_a2a_rejected(out, in, splits({}, {1, 0, 3}), {"input has 5 rows, not divisible by world size 3"});
  expect_a2a_rejected(at::empty({4, 2}, at::kLong), in, splits({2, 0, 3}, {1, 0, 3}), {"Long", "Float"});
  expect_a2a_rejected(at::empty({4, 3}), in, splits({2, 0, 3}, {1, 0, 3}), {"[2]", "[3]"});
  expect_a2a_rejected(at::empty({4, 2}), at::empty({5, 1, 2}), splits({2, 0, 3}, {1, 0, 3}), {"[1, 2]", "[2]"});
  expect_a2a_rejected(out, in, splits({2, 1, 2}, {1, 0, 3}), {"sends itself 1 rows", "expects 0"});
  expect_a2a_rejected(at::empty({}), at::empty({}), splits({}, {}), {"dim 0"});
  at::Tensor both = at::empty({6, 2});
  expect_a2a_rejected(both, both, splits({2, 2, 2}, {2, 2, 2}), {"overlap"});
  expect_a2a_rejected(both.narrow(0, 0, 4), both.narrow(0, 2, 4), splits({2, 2, 0}, {2, 2, 0}), {"overlap"});
  expect_a2a_rejected(out, at::empty({2, 5}).t(), splits({2, 0, 3}, {1, 0, 3}), {"not contiguous"});
}

// The simulated communicator checks the same and does the local part: its own rows exactly, the
// other slots as if every rank sent what this rank sends itself, cut or padded with zeros.
TEST(CollectiveArgs, SimulatedAllToAll) {
  auto comm = mfsdp::make_simulated_communicator(1, 3);
  at::Tensor in = at::arange(10, at::kFloat).view({5, 2});  // rows 0..4; rows 2..3 are for itself
  at::Tensor out = at::full({6, 2}, -1.f);
  comm->all_to_all_single(out, in, splits({2, 2, 1}, {3, 2, 1}));
  at::Tensor own = in.narrow(0, 2, 2);
  EXPECT_TRUE(at::equal(out.narrow(0, 0, 2), own));
  EXPECT_TRUE(at::equal(out[2], at::zeros({2})));
  EXPECT_TRUE(at::equal(out.narrow(0, 3, 2), own));
  EXPECT_TRUE(at::equal(out[5], own[0]));
  EXPECT_THROW(comm->all_to_all_single(out, in, splits({2, 2, 2}, {3, 2, 1})), std::invalid_argument);
  auto meta = mfsdp::make_simulated_communicator(0, 64, at::kMeta);
  at::Tensor m_out = at::empty({64 * 3, 16}, at::TensorOptions().device(at::kMeta));
  meta->all_to_all_single_async(m_out, at::empty({64 * 3, 16}, at::TensorOptions().device(at::kMeta)))->wait();
}

namespace {

const at::Device kCuda0(at::kCUDA, 0), kCuda1(at::kCUDA, 1);

// A tensor whose metadata says `device`, over host memory nothing reads: the checks look at
// metadata only, and this machine may have no GPU (let alone two).
at::Tensor tensor_on(const at::Device& device, std::vector<float>& memory) {
  return at::for_blob(memory.data(), {static_cast<int64_t>(memory.size())})
      .target_device(device)
      .options(at::TensorOptions().dtype(at::kFloat).device(device))
      .deleter([](void*) {})
      .make_tensor();
}

// `f` throws std::invalid_argument naming every one of `parts`.
template <class F>
void expect_refused(F f, std::vector<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "accepted; expected an error naming " << parts.front();
  } catch (const std::invalid_argument& e) {
    for (const std::string& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(CollectiveArgs, DeviceMismatchComparesTheIndexWhenTheCommunicatorHasOne) {
  EXPECT_EQ(mfsdp::device_mismatch(kCuda0, kCuda0), "");
  EXPECT_EQ(mfsdp::device_mismatch(kCuda1, kCuda1), "");
  EXPECT_EQ(mfsdp::device_mismatch(at::Device(at::kCPU), at::Device(at::kCPU)), "");
  EXPECT_EQ(mfsdp::device_mismatch(kCuda1, at::Device(at::kCUDA)), "");  // a type only: any index
  EXPECT_EQ(mfsdp::device_mismatch(kCuda1, kCuda0), "is on cuda:1, this communicator works on cuda:0 tensors");
  EXPECT_EQ(mfsdp::device_mismatch(kCuda0, kCuda1), "is on cuda:0, this communicator works on cuda:1 tensors");
  EXPECT_EQ(mfsdp::device_mismatch(at::Device(at::kCPU), kCuda0),
            "is on cpu, this communicator works on cuda:0 tensors");
  EXPECT_EQ(mfsdp::device_mismatch(kCuda0, at::Device(at::kCPU)), "is on cuda:0, this communicator works on CPU tensors");
}

// NCCL would take a cuda:1 tensor on a cuda:0 communicator and crash on an illegal address; the
// at::Device forms refuse it naming the op, the tensor's device and the communicator's.
TEST(CollectiveArgs, TensorOfAnotherGpuIsRefused) {
  std::vector<float> a(6), b(6), c(3), d(3);
  const at::Tensor out0 = tensor_on(kCuda0, a), out1 = tensor_on(kCuda1, b);
  const at::Tensor in0 = tensor_on(kCuda0, c), in1 = tensor_on(kCuda1, d);
  ASSERT_EQ(out1.device(), kCuda1);
  ASSERT_EQ(in0.device(), kCuda0);

  EXPECT_NO_THROW(mfsdp::check_tensor("all_reduce", "input", out0, kCuda0));
  expect_refused([&] { mfsdp::check_tensor("all_reduce", "input", out1, kCuda0); },
                 {"all_reduce: input tensor is on cuda:1, this communicator works on cuda:0 tensors"});
  // The c10::DeviceType form checks the type only, as before.
  EXPECT_NO_THROW(mfsdp::check_tensor("all_reduce", "input", out1, c10::kCUDA));
  expect_refused([&] { mfsdp::check_tensor("broadcast", "input", out0, c10::kCPU); },
                 {"broadcast: input tensor is on cuda:0, this communicator works on CPU tensors"});

  // Rank 0 of 2: 3 input elements, 6 output elements.
  EXPECT_EQ(mfsdp::all_gather_layout(out0, in0, {}, 0, 2, kCuda0).total, 6);
  expect_refused([&] { mfsdp::all_gather_layout(out0, in1, {}, 0, 2, kCuda0); }, {"all_gather", "input", "cuda:1", "cuda:0"});
  expect_refused([&] { mfsdp::all_gather_layout(out1, in1, {}, 0, 2, kCuda0); }, {"all_gather", "output", "cuda:1", "cuda:0"});
  EXPECT_EQ(mfsdp::reduce_scatter_layout(in1, out1, {}, 1, 2, kCuda1).counts[1], 3);
  expect_refused([&] { mfsdp::reduce_scatter_layout(in1, out0, {}, 0, 2, kCuda1); },
                 {"reduce_scatter", "input", "cuda:0", "cuda:1"});
  EXPECT_EQ(mfsdp::all_to_all_layout(out0, in0, splits({1, 2}, {1, 5}), 0, 2, kCuda0).recv.total, 6);
  expect_refused([&] { mfsdp::all_to_all_layout(out1, in0, splits({1, 2}, {1, 5}), 0, 2, kCuda0); },
                 {"all_to_all_single", "rank 0: output", "cuda:1", "cuda:0"});
}
