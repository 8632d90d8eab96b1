// DeviceMesh: the ranks of a communicator arranged as a grid with named dimensions, with one
// sub-communicator per dimension (e.g. HSDP: {"dp_outer", "dp_shard"} = replicate x shard).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "mfsdp/comm/comm.h"

namespace mfsdp {

class DeviceMesh {
 public:
  // Lays the ranks of `world` out row-major over `shape` (the last dimension varies fastest, as
  // in PyTorch's init_device_mesh) and creates this rank's sub-communicator along every
  // dimension. Collective over `world`. Throws std::invalid_argument when the product of
  // `shape` differs from the world size, or names are empty, repeated or of the wrong count.
  DeviceMesh(std::shared_ptr<Communicator> world, std::vector<int> shape,
             std::vector<std::string> dim_names);

  const std::vector<std::string>& dim_names() const { return dim_names_; }
  const std::vector<int>& shape() const { return shape_; }
  // Number of ranks along `dim`.
  int size(const std::string& dim) const;
  // This rank's index along `dim` (== the rank in get(dim)).
  int coordinate(const std::string& dim) const;
  // World ranks of the group this rank belongs to along `dim`, in group-rank order.
  std::vector<int> group_ranks(const std::string& dim) const;
  // The communicator among the ranks that differ from this one only along `dim`.
  std::shared_ptr<Communicator> get(const std::string& dim) const;
  std::shared_ptr<Communicator> world() const { return world_; }

 private:
  int dim_index(const std::string& dim) const;  // throws naming the unknown dimension

  std::shared_ptr<Communicator> world_;
  std::vector<int> shape_;
  std::vector<std::string> dim_names_;
  std::vector<int> coordinates_;                      // this rank's index along each dim
  std::vector<std::shared_ptr<Communicator>> groups_;  // one per dim
};

}  // namespace mfsdp
