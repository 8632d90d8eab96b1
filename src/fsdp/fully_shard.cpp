#include "mfsdp/fsdp/fully_shard.h"

#include <torch/csrc/autograd/grad_mode.h>

#include <mutex>
#include <set>
#include <stdexcept>

#include "fsdp/param_group.h"
#include "fsdp/shard_views.h"
#include "fsdp/unit_parameters.h"
#include "fsdp/unit_state.h"
#include "mfsdp/comm/device_mesh.h"

namespace mfsdp {
namespace detail {
namespace {

// Which modules are units. A unit's state is owned by its module (through the holder child
// below), so it is freed with the module; the registry only finds it.
struct Registered {
  std::weak_ptr<torch::nn::Module> module;
  std::weak_ptr<UnitState> unit;
};
std::mutex registry_mutex;
std::map<const torch::nn::Module*, Registered> registry;

// A parameter-less child module that keeps the unit state alive exactly as long as its module.
struct UnitStateHolder : torch::nn::Module {
  explicit UnitStateHolder(std::shared_ptr<UnitState> u) : unit(std::move(u)) {}
  std::shared_ptr<UnitState> unit;
};

}  // namespace

std::shared_ptr<UnitState> lookup(const torch::nn::Module& module) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry.find(&module);
  if (it == registry.end()) return nullptr;
  auto alive = it->second.module.lock();
  auto unit = it->second.unit.lock();
  if (alive.get() != &module || !unit) {  // dead, or a new module at a dead one's address
    registry.erase(it);
    return nullptr;
  }
  return unit;
}

// Every unit in `root`'s subtree (excluding root itself) with its module prefix.
std::vector<std::pair<std::string, std::shared_ptr<UnitState>>> units_under(
    torch::nn::Module& root) {
  std::vector<std::pair<std::string, std::shared_ptr<UnitState>>> out;
  for (const auto& item : root.named_modules("", /*include_self=*/false)) {
    if (auto unit = lookup(*item.value())) out.emplace_back(item.key(), unit);
  }
  return out;
}

UnitState* find_unit(const torch::nn::Module& module) { return lookup(module).get(); }

at::Tensor run_forward(UnitState& unit, const std::function<at::Tensor()>& forward) {
  unit.pre_forward();
  return unit.post_forward(forward());
}

std::vector<at::Tensor> run_forward(UnitState& unit,
                                    const std::function<std::vector<at::Tensor>()>& forward) {
  unit.pre_forward();
  return unit.post_forward(forward());
}

at::Tensor cast_forward_input(const UnitState& unit, const at::Tensor& input) {
  const auto& dtype = unit.options().mixed_precision.param_dtype;
  at::Tensor cast = input;
  if (dtype && input.defined() && at::isFloatingType(input.scalar_type()) && input.scalar_type() != *dtype)
    cast = input.to(*dtype);
  // Every tensor input passes here, so this is where a unit with frozen parameters learns when
  // its backward is done (UnitState::attach_post_backward). The header hands the unit over as
  // const; it comes from find_unit, never a const object.
  return const_cast<UnitState&>(unit).attach_post_backward(cast);
}

}  // namespace detail

using detail::UnitState;

ShardingStrategy parse_sharding_strategy(const std::string& name) {
  if (name == "no_shard") return ShardingStrategy::kNoShard;
  if (name == "optim") return ShardingStrategy::kOptim;
  if (name == "optim_grads") return ShardingStrategy::kOptimGrads;
  if (name == "optim_grads_params") return ShardingStrategy::kOptimGradsParams;
  throw std::invalid_argument("unknown sharding strategy '" + name +
                              "' (expected no_shard, optim, optim_grads or optim_grads_params)");
}

const char* to_string(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::kNoShard: return "no_shard";
    case ShardingStrategy::kOptim: return "optim";
    case ShardingStrategy::kOptimGrads: return "optim_grads";
    case ShardingStrategy::kOptimGradsParams: return "optim_grads_params";
  }
  return "?";
}

namespace {

// Resolves a mesh into the shard communicator (options.comm) it stands for.
FullyShardOptions resolve(const FullyShardOptions& given) {
  FullyShardOptions o = given;
  if (o.mesh) {
    if (o.comm)
      throw std::invalid_argument("fully_shard: set either options.comm or options.mesh, not both");
    const auto& dims = o.mesh->dim_names();
    if (dims.size() > 2)
      throw std::invalid_argument("fully_shard: the mesh has " + std::to_string(dims.size()) +
                                  " dimensions; expected 1 (shard) or 2 (replicate, shard)");
    o.comm = o.mesh->get(dims.back());
  }
  if (!o.comm) throw std::invalid_argument("fully_shard: options.comm (or options.mesh) is not set");
  if (o.outer_strategy != ShardingStrategy::kNoShard) {
    if (o.outer_strategy != ShardingStrategy::kOptim)
      throw std::invalid_argument(std::string("fully_shard: outer_strategy is ") + to_string(o.outer_strategy) +
                                  "; across replicas only no_shard (HSDP) or optim (HFSDP)");
    if (!o.mesh || o.mesh->dim_names().size() != 2)
      throw std::invalid_argument("fully_shard: outer_strategy optim shards across replicas: it needs a 2-D mesh");
    if (o.strategy != ShardingStrategy::kOptimGradsParams)
      throw std::invalid_argument(
          std::string("fully_shard: outer_strategy optim (HFSDP) needs strategy optim_grads_params, got ") +
          to_string(o.strategy));
  }
  const c10::Device device = o.comm->device();
  if (o.device && *o.device != device)
    throw std::invalid_argument("fully_shard: options.device is " + o.device->str() + " but the " +
                                o.comm->backend() + " communicator works on " + device.str());
  o.device = device;
  return o;
}

}  // namespace

FsdpHandle fully_shard(torch::nn::Module& module, const FullyShardOptions& given) {
  const FullyShardOptions options = resolve(given);
  if (detail::find_unit(module) != nullptr)
    throw std::invalid_argument("fully_shard: module '" + module.name() + "' is already a unit");
  std::shared_ptr<torch::nn::Module> self;
  try {
    self = module.shared_from_this();
  } catch (const std::bad_weak_ptr&) {
    throw std::invalid_argument(
        "fully_shard: module '" + module.name() +
        "' must be owned by a std::shared_ptr (create it with std::make_shared or a TORCH_MODULE holder)");
  }

  // Which unit owns each parameter name: the innermost unit whose prefix the name has, or this
  // new unit. A tensor owned by two units is a parameter shared across units.
  auto descendants = detail::units_under(module);
  for (const auto& [prefix, child] : descendants)
    if (child->has_context())
      throw std::invalid_argument(
          "fully_shard: unit '" + prefix + "' under module '" + module.name() +
          "' was already used as a root (a forward, optimizer or state dict ran on it); apply "
          "fully_shard to every enclosing module before the first use");
  std::vector<std::string> inner;
  for (const auto& [prefix, child] : descendants) inner.push_back(prefix);
  const detail::OwnedParameters owned = detail::owned_parameters(module, inner);
  std::vector<std::unique_ptr<detail::ParamGroup>> groups;
  {
    at::NoGradGuard no_grad;
    for (const auto& group : detail::parameter_groups(owned.own)) {
      std::vector<detail::GroupParam> params;
      for (const auto& [name, p] : group) params.push_back({name, p, p.sizes().vec(), p.scalar_type()});
      groups.push_back(std::make_unique<detail::ParamGroup>(std::move(params), options));
    }
  }
  auto unit = std::make_shared<UnitState>(module, std::move(groups), options);
  {
    // Buffers are not sharded: each rank keeps them whole, on the unit's device (FSDP2 moves
    // them with the module too).
    at::NoGradGuard no_grad;
    for (auto& b : module.named_buffers(/*recurse=*/true))
      if (b.value().device() != *options.device) b.value().set_data(b.value().to(*options.device));
  }

  // Adopt the units below that have no parent yet; everything under this one belongs to its
  // root from now on and is named relative to this module. The root builds the shared context
  // on first use (root_context.h), so a unit already used as a root cannot be adopted.
  const auto& names = owned.names;
  std::vector<UnitState*> members;
  for (const auto& [prefix, child] : descendants) {
    if (child->parent() == nullptr) child->set_parent(unit.get());
    child->set_path(prefix);
    child->rename_parameters(names);
    members.push_back(child.get());
  }
  members.push_back(unit.get());
  unit->set_members(members);
  unit->rename_parameters(names);

  module.register_module("_fsdp_unit", std::make_shared<detail::UnitStateHolder>(unit));
  {
    std::lock_guard<std::mutex> lock(detail::registry_mutex);
    for (auto it = detail::registry.begin(); it != detail::registry.end();)  // forget dead units
      it = it->second.unit.expired() ? detail::registry.erase(it) : std::next(it);
    detail::registry[&module] = {self, unit};
  }
  return FsdpHandle(unit);
}

FsdpHandle handle_of(const torch::nn::Module& module) {
  auto unit = detail::lookup(module);
  if (!unit) throw std::invalid_argument("handle_of: module '" + module.name() + "' is not a unit");
  return FsdpHandle(unit);
}

// ---- FsdpHandle -------------------------------------------------------------------------------

detail::UnitState& FsdpHandle::state() const {
  if (!unit_) throw std::logic_error("FsdpHandle: empty handle");
  return *unit_;
}

void FsdpHandle::unshard() { state().unshard(); }
void FsdpHandle::reshard() { state().reshard(); }

namespace {
// The units a setter acts on: this one, or (recurse) this one and every unit under it.
std::vector<UnitState*> targets(UnitState& unit, bool recurse) {
  if (!recurse) return {&unit};
  return unit.members();
}
}  // namespace

void FsdpHandle::set_requires_gradient_sync(bool sync, bool recurse) {
  for (UnitState* u : targets(state(), recurse)) u->set_requires_gradient_sync(sync);
}

void FsdpHandle::set_reshard_after_forward(bool reshard, bool recurse) {
  for (UnitState* u : targets(state(), recurse)) u->set_reshard_after_forward(reshard);
}

void FsdpHandle::set_unshard_in_backward(bool unshard) { state().set_unshard_in_backward(unshard); }

void FsdpHandle::set_gradient_divide_factor(double factor) {
  if (!(factor > 0)) throw std::invalid_argument("set_gradient_divide_factor: factor must be > 0");
  state().context().divide_factor = factor;
}

std::shared_ptr<Communicator> FsdpHandle::optimizer_comm() const {
  const FullyShardOptions& o = state().options();
  // HFSDP: every rank of the mesh holds distinct main weights, so norms sum over all of them.
  if (o.outer_strategy == ShardingStrategy::kOptim && o.mesh && o.mesh->shape().front() > 1) return o.mesh->world();
  return o.comm;
}

std::vector<OptimizerShard> FsdpHandle::optimizer_shards() const {
  std::vector<OptimizerShard> shards;
  for (UnitState* u : state().context().units)
    for (auto& g : u->groups())
      if (g->requires_grad()) shards.push_back(detail::optimizer_shard(*g));
  return shards;
}

std::function<void()> FsdpHandle::optimizer_step_hook() const {
  std::shared_ptr<detail::RootContext> ctx = state().shared_context();
  return [ctx] { ctx->after_optimizer_step(); };
}

void FsdpHandle::refresh_model_weights() { state().context().refresh_model_weights(); }

std::unique_ptr<DistributedOptimizer> make_adamw(const FsdpHandle& root, const AdamWOptions& options) {
  return make_adamw(root.optimizer_shards(), root.optimizer_comm(), options, root.optimizer_step_hook());
}

std::unique_ptr<DistributedOptimizer> make_sgd(const FsdpHandle& root, const SGDOptions& options) {
  return make_sgd(root.optimizer_shards(), root.optimizer_comm(), options, root.optimizer_step_hook());
}

void FsdpHandle::zero_grad() {
  for (UnitState* u : state().context().units)
    for (auto& g : u->groups()) g->gradients().zero();
}

std::vector<LocalShard> FsdpHandle::local_shards() const {
  std::vector<LocalShard> out;
  int shard_index = 0;  // counts groups in optimizer_shards() order
  for (UnitState* u : state().context().units)
    for (auto& g : u->groups()) {
      for (auto& s : detail::local_shards(*g)) {
        if (g->requires_grad()) s.shard_index = shard_index;
        out.push_back(std::move(s));
      }
      if (g->requires_grad()) ++shard_index;
    }
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> FsdpHandle::buffers() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& b : state().module().named_buffers(/*recurse=*/true)) out.emplace_back(b.key(), b.value());
  return out;
}

std::map<std::string, at::Tensor> FsdpHandle::full_state_dict(bool all_ranks) const {
  at::NoGradGuard no_grad;
  std::map<std::string, at::Tensor> out;
  // Rank 0 of the job, not of each shard group (HSDP has one per replica): only it keeps them.
  const FullyShardOptions& o = state().options();
  const int rank = o.mesh ? o.mesh->world()->rank() : o.comm->rank();
  for (UnitState* u : state().context().units)
    for (auto& g : u->groups()) {
      auto values = detail::gather_full_parameters(*g);  // collective: every rank takes part
      if (!all_ranks && rank != 0) continue;
      for (size_t i = 0; i < values.size(); ++i) out[g->params()[i].name] = values[i];
    }
  if (all_ranks || rank == 0)
    for (const auto& [name, b] : buffers()) out[name] = b.clone();
  return out;
}

void FsdpHandle::load_full_state_dict(const std::map<std::string, at::Tensor>& state_dict) {
  at::NoGradGuard no_grad;
  std::set<std::string> expected;
  for (UnitState* u : state().context().units)
    for (auto& g : u->groups())
      for (auto& p : g->params()) {
        expected.insert(p.name);
        auto it = state_dict.find(p.name);
        if (it == state_dict.end())
          throw std::invalid_argument("load_full_state_dict: missing parameter '" + p.name + "'");
        if (it->second.sizes().vec() != p.shape)
          throw std::invalid_argument("load_full_state_dict: parameter '" + p.name + "' has shape " +
                                      c10::str(it->second.sizes()) + ", the model expects " +
                                      c10::str(at::IntArrayRef(p.shape)));
      }
  for (const auto& [name, b] : buffers()) {
    expected.insert(name);
    auto it = state_dict.find(name);
    if (it == state_dict.end()) throw std::invalid_argument("load_full_state_dict: missing buffer '" + name + "'");
    if (!it->second.sizes().equals(b.sizes()))
      throw std::invalid_argument("load_full_state_dict: buffer '" + name + "' has shape " +
                                  c10::str(it->second.sizes()) + ", the model expects " + c10::str(b.sizes()));
  }
  for (const auto& [name, t] : state_dict)
    if (!expected.count(name))
      throw std::invalid_argument("load_full_state_dict: unexpected parameter '" + name + "'");
  for (auto& [name, b] : buffers()) b.copy_(state_dict.at(name));
  for (UnitState* u : state().context().units)
    for (auto& g : u->groups()) {
      std::vector<at::Tensor> values;
      for (auto& p : g->params()) values.push_back(state_dict.at(p.name));
      detail::load_full_parameters(*g, values);
    }
}

MemoryReport FsdpHandle::memory() const {
  MemoryReport r;
  detail::RootContext& ctx = state().context();
  for (UnitState* u : ctx.units)
    for (auto& g : u->groups()) {
      r.model_weights += g->model_weight_bytes();
      r.main_weights += g->main_weight_bytes();
      r.main_grads += g->main_grad_bytes();
    }
  r.transient_now = ctx.transient.now;
  r.transient_peak = ctx.transient.peak;
  const detail::BufferStats stats = ctx.allocator->stats();
  r.buffer_pool = stats.reserved_bytes;
  r.pooled_buffers = stats.pooled;
  r.plain_buffers = stats.plain;
  return r;
}

void FsdpHandle::record_events(bool on) {
  detail::RootContext& ctx = state().context();
  ctx.record_events = on;
  ctx.events.clear();
}

std::vector<std::string> FsdpHandle::events() const { return state().context().events; }

void FsdpHandle::reset_peak() {
  auto& t = state().context().transient;
  t.peak = t.now;
}

}  // namespace mfsdp
