#include "mfsdp/comm/device_mesh.h"

#include <set>
#include <stdexcept>

namespace mfsdp {

DeviceMesh::DeviceMesh(std::shared_ptr<Communicator> world, std::vector<int> shape,
                       std::vector<std::string> dim_names)
    : world_(std::move(world)), shape_(std::move(shape)), dim_names_(std::move(dim_names)) {
  if (shape_.empty() || shape_.size() != dim_names_.size())
    throw std::invalid_argument("DeviceMesh: " + std::to_string(shape_.size()) +
                                " dimensions but " + std::to_string(dim_names_.size()) + " names");
  std::set<std::string> seen;
  long product = 1;
  for (size_t d = 0; d < shape_.size(); ++d) {
    if (dim_names_[d].empty() || !seen.insert(dim_names_[d]).second)
      throw std::invalid_argument("DeviceMesh: dimension name '" + dim_names_[d] +
                                  "' is empty or repeated");
    if (shape_[d] < 1)
      throw std::invalid_argument("DeviceMesh: dimension '" + dim_names_[d] + "' has size " +
                                  std::to_string(shape_[d]));
    product *= shape_[d];
  }
  if (product != world_->size())
    throw std::invalid_argument("DeviceMesh: shape holds " + std::to_string(product) +
                                " ranks but the world has " + std::to_string(world_->size()));
  // Row-major coordinates of this rank.
  coordinates_.resize(shape_.size());
  int rest = world_->rank();
  for (int d = static_cast<int>(shape_.size()) - 1; d >= 0; --d) {
    coordinates_[d] = rest % shape_[d];
    rest /= shape_[d];
  }
  for (size_t d = 0; d < shape_.size(); ++d)
    groups_.push_back(world_->new_group(group_ranks(dim_names_[d]), "mesh/" + dim_names_[d]));
}

int DeviceMesh::dim_index(const std::string& dim) const {
  for (size_t d = 0; d < dim_names_.size(); ++d)
    if (dim_names_[d] == dim) return static_cast<int>(d);
  std::string known;
  for (const auto& n : dim_names_) known += (known.empty() ? "" : ", ") + n;
  throw std::invalid_argument("DeviceMesh: no dimension '" + dim + "' (dimensions: " + known + ")");
}

int DeviceMesh::size(const std::string& dim) const { return shape_[dim_index(dim)]; }

int DeviceMesh::coordinate(const std::string& dim) const { return coordinates_[dim_index(dim)]; }

std::vector<int> DeviceMesh::group_ranks(const std::string& dim) const {
  const int target = dim_index(dim);
  std::vector<int> ranks;
  for (int i = 0; i < shape_[target]; ++i) {
    int rank = 0;
    for (size_t d = 0; d < shape_.size(); ++d)
      rank = rank * shape_[d] + (static_cast<int>(d) == target ? i : coordinates_[d]);
    ranks.push_back(rank);
  }
  return ranks;
}

std::shared_ptr<Communicator> DeviceMesh::get(const std::string& dim) const {
  return groups_[dim_index(dim)];
}

}  // namespace mfsdp
