#include <torch/torch.h>

#include "harness/dist_test.h"
#include "mfsdp/comm/device_mesh.h"

namespace {
std::shared_ptr<mfsdp::Communicator> borrow(mfsdp::Communicator& comm) {
  return std::shared_ptr<mfsdp::Communicator>(&comm, [](mfsdp::Communicator*) {});
}
}  // namespace

// HSDP-style 2-D mesh: all-reduce along each dimension sums exactly the ranks that share the
// other coordinate (computed here independently from the row-major layout).
MFSDP_DIST_TEST(DeviceMesh, SubCommunicatorsPerDimension, {1, 2, 3, 4}) {
  const int world = comm.size(), rank = comm.rank();
  const int outer = world == 4 ? 2 : 1, shard = world / outer;
  mfsdp::DeviceMesh mesh(borrow(comm), {outer, shard}, {"dp_outer", "dp_shard"});
  EXPECT_EQ(mesh.size("dp_outer"), outer);
  EXPECT_EQ(mesh.size("dp_shard"), shard);
  EXPECT_EQ(mesh.coordinate("dp_outer"), rank / shard);
  EXPECT_EQ(mesh.coordinate("dp_shard"), rank % shard);
  EXPECT_EQ(mesh.get("dp_shard")->size(), shard);
  EXPECT_EQ(mesh.get("dp_shard")->rank(), rank % shard);

  at::Tensor t = at::full({3}, static_cast<double>(rank));
  mesh.get("dp_shard")->all_reduce(t);
  double row = 0;
  for (int j = 0; j < shard; ++j) row += (rank / shard) * shard + j;
  EXPECT_TRUE(at::equal(t, at::full({3}, row))) << t;

  at::Tensor u = at::full({2}, static_cast<double>(rank));
  mesh.get("dp_outer")->all_reduce(u);
  double column = 0;
  for (int i = 0; i < outer; ++i) column += i * shard + rank % shard;
  EXPECT_TRUE(at::equal(u, at::full({2}, column))) << u;

  // Gather along a dimension lands in group-rank order.
  at::Tensor gathered = at::empty({shard});
  mesh.get("dp_shard")->all_gather(gathered, at::full({1}, static_cast<double>(rank)));
  std::vector<int> ranks = mesh.group_ranks("dp_shard");
  for (int j = 0; j < shard; ++j) EXPECT_EQ(gathered[j].item<double>(), ranks[j]);
}

MFSDP_DIST_TEST(DeviceMesh, RejectsBadShapes, {2}) {
  EXPECT_THROW(mfsdp::DeviceMesh(borrow(comm), {3}, {"dp"}), std::invalid_argument);
  EXPECT_THROW(mfsdp::DeviceMesh(borrow(comm), {1, 2}, {"dp", "dp"}), std::invalid_argument);
  EXPECT_THROW(mfsdp::DeviceMesh(borrow(comm), {2}, {"a", "b"}), std::invalid_argument);
  mfsdp::DeviceMesh mesh(borrow(comm), {2}, {"dp"});
  try {
    mesh.get("tp");
    ADD_FAILURE() << "unknown dimension accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("no dimension 'tp'"), std::string::npos) << e.what();
  }
}
