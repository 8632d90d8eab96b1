#include "mfsdp/fsdp/memory_plan.h"

#include <c10/core/ScalarType.h>

#include <cstdio>
#include <map>
#include <sstream>
#include <stdexcept>

#include "fsdp/group_plan.h"
#include "fsdp/root_context.h"
#include "fsdp/unit_parameters.h"
#include "fsdp/unit_state.h"
#include "mfsdp/comm/device_mesh.h"
#include "mfsdp/comm/simulated_comm.h"

namespace mfsdp {

using detail::GroupPlan;
using detail::Placement;

namespace {

// The transient peak of a training step, measured by running the runtime itself: the units of
// `step` are fully_shard-ed on a copy of the model whose parameters are meta tensors (shapes
// and dtypes, no memory), over a simulated communicator of `world` ranks on the meta device, and
// driven through two steps. Each unit's forward adds its own parameters to a running scalar
// (so autograd gives every parameter a gradient in the unit's backward, in the reverse order),
// the root's own parameters where StepShape::root_gradients_after puts their gradient. So the
// prefetching, the units kept gathered, the reductions in flight, the micro-batch stash and the
// allocator are UnitState's and RootContext's own; TransientCounter counts the bytes as it does
// in a real run, and names what the runtime was doing at the peak.
struct TransientPeak {
  int64_t bytes = 0;
  std::string where;
};

// `module` with the same submodules and parameter names, each parameter a meta tensor of the
// same shape, dtype and requires_grad (a parameter registered twice stays one tensor).
std::shared_ptr<torch::nn::Module> meta_copy(const torch::nn::Module& module,
                                             std::map<const c10::TensorImpl*, at::Tensor>& made) {
  auto copy = std::make_shared<torch::nn::Module>(module.name());
  for (const auto& p : module.named_parameters(/*recurse=*/false)) {
    auto [it, fresh] = made.try_emplace(p.value().unsafeGetTensorImpl());
    if (fresh) it->second = at::empty(p.value().sizes(), p.value().options().device(at::kMeta));
    copy->register_parameter(p.key(), it->second, p.value().requires_grad());
  }
  for (const auto& child : module.named_children()) copy->register_module(child.key(), meta_copy(*child.value(), made));
  return copy;
}

// Adds every trainable parameter of `unit` to `sum` (its value does not matter: meta).
at::Tensor touch(detail::UnitState& unit, at::Tensor sum) {
  for (auto& g : unit.groups())
    if (g->requires_grad())
      for (auto& p : g->params()) sum = sum + p.param.sum();
  return sum;
}

std::string describe(const std::string* unit, const char* event) {
  if (unit == nullptr || event == nullptr) return "";
  const std::string who = unit->empty() ? "the root" : *unit;
  const std::string e = event;
  if (e == "after_optimizer_step") return "all-gather of " + who + " after the optimizer step";
  return e + " of " + who;
}

TransientPeak run_step_on_meta(const torch::nn::Module& root, const StepShape& step, const FullyShardOptions& options,
                               int world, int replicas) {
  std::map<const c10::TensorImpl*, at::Tensor> made;
  std::shared_ptr<torch::nn::Module> model = meta_copy(root, made);
  std::map<std::string, std::shared_ptr<torch::nn::Module>> modules;
  for (const auto& item : model->named_modules()) modules[item.key()] = item.value();

  FullyShardOptions o = options;
  o.device.reset();  // the buffers live on the communicator's (meta) device
  if (replicas == 1) o.outer_strategy = ShardingStrategy::kNoShard;  // nothing to split across
  FullyShardOptions experts = o;
  // HSDP: the units on [replicas, shard group] meshes, as a real run has them (the experts'
  // own, over their expert-data-parallel group: train/parallel_dims.h).
  auto hybrid = [&](FullyShardOptions& u, int shard_group) {
    if (replicas == 1) {
      u.comm = make_simulated_communicator(0, shard_group, at::Device(at::kMeta));
      return;
    }
    u.mesh = std::make_shared<DeviceMesh>(make_simulated_communicator(0, replicas * shard_group, at::Device(at::kMeta)),
                                          std::vector<int>{replicas, shard_group},
                                          std::vector<std::string>{"dp_outer", "dp_shard"});
    u.comm = nullptr;
  };
  hybrid(o, world);
  if (step.expert_data_parallel > 0) hybrid(experts, step.expert_data_parallel);
  const size_t n = step.forward_order.size();
  std::vector<detail::UnitState*> units(n);
  for (size_t i = n; i-- > 0;) {  // the children first (an expert group before its layer), then the root
    const PlannedUnit& u = step.forward_order[i];
    torch::nn::Module& m = *modules.at(u.path);
    fully_shard(m, u.expert_group ? experts : o).set_unshard_in_backward(u.unshard_in_backward);
    units[i] = detail::find_unit(m);
  }
  FsdpHandle handle = handle_of(*model);
  const int children = static_cast<int>(n) - 1;
  const int root_after = step.root_gradients_after < 0 ? children : std::min(step.root_gradients_after, children);
  // Backward finishes the children n-1, n-2, ...; the root's gradients come after `root_after`
  // of them, so its parameters join the sum before child n - root_after's forward.
  const size_t root_joins = n - static_cast<size_t>(root_after);

  const int64_t micro_batches = std::max<int64_t>(1, step.micro_batches);
  for (int s = 0; s < 2; ++s) {  // the first step records the order; from the second on, prefetch
    for (int64_t m = 0; m < micro_batches; ++m) {
      handle.set_requires_gradient_sync(m == micro_batches - 1);
      at::Tensor loss = detail::run_forward(*units[0], [&] {
        at::Tensor sum = at::zeros({}, at::TensorOptions().device(at::kMeta)).requires_grad_();
        for (size_t i = 1; i <= n; ++i) {
          if (i == root_joins) sum = touch(*units[0], sum);
          if (i >= n || step.forward_order[i].expert_group) continue;
          // A layer, and inside its forward the expert groups listed after it.
          // Inputs pass cast_forward_input, as in a real call (a unit with frozen parameters
          // marks them there to know when its whole backward is done).
          sum = detail::run_forward(*units[i], [&] {
            at::Tensor inner = touch(*units[i], detail::cast_forward_input(*units[i], sum));
            for (size_t j = i + 1; j < n && step.forward_order[j].expert_group; ++j)
              inner = detail::run_forward(*units[j], [&] {
                return touch(*units[j], detail::cast_forward_input(*units[j], inner));
              });
            return inner;
          });
        }
        return sum;
      });
      loss.backward();
    }
    handle.optimizer_step_hook()();
    handle.zero_grad();
  }
  const detail::TransientCounter& counter = units[0]->context().transient;
  return {counter.peak, describe(counter.peak_unit, counter.peak_event)};
}

}  // namespace

MemoryPlan plan_memory(const torch::nn::Module& root, const StepShape& step, const FullyShardOptions& options,
                       int world, int replicas) {
  if (world < 1) throw std::invalid_argument("plan_memory: world size must be >= 1");
  if (replicas < 1) throw std::invalid_argument("plan_memory: replicas must be >= 1");
  if (options.mesh) throw std::invalid_argument("plan_memory: plans a 1-D shard group, not an HSDP mesh");
  if (step.forward_order.empty() || !step.forward_order.front().path.empty())
    throw std::invalid_argument("plan_memory: the forward order must start with the root (path \"\")");
  for (size_t i = 0; i < step.forward_order.size(); ++i) {
    const PlannedUnit& u = step.forward_order[i];
    if (!u.expert_group) continue;
    if (i < 2 || step.forward_order[i - 1].expert_group)
      throw std::invalid_argument("plan_memory: expert group '" + u.path + "' must follow the layer it runs in");
    // Not a divisor of the layers' group: with experts whole under tensor parallelism their
    // group spans the tensor-parallel ranks too.
    if (step.expert_data_parallel < 1)
      throw std::invalid_argument("plan_memory: expert group '" + u.path + "' needs an expert_data_parallel size, "
                                  "found " + std::to_string(step.expert_data_parallel));
  }
  std::map<std::string, std::shared_ptr<torch::nn::Module>> modules;
  for (const auto& item : root.named_modules()) modules[item.key()] = item.value();

  MemoryPlan plan;
  plan.world = world;
  plan.replicas = replicas;
  plan.options = options;
  plan.options.comm = nullptr;
  plan.step = step;
  for (const PlannedUnit& unit : step.forward_order) {
    auto it = modules.find(unit.path);
    if (it == modules.end()) throw std::invalid_argument("plan_memory: no module '" + unit.path + "' under the root");
    // The units below this one, as paths relative to it: fully_shard's ownership rule.
    std::vector<std::string> inner;
    for (const PlannedUnit& other : step.forward_order) {
      if (unit.path.empty() && !other.path.empty()) inner.push_back(other.path);
      if (!unit.path.empty() && detail::has_prefix(other.path, unit.path))
        inner.push_back(other.path.substr(unit.path.size() + 1));
    }
    const detail::OwnedParameters owned = detail::owned_parameters(*it->second, inner);
    for (const auto& group : detail::parameter_groups(owned.own)) {
      std::vector<std::vector<int64_t>> shapes;
      for (const auto& [name, p] : group) shapes.push_back(p.sizes().vec());
      const at::Tensor& first = group.front().second;
      const GroupPlan g = detail::plan_group(shapes, first.scalar_type(), first.requires_grad(), options,
                                             unit.expert_group ? step.expert_data_parallel : world, replicas);
      GroupMemory m;
      m.unit = unit.path;
      m.first_param = unit.path.empty() ? group.front().first : unit.path + "." + group.front().first;
      m.compute_dtype = g.compute_dtype;
      m.parameters = static_cast<int64_t>(group.size());
      m.used = g.layout.used;
      m.padded = g.layout.total();
      m.shard = g.layout.shard;
      m.model_weights = g.model_weight_bytes();
      m.main_weights = g.main_weight_bytes();
      m.main_grads = g.main_grad_bytes();
      m.optimizer_state = g.main_weight_elements() *
                          (step.optimizer_state_bytes > 0
                               ? step.optimizer_state_bytes
                               : step.optimizer_states * static_cast<int64_t>(c10::elementSize(g.main_dtype)));
      m.gathered_weights = g.placement.model_weights == Placement::kSharded ? g.unsharded_bytes() : 0;
      m.unsharded_grads = g.requires_grad ? g.unsharded_bytes() : 0;
      m.grad_accumulator = step.micro_batches > 1 ? g.accumulator_bytes() : 0;  // only between micro-batches
      plan.model_weights += m.model_weights;
      plan.main_weights += m.main_weights;
      plan.main_grads += m.main_grads;
      plan.optimizer_state += m.optimizer_state;
      plan.groups.push_back(std::move(m));
    }
  }

  const TransientPeak peak = run_step_on_meta(root, step, options, world, replicas);
  plan.transient_peak = peak.bytes;
  plan.transient_peak_at = peak.where;
  return plan;
}

namespace {

std::string mib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return buf;
}

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "fp32";
    case at::kBFloat16: return "bf16";
    case at::kHalf: return "fp16";
    case at::kDouble: return "fp64";
    default: return c10::toString(t);
  }
}

}  // namespace

std::string format_memory_plan(const MemoryPlan& plan) {
  std::ostringstream s;
  const MixedPrecisionPolicy& mp = plan.options.mixed_precision;
  s << " memory plan, per rank of " << plan.world * plan.replicas;
  if (plan.replicas > 1)
    s << " (HSDP: " << plan.replicas << " replicas of " << plan.world << "-rank shard groups"
      << (plan.options.outer_strategy == ShardingStrategy::kOptim ? ", main weights, grads and optimizer state split across them" : "")
      << ")";
  s << " (every rank holds the same sizes): " << to_string(plan.options.strategy)
    << ", compute " << (mp.param_dtype ? dtype_name(*mp.param_dtype) : "in the parameters' dtype") << ", main weights "
    << dtype_name(mp.main_params_dtype) << ", main grads " << dtype_name(mp.main_grads_dtype) << ", "
    << plan.step.optimizer_states << " optimizer state(s) per main-weight element, " << plan.step.micro_batches
    << " micro-batch(es) per step, prefetch " << (plan.options.prefetch ? "on" : "off") << "\n";
  s << " bytes per rank of each parameter group (one per unit and (dtype, requires_grad); P = padded flat "
       "elements, S = P / ranks). Persistent: model weights, main weights (0: the model weights' memory), main "
       "grads, optimizer state. Transient, while the unit is gathered or in backward: gathered weights, unsharded "
       "grads, accumulator of micro-batches without gradient sync\n";
  char line[512];
  std::snprintf(line, sizeof line, " %-18s %-26s %-5s %6s %12s %12s %10s | %12s %12s %12s %12s | %12s %12s %12s\n",
                "unit", "first parameter", "dtype", "params", "elements", "P", "S", "model w.", "main w.",
                "main grads", "optimizer", "gathered", "grads", "accumulator");
  s << line;
  for (const GroupMemory& g : plan.groups) {
    const std::string unit = g.unit.empty() ? "(root)" : g.unit;
    const std::string param = g.unit.empty() ? g.first_param : g.first_param.substr(g.unit.size() + 1);
    std::snprintf(line, sizeof line,
                  " %-18s %-26s %-5s %6lld %12lld %12lld %10lld | %12lld %12lld %12lld %12lld | %12lld %12lld %12lld\n",
                  unit.c_str(), param.c_str(), dtype_name(g.compute_dtype).c_str(), static_cast<long long>(g.parameters),
                  static_cast<long long>(g.used), static_cast<long long>(g.padded), static_cast<long long>(g.shard),
                  static_cast<long long>(g.model_weights), static_cast<long long>(g.main_weights),
                  static_cast<long long>(g.main_grads), static_cast<long long>(g.optimizer_state),
                  static_cast<long long>(g.gathered_weights), static_cast<long long>(g.unsharded_grads),
                  static_cast<long long>(g.grad_accumulator));
    s << line;
  }
  s << " per rank: model weights " << plan.model_weights << " B (" << mib(plan.model_weights) << " MiB), main weights "
    << plan.main_weights << " B (" << mib(plan.main_weights) << " MiB), main grads " << plan.main_grads << " B ("
    << mib(plan.main_grads) << " MiB), optimizer state " << plan.optimizer_state << " B (" << mib(plan.optimizer_state)
    << " MiB)\n";
  s << " per rank: persistent " << plan.persistent() << " B (" << mib(plan.persistent()) << " MiB), transient peak "
    << plan.transient_peak << " B (" << mib(plan.transient_peak) << " MiB, at: "
    << (plan.transient_peak_at.empty() ? "none" : plan.transient_peak_at) << "), total " << plan.total() << " B (" << mib(plan.total()) << " MiB)\n";
  return s.str();
}

}  // namespace mfsdp
