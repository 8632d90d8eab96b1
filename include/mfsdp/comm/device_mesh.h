// DeviceMesh: the ranks of a communicator arranged as a grid with named dimensions, with one
// sub-communicator per dimension (e.g. HSDP: {"dp_outer", "dp_shard"} = replicate x shard), as
// PyTorch's DeviceMesh: dimensions can be flattened into one (TorchTitan's "dp_shard_cp") and a
// mesh of some dimensions taken from it (mesh["dp_replicate", "dp_shard_cp"]).
//
// Every group is a set of (stride, size) steps in the world's rank space, so two meshes over the
// same world (the dense and the expert mesh of train/parallel_dims.h) that share a GroupCache
// make each group's communicator once: every rank computes the same key for a group, so all
// ranks find it or all make it, and new_group stays collective.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "mfsdp/comm/comm.h"

namespace mfsdp {

// The communicators made over one world, by group. Shared by the meshes built over that world.
class GroupCache {
 public:
  // One step of a group in the world's rank space: `size` ranks `stride` apart.
  using Steps = std::vector<std::pair<int, int>>;  // (stride, size), strides descending
  // The group of `world`'s ranks that differ from this rank only along `steps`; made by
  // world->new_group (collective over `world`) the first time, then found.
  std::shared_ptr<Communicator> get(const std::shared_ptr<Communicator>& world, const Steps& steps,
                                    const std::string& name);
  int made() const { return made_; }  // communicators made so far (tests: each group once)

 private:
  std::map<Steps, std::shared_ptr<Communicator>> groups_;
  int made_ = 0;
};

class DeviceMesh {
 public:
  // Lays the ranks of `world` out row-major over `shape` (the last dimension varies fastest, as
  // in PyTorch's init_device_mesh) and creates this rank's sub-communicator along every
  // dimension, in `cache` (a new one when null). Collective over `world`. Throws
  // std::invalid_argument when the product of `shape` differs from the world size, or names are
  // empty, repeated or of the wrong count.
  DeviceMesh(std::shared_ptr<Communicator> world, std::vector<int> shape, std::vector<std::string> dim_names,
             std::shared_ptr<GroupCache> cache = nullptr);

  // The mesh's own dimensions, outermost first (flattened ones are not among them).
  const std::vector<std::string>& dim_names() const { return dim_names_; }
  const std::vector<int>& shape() const { return shape_; }
  // Number of ranks along `dim` (a dimension or a flattened one).
  int size(const std::string& dim) const;
  // This rank's index along `dim` (== the rank in get(dim)).
  int coordinate(const std::string& dim) const;
  // World ranks of the group this rank belongs to along `dim`, in group-rank order.
  std::vector<int> group_ranks(const std::string& dim) const;
  // The communicator among the ranks that differ from this one only along `dim`.
  std::shared_ptr<Communicator> get(const std::string& dim) const;
  // The communicator this mesh spans: the world for a mesh built over it, the group of all its
  // dimensions for a submesh.
  std::shared_ptr<Communicator> world() const { return span_; }
  bool has(const std::string& dim) const;

  // A dimension `name` over the ranks that differ from this one only along `dims` (any of the
  // mesh's dimensions, flattened ones included, disjoint), e.g. flatten({"dp_shard", "cp"},
  // "dp_shard_cp"). Collective over the world unless the cache holds that group. Returns its
  // communicator. Throws std::invalid_argument for an unknown, repeated or taken name.
  std::shared_ptr<Communicator> flatten(const std::vector<std::string>& dims, const std::string& name);
  // The mesh of `dims` (dimensions or flattened ones, outermost first, disjoint): its world()
  // is their joint group, its get() the same communicators as this mesh's. Collective over the
  // world unless the cache holds the joint group.
  std::shared_ptr<DeviceMesh> submesh(const std::vector<std::string>& dims) const;

 private:
  struct Dim {
    std::string name;
    GroupCache::Steps steps;  // in the world's rank space
    std::shared_ptr<Communicator> group;
  };
  DeviceMesh() = default;
  const Dim& dim(const std::string& name) const;  // throws naming the unknown dimension
  GroupCache::Steps joint_steps(const std::vector<std::string>& dims, const std::string& what) const;

  std::shared_ptr<Communicator> root_;  // the world every group is carved from
  std::shared_ptr<Communicator> span_;
  std::shared_ptr<GroupCache> cache_;
  std::vector<int> shape_;
  std::vector<std::string> dim_names_;
  std::vector<Dim> dims_;  // the mesh's dimensions, then flattened ones
};

}  // namespace mfsdp
