#include "fsdp/param_group.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/variable.h>

#include <stdexcept>

#include "fsdp/group_plan.h"
#include "fsdp/storage.h"
#include "mfsdp/comm/device_mesh.h"

namespace mfsdp::detail {
namespace {
// The replicas of this rank's shard, or null when there are none (no mesh, a 1-D mesh, or a
// [1, N] mesh: nothing to all-reduce or split across).
std::shared_ptr<Communicator> replicate_group(const FullyShardOptions& options) {
  if (!options.mesh || options.mesh->dim_names().size() < 2) return nullptr;
  std::shared_ptr<Communicator> replicas = options.mesh->get(options.mesh->dim_names().front());
  return replicas->size() > 1 ? replicas : nullptr;
}
}  // namespace

int data_parallel_size(const FullyShardOptions& options) {
  auto replicate = replicate_group(options);
  return options.comm->size() * (replicate ? replicate->size() : 1);
}

const char* to_string(ShardState s) {
  switch (s) {
    case ShardState::kSharded: return "sharded";
    case ShardState::kGathering: return "gathering";
    case ShardState::kUnsharded: return "unsharded";
  }
  return "?";
}

ParamGroup::ParamGroup(std::vector<GroupParam> params, const FullyShardOptions& options)
    : params_(std::move(params)),
      comm_(options.comm),
      replicate_(replicate_group(options)),
      requires_grad_(params_.at(0).param.requires_grad()),
      rank_(options.comm->rank()),
      device_(options.device.value_or(options.comm->device())) {
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& p : params_) shapes.push_back(p.shape);
  // Layout, placements and dtypes come from the plan that plan_memory also adds up (group_plan.h).
  const int replicas = replicate_ ? replicate_->size() : 1, replica = replicate_ ? replicate_->rank() : 0;
  const GroupPlan plan = plan_group(shapes, params_[0].original_dtype, requires_grad_, options, comm_->size(), replicas);
  const RolePlacements placement = plan.placement;
  const at::ScalarType original = params_[0].original_dtype, main_dtype = plan.main_dtype;
  compute_dtype_ = plan.compute_dtype;
  layout_ = plan.layout;

  // The original values, packed (padding zero), in their own dtype on their own device: main
  // weights start from them at full precision, model weights from their cast.
  at::Tensor original_flat = at::zeros({layout_.total()}, params_[0].param.options().dtype(original));
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& e = layout_.entries[i];
    original_flat.narrow(0, e.offset, e.numel).copy_(params_[i].param.detach().reshape(-1));
  }
  const auto on_device = at::TensorOptions().device(device_);
  model_weights_ = FlatBuffer::from_full(&layout_, rank_, placement.model_weights, original_flat,
                                         on_device.dtype(compute_dtype_));
  if (model_weights_.sharded()) {
    // Parameters view an unsharded buffer whose memory exists only while gathered.
    unsharded_ = at::empty({layout_.total()}, on_device.dtype(compute_dtype_));
    point_params_at_unsharded();
    free_storage(unsharded_);
    state_ = ShardState::kSharded;
  } else {
    unsharded_ = model_weights_.data();
    point_params_at_unsharded();
  }
  if (requires_grad_) {
    if (!plan.main_weights_own_memory() && placement.main_weights == placement.model_weights) {
      main_weights_ = model_weights_;  // one copy serves both roles
    } else if (!plan.main_weights_own_memory()) {
      // Sharded main weights over replicated model weights of the same dtype (or, HFSDP,
      // outer-sharded over sharded ones): this rank's region of them.
      const int64_t begin = FlatBuffer::begin_of(layout_, rank_, placement.main_weights, replica);
      main_weights_ = FlatBuffer(&layout_, rank_, placement.main_weights,
                                 model_weights_.range(begin, elements_of(layout_, placement.main_weights)), replica);
    } else {
      main_weights_ = FlatBuffer::from_full(&layout_, rank_, placement.main_weights, original_flat,
                                            on_device.dtype(main_dtype), replica);
    }
    ReducerSetup setup;
    setup.params = &params_;
    setup.layout = &layout_;
    setup.comm = comm_;
    setup.replicate = replicate_;
    setup.dp_size = data_parallel_size(options);
    setup.rank = rank_;
    setup.device = device_;
    setup.compute_dtype = compute_dtype_;
    setup.grad_dtype = plan.grad_dtype;
    setup.comm_dtype = options.mixed_precision.grad_comm_dtype.value_or(plan.grad_dtype);
    setup.low_precision_sum = options.mixed_precision.grad_reduce_sum;
    FlatBuffer main_grads =
        FlatBuffer::zeros(&layout_, rank_, placement.main_grads, on_device.dtype(plan.grad_dtype), replica);
    setup.deferred = !main_grads.sharded() && main_weights_.sharded();
    gradients_ = GradientReducer(std::move(setup), std::move(main_grads));
  }
}

void ParamGroup::attach(TransientCounter* transient, BufferAllocator* allocator,
                        const std::string* unit_path) {
  transient_ = transient;
  allocator_ = allocator;
  gradients_.attach(transient, allocator, this);
  unit_path_ = unit_path;
}

std::string ParamGroup::describe() const {
  return "unit '" + (unit_path_ ? *unit_path_ : std::string("?")) + "' parameter group of '" +
         params_.front().name + "' (" + c10::toString(compute_dtype_) + ")";
}

void ParamGroup::move_to(ShardState to) {
  const bool valid = (state_ == ShardState::kSharded && to == ShardState::kGathering) ||
                     (state_ == ShardState::kGathering && to == ShardState::kUnsharded) ||
                     (state_ == ShardState::kUnsharded && to == ShardState::kSharded);
  if (!valid || !model_weights_.sharded())
    throw std::logic_error(describe() + ": invalid shard-state transition " + to_string(state_) +
                           " -> " + to_string(to));
  state_ = to;
}

void ParamGroup::expect_unsharded(const char* when) const {
  if (state_ != ShardState::kUnsharded)
    throw std::logic_error(describe() + ": " + when + " needs the weights unsharded, but they are " +
                           to_string(state_));
}

void ParamGroup::point_params_at_unsharded() {
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& e = layout_.entries[i];
    at::Tensor view = unsharded_.narrow(0, e.offset, e.numel).view(params_[i].shape);
    params_[i].param.set_data(view);
  }
}

ParamGroup::~ParamGroup() {
  // The communication thread (or stream) may still be writing into the unsharded buffer.
  try {
    wait_unshard();
  } catch (...) {
  }
}

bool ParamGroup::start_unshard() {
  if (state_ != ShardState::kSharded) return false;
  regrow_storage(unsharded_, allocator_->allocate(this, BufferRole::kWeights, storage_bytes_needed(unsharded_),
                                                  compute_dtype_, device_));
  transient_->add(unsharded_.nbytes());
  gathering_ = comm_->all_gather_async(unsharded_, model_weights_.data());  // may throw: state unchanged
  move_to(ShardState::kGathering);
  return true;
}

void ParamGroup::wait_unshard() {
  if (state_ != ShardState::kGathering) return;
  WorkHandle work = std::move(gathering_);
  gathering_ = nullptr;
  move_to(ShardState::kUnsharded);
  work->wait();
}

void ParamGroup::reshard() {
  wait_unshard();
  if (state_ != ShardState::kUnsharded || !model_weights_.sharded()) return;
  free_storage(unsharded_);
  transient_->sub(unsharded_.nbytes());
  move_to(ShardState::kSharded);
}

void ParamGroup::copy_main_to_model_weights() {
  if (!requires_grad_) return;
  wait_unshard();  // an all-gather may still be reading the model weights
  // The main weights cover a range of the model weights' (the whole of it, or this rank's shard).
  if (!main_weights_.aliases(model_weights_))
    model_weights_.range(main_weights_.begin(), main_weights_.data().numel()).copy_(main_weights_.data());
  // Replicated model weights over sharded main weights (ZeRO-1/2): every rank updated its region.
  if (!model_weights_.sharded() && main_weights_.sharded())
    comm_->all_gather(model_weights_.data(), model_weights_.own());
  // HFSDP: each replica updated its sub-shard of this rank's shard.
  if (main_weights_.outer_sharded())
    replicate_->all_gather(model_weights_.data(), model_weights_.range(main_weights_.begin(), layout_.sub_shard()));
}

void ParamGroup::load_values(const std::vector<at::Tensor>& values) {
  if (values.size() != params_.size())
    throw std::logic_error(describe() + ": load_values got " + std::to_string(values.size()) + " values for " +
                           std::to_string(params_.size()) + " parameters");
  wait_unshard();
  auto copy_into = [&](const FlatBuffer& b) {
    for (size_t i = 0; i < params_.size(); ++i) {
      const FlatBuffer::ParamSlice s = b.slice_of(i);
      if (s.length == 0) continue;
      b.data().narrow(0, s.local_offset, s.length).copy_(values[i].reshape({-1}).narrow(0, s.param_offset, s.length));
    }
  };
  if (requires_grad_ && !main_weights_.aliases(model_weights_)) copy_into(main_weights_);
  copy_into(model_weights_);
  if (model_weights_.sharded() && state_ == ShardState::kUnsharded)
    for (size_t i = 0; i < params_.size(); ++i) {
      const auto& e = layout_.entries[i];
      unsharded_.narrow(0, e.offset, e.numel).copy_(values[i].reshape({-1}));
    }
}

int64_t ParamGroup::main_weight_bytes() const {
  return main_weights_.defined() && !main_weights_.aliases(model_weights_) ? main_weights_.nbytes() : 0;
}

}  // namespace mfsdp::detail
