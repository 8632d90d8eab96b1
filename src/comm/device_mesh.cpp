#include "mfsdp/comm/device_mesh.h"

#include <algorithm>
#include <set>
#include <stdexcept>

namespace mfsdp {
namespace {

// `rank`'s index along one step.
int step_coordinate(int rank, const std::pair<int, int>& step) { return (rank / step.first) % step.second; }

// The world ranks of `rank`'s group along `steps` (strides descending), ascending: row-major
// over the steps, whose strides are those of a row-major layout.
std::vector<int> ranks_of(int rank, const GroupCache::Steps& steps) {
  int base = rank;
  for (const auto& s : steps) base -= step_coordinate(rank, s) * s.first;
  std::vector<int> ranks{base};
  for (const auto& s : steps) {
    std::vector<int> next;
    next.reserve(ranks.size() * static_cast<size_t>(s.second));
    for (int r : ranks)
      for (int i = 0; i < s.second; ++i) next.push_back(r + i * s.first);
    ranks = std::move(next);
  }
  return ranks;
}

int coordinate_of(int rank, const GroupCache::Steps& steps) {
  int c = 0;
  for (const auto& s : steps) c = c * s.second + step_coordinate(rank, s);
  return c;
}

int size_of(const GroupCache::Steps& steps) {
  int n = 1;
  for (const auto& s : steps) n *= s.second;
  return n;
}

// One form per group: strides descending, and steps that continue each other (an outer stride
// equal to the inner stride x size) merged, so that [dp_shard 4, cp 2] flattened and [dp 8]
// are one key, and the whole world is always {(1, world)}.
GroupCache::Steps canonical(GroupCache::Steps steps) {
  std::sort(steps.begin(), steps.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  GroupCache::Steps out;
  for (const auto& s : steps) {
    if (!out.empty() && out.back().first == s.first * s.second)
      out.back() = {s.first, out.back().second * s.second};
    else
      out.push_back(s);
  }
  return out;
}

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

}  // namespace

std::shared_ptr<Communicator> GroupCache::get(const std::shared_ptr<Communicator>& world, const Steps& given,
                                              const std::string& name) {
  const Steps steps = canonical(given);
  // The whole world is the world's own communicator.
  if (steps.empty() ? world->size() == 1 : steps == Steps{{1, world->size()}}) return world;
  auto found = groups_.find(steps);
  if (found != groups_.end()) return found->second;
  std::shared_ptr<Communicator> group = world->new_group(ranks_of(world->rank(), steps), name);
  ++made_;
  groups_.emplace(steps, group);
  return group;
}

DeviceMesh::DeviceMesh(std::shared_ptr<Communicator> world, std::vector<int> shape, std::vector<std::string> dim_names,
                       std::shared_ptr<GroupCache> cache)
    : root_(world),
      span_(std::move(world)),
      cache_(cache ? std::move(cache) : std::make_shared<GroupCache>()),
      shape_(std::move(shape)),
      dim_names_(std::move(dim_names)) {
  if (shape_.empty() || shape_.size() != dim_names_.size())
    throw std::invalid_argument("DeviceMesh: " + std::to_string(shape_.size()) + " dimensions but " +
                                std::to_string(dim_names_.size()) + " names");
  std::set<std::string> seen;
  long product = 1;
  for (size_t d = 0; d < shape_.size(); ++d) {
    if (dim_names_[d].empty() || !seen.insert(dim_names_[d]).second)
      throw std::invalid_argument("DeviceMesh: dimension name '" + dim_names_[d] + "' is empty or repeated");
    if (shape_[d] < 1 || product * shape_[d] > root_->size())
      throw std::invalid_argument("DeviceMesh: dimension '" + dim_names_[d] + "' has size " +
                                  std::to_string(shape_[d]) + " (the world has " + std::to_string(root_->size()) +
                                  " ranks)");
    product *= shape_[d];
  }
  if (product != root_->size())
    throw std::invalid_argument("DeviceMesh: shape holds " + std::to_string(product) + " ranks but the world has " +
                                std::to_string(root_->size()));
  int stride = root_->size();
  for (size_t d = 0; d < shape_.size(); ++d) {
    stride /= shape_[d];
    Dim dim{dim_names_[d], {}, nullptr};
    if (shape_[d] > 1) dim.steps.emplace_back(stride, shape_[d]);
    dim.group = cache_->get(root_, dim.steps, "mesh/" + dim_names_[d]);
    dims_.push_back(std::move(dim));
  }
}

const DeviceMesh::Dim& DeviceMesh::dim(const std::string& name) const {
  for (const Dim& d : dims_)
    if (d.name == name) return d;
  std::vector<std::string> known;
  for (const Dim& d : dims_) known.push_back(d.name);
  throw std::invalid_argument("DeviceMesh: no dimension '" + name + "' (dimensions: " + joined(known) + ")");
}

bool DeviceMesh::has(const std::string& name) const {
  return std::any_of(dims_.begin(), dims_.end(), [&](const Dim& d) { return d.name == name; });
}

int DeviceMesh::size(const std::string& name) const { return size_of(dim(name).steps); }

int DeviceMesh::coordinate(const std::string& name) const { return coordinate_of(root_->rank(), dim(name).steps); }

std::vector<int> DeviceMesh::group_ranks(const std::string& name) const {
  return ranks_of(root_->rank(), dim(name).steps);
}

std::shared_ptr<Communicator> DeviceMesh::get(const std::string& name) const { return dim(name).group; }

GroupCache::Steps DeviceMesh::joint_steps(const std::vector<std::string>& dims, const std::string& what) const {
  if (dims.empty()) throw std::invalid_argument("DeviceMesh: " + what + " of no dimensions");
  GroupCache::Steps steps;
  for (const std::string& name : dims) {
    const Dim& d = dim(name);
    steps.insert(steps.end(), d.steps.begin(), d.steps.end());
  }
  steps = canonical(std::move(steps));
  // Disjoint dimensions make a group of distinct ranks in ascending order.
  const std::vector<int> ranks = ranks_of(0, steps);
  for (size_t i = 1; i < ranks.size(); ++i)
    if (ranks[i] <= ranks[i - 1] || ranks[i] >= root_->size())
      throw std::invalid_argument("DeviceMesh: " + what + " of " + joined(dims) + ": they overlap");
  return steps;
}

std::shared_ptr<Communicator> DeviceMesh::flatten(const std::vector<std::string>& dims, const std::string& name) {
  if (name.empty() || has(name))
    throw std::invalid_argument("DeviceMesh: cannot flatten into '" + name + "': the name is empty or taken");
  Dim d{name, joint_steps(dims, "flatten"), nullptr};
  d.group = cache_->get(root_, d.steps, "mesh/" + name);
  dims_.push_back(std::move(d));
  return dims_.back().group;
}

std::shared_ptr<DeviceMesh> DeviceMesh::submesh(const std::vector<std::string>& dims) const {
  const GroupCache::Steps steps = joint_steps(dims, "submesh");
  // Outermost first: each dimension's strides above the next one's, so that the submesh's
  // row-major order is its group's ascending order.
  for (size_t i = 1; i < dims.size(); ++i) {
    const auto& outer = dim(dims[i - 1]).steps;
    const auto& inner = dim(dims[i]).steps;
    if (!outer.empty() && !inner.empty() && outer.back().first < inner.front().first)
      throw std::invalid_argument("DeviceMesh: submesh of " + joined(dims) + ": '" + dims[i - 1] +
                                  "' is not outside '" + dims[i] + "'");
  }
  auto sub = std::shared_ptr<DeviceMesh>(new DeviceMesh());
  sub->root_ = root_;
  sub->cache_ = cache_;
  sub->span_ = cache_->get(root_, steps, "mesh/" + joined(dims));
  for (const std::string& name : dims) {
    sub->dims_.push_back(dim(name));
    sub->dim_names_.push_back(name);
    sub->shape_.push_back(size_of(dim(name).steps));
  }
  return sub;
}

}  // namespace mfsdp
