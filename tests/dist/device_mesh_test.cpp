#include <torch/torch.h>

#include "harness/dist_test.h"
#include "mfsdp/comm/device_mesh.h"
#include "mfsdp/comm/simulated_comm.h"

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

// Flattened dimensions and submeshes (TorchTitan's "dp_shard_cp", mesh["dp_replicate",
// "dp_shard_cp"]): on 4 real ranks as [2, 2], the flattened pair is the world itself, a submesh
// sums exactly its ranks, and meshes sharing a cache make each group once.
MFSDP_DIST_TEST(DeviceMesh, FlattenAndSubmeshShareOneCommunicatorPerGroup, {4}) {
  const int rank = comm.rank();
  auto cache = std::make_shared<mfsdp::GroupCache>();
  mfsdp::DeviceMesh mesh(borrow(comm), {2, 2}, {"outer", "inner"}, cache);
  EXPECT_EQ(cache->made(), 2);
  EXPECT_EQ(mesh.flatten({"outer", "inner"}, "both").get(), &comm);  // the world: nothing made
  mfsdp::DeviceMesh same(borrow(comm), {2, 2}, {"rows", "columns"}, cache);
  EXPECT_EQ(cache->made(), 2);
  EXPECT_EQ(same.get("rows"), mesh.get("outer"));
  EXPECT_EQ(same.get("columns"), mesh.get("inner"));
  EXPECT_THROW(mesh.flatten({"outer", "both"}, "again"), std::invalid_argument);  // overlapping
  EXPECT_THROW(mesh.flatten({"inner"}, "outer"), std::invalid_argument);          // a taken name

  const std::shared_ptr<mfsdp::DeviceMesh> inner = mesh.submesh({"inner"});
  EXPECT_EQ(inner->world(), mesh.get("inner"));
  EXPECT_EQ(inner->dim_names(), std::vector<std::string>{"inner"});
  at::Tensor t = at::full({1}, static_cast<double>(rank));
  inner->world()->all_reduce(t);
  EXPECT_EQ(t.item<double>(), (rank / 2) * 4 + 1);  // {0, 1} or {2, 3}
  const std::shared_ptr<mfsdp::DeviceMesh> whole = mesh.submesh({"outer", "inner"});
  EXPECT_EQ(whole->world().get(), &comm);
  EXPECT_EQ(whole->shape(), (std::vector<int>{2, 2}));
  EXPECT_EQ(whole->coordinate("outer"), rank / 2);
  EXPECT_THROW(mesh.submesh({"inner", "outer"}), std::invalid_argument);  // inner dimension first
}

// A flattened pair that is not adjacent: on 8 (simulated) ranks as [2, 2, 2], {"a", "c"} holds
// the ranks with this rank's "b" (computed here from the row-major layout), in ascending order.
TEST(DeviceMesh, FlattensDimensionsThatAreNotAdjacent) {
  for (int rank = 0; rank < 8; ++rank) {
    mfsdp::DeviceMesh mesh(mfsdp::make_simulated_communicator(rank, 8, at::Device(at::kCPU)), {2, 2, 2},
                           {"a", "b", "c"});
    const std::shared_ptr<mfsdp::Communicator> ac = mesh.flatten({"a", "c"}, "ac");
    std::vector<int> want;
    for (int r = 0; r < 8; ++r)
      if ((r / 2) % 2 == (rank / 2) % 2) want.push_back(r);
    EXPECT_EQ(mesh.group_ranks("ac"), want) << rank;
    EXPECT_EQ(ac->size(), 4);
    EXPECT_EQ(mesh.coordinate("ac"), std::find(want.begin(), want.end(), rank) - want.begin());
    EXPECT_EQ(ac->rank(), mesh.coordinate("ac"));
    EXPECT_EQ(mesh.size("ac"), 4);
  }
}
