#include "fsdp/param_group.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/variable.h>

#include <stdexcept>

#include "fsdp/group_plan.h"
#include "fsdp/storage.h"
#include "mfsdp/comm/device_mesh.h"

namespace mfsdp::detail {
namespace {
std::shared_ptr<Communicator> replicate_group(const FullyShardOptions& options) {
  if (!options.mesh || options.mesh->dim_names().size() < 2) return nullptr;
  return options.mesh->get(options.mesh->dim_names().front());
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
      dp_size_(data_parallel_size(options)),
      requires_grad_(params_.at(0).param.requires_grad()),
      rank_(options.comm->rank()),
      device_(options.device.value_or(options.comm->device())) {
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& p : params_) shapes.push_back(p.shape);
  // Layout, placements and dtypes come from the plan that plan_memory also adds up (group_plan.h).
  const GroupPlan plan = plan_group(shapes, params_[0].original_dtype, requires_grad_, options, comm_->size());
  const RolePlacements placement = plan.placement;
  const at::ScalarType original = params_[0].original_dtype, main_dtype = plan.main_dtype;
  compute_dtype_ = plan.compute_dtype;
  grad_dtype_ = plan.grad_dtype;
  comm_dtype_ = options.mixed_precision.grad_comm_dtype.value_or(grad_dtype_);
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
      // Sharded main weights over replicated model weights of the same dtype: this rank's region.
      main_weights_ = FlatBuffer(&layout_, rank_, placement.main_weights, model_weights_.own());
    } else {
      main_weights_ = FlatBuffer::from_full(&layout_, rank_, placement.main_weights, original_flat,
                                            on_device.dtype(main_dtype));
    }
    main_grads_ = FlatBuffer::zeros(&layout_, rank_, placement.main_grads, on_device.dtype(grad_dtype_));
  }
}

void ParamGroup::attach(TransientCounter* transient, BufferAllocator* allocator,
                        const std::string* unit_path) {
  transient_ = transient;
  allocator_ = allocator;
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

void ParamGroup::prepare_gradients() {
  if (!requires_grad_) return;
  if (!unsharded_grad_.defined()) {
    const auto options = at::TensorOptions().dtype(compute_dtype_).device(device_);
    const size_t bytes = static_cast<size_t>(layout_.total()) * c10::elementSize(compute_dtype_);
    unsharded_grad_ = tensor_in(allocator_->allocate(this, BufferRole::kGradients, bytes, compute_dtype_,
                                                     device_),
                                layout_.total(), options)
                          .zero_();
    transient_->add(unsharded_grad_.nbytes());
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& e = layout_.entries[i];
    at::Tensor& grad = params_[i].param.mutable_grad();
    at::Tensor view = unsharded_grad_.narrow(0, e.offset, e.numel).view(params_[i].shape);
    if (grad.defined() && grad.data_ptr() == view.data_ptr()) continue;
    if (grad.defined()) view.add_(grad);  // a gradient the user or autograd left elsewhere
    grad = view;
  }
}

void ParamGroup::adopt_gradient(size_t i) {
  const auto& e = layout_.entries[i];
  at::Tensor& grad = params_[i].param.mutable_grad();
  if (!grad.defined() || !unsharded_grad_.defined()) return;
  at::Tensor view = unsharded_grad_.narrow(0, e.offset, e.numel).view(params_[i].shape);
  if (grad.data_ptr() == view.data_ptr()) return;
  view.add_(grad);  // autograd replaced our view (e.g. it stole a fresh gradient)
  grad = view;
}

void ParamGroup::release_unsharded_grad() {
  if (!unsharded_grad_.defined()) return;
  for (auto& p : params_) p.param.mutable_grad().reset();
  transient_->sub(unsharded_grad_.nbytes());
  unsharded_grad_.reset();
}

void ParamGroup::drop_unsharded_gradients() {
  release_unsharded_grad();
  if (accumulated_.defined()) {
    transient_->sub(accumulated_.nbytes());
    accumulated_.reset();
  }
}

void ParamGroup::stash_gradients() {
  if (!requires_grad_ || !unsharded_grad_.defined() || compute_dtype_ == grad_dtype_) return;
  // Gradient sync is off for this micro-batch. Autograd accumulates in the parameters' dtype;
  // summing bf16 micro-batches there would lose precision (and saturate), so they are moved
  // into an accumulator of the main-grad dtype until the synced backward reduces them.
  if (!accumulated_.defined()) {
    accumulated_ = at::zeros({layout_.total()}, at::TensorOptions().dtype(grad_dtype_).device(device_));
    transient_->add(accumulated_.nbytes());
  }
  accumulated_.add_(unsharded_grad_);
  release_unsharded_grad();
}

PendingReduction ParamGroup::reduce_gradients(Communicator& comm, double divide_factor,
                                              bool average_in_collective) {
  if (!requires_grad_ || (!unsharded_grad_.defined() && !accumulated_.defined())) return {};
  at::Tensor grads = unsharded_grad_;
  if (accumulated_.defined()) {  // earlier micro-batches, stashed in the main-grad dtype
    if (unsharded_grad_.defined()) accumulated_.add_(unsharded_grad_);
    grads = accumulated_;
  }
  if (deferred_reduction()) {
    // ZeRO-1 accumulates unreduced gradients in the full main grads; finish_deferred_reduction
    // reduces with a plain sum, so the scale (1/world when averaging) is applied here.
    const double scale = 1.0 / (average_in_collective ? dp_size_ : divide_factor);
    main_grads_.data().add_(grads.to(grad_dtype_), scale);
    drop_unsharded_gradients();
    return {};
  }
  const double scale = average_in_collective ? 1.0 : 1.0 / divide_factor;
  const ReduceOp op = average_in_collective ? ReduceOp::kAvg : ReduceOp::kSum;
  // The wire dtype (--grad-reduce-in-bf16: bf16); communicators accumulate it in fp32.
  at::Tensor wire = grads.scalar_type() == comm_dtype_ ? grads : grads.to(comm_dtype_);
  PendingReduction pending;
  at::Tensor reduced;  // what this rank receives: the whole buffer or its shard
  if (!main_grads_.sharded()) {
    if (scale != 1.0) wire.mul_(scale);
    pending.work = comm.all_reduce_async(wire, {op});
    reduced = wire;
  } else {
    reduced = at::empty({layout_.shard}, wire.options());
    ReduceScatterOptions rs;
    rs.op = op;
    rs.prescale = scale;
    pending.work = comm.reduce_scatter_async(reduced, wire, rs);
  }
  pending.finish_fn = [this, wire, reduced, op] {
    if (replicate_) replicate_->all_reduce(reduced, {op});  // HSDP: across replicas
    main_grads_.data().add_(reduced.to(grad_dtype_));
    drop_unsharded_gradients();
  };
  return pending;
}

void ParamGroup::finish_deferred_reduction() {
  if (!deferred_reduction() || !requires_grad_) return;
  // In place: this rank's region receives the reduction. Other ranks' regions are zeroed, so
  // that the next sync adds only new local gradients to the value this rank already reduced.
  const at::Tensor& full = main_grads_.data();
  at::Tensor own = main_grads_.own();
  if (!replicate_) {
    comm_->reduce_scatter(own, full);
  } else {
    // HSDP: only gradients new since the last sync may cross replicas, so the value this rank
    // already holds (identical on every replica) is taken out and put back around the exchange.
    if (!synced_.defined()) synced_ = at::zeros_like(own);
    own.sub_(synced_);
    comm_->reduce_scatter(own, full);
    replicate_->all_reduce(own);
    own.add_(synced_);
    synced_.copy_(own);
  }
  const int64_t begin = layout_.shard_begin(rank_), end = begin + layout_.shard;
  if (begin > 0) full.narrow(0, 0, begin).zero_();
  if (end < layout_.total()) full.narrow(0, end, layout_.total() - end).zero_();
}

void ParamGroup::zero_main_grads() {
  if (main_grads_.defined()) main_grads_.data().zero_();
  if (synced_.defined()) synced_.zero_();
  drop_unsharded_gradients();
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
}

OptimizerShard ParamGroup::optimizer_shard() const {
  OptimizerShard s;
  if (!requires_grad_) return s;
  s.main_weight = main_weights_.data();
  s.main_grad = main_grads_.range(main_weights_.begin(), main_weights_.data().numel());
  s.replicated = !main_weights_.sharded();
  for (size_t i = 0; i < params_.size(); ++i) {
    const FlatBuffer::ParamSlice slice = main_weights_.slice_of(i);
    if (slice.length == 0) continue;
    // Megatron's rule: no weight decay on biases and norm weights (1-D and 0-D parameters).
    const bool decay = params_[i].shape.size() >= 2;
    s.segments.push_back({slice.local_offset, slice.length, decay});
  }
  return s;
}

std::vector<LocalShard> ParamGroup::local_shards() const {
  std::vector<LocalShard> out;
  const FlatBuffer& source = requires_grad_ ? main_weights_ : model_weights_;
  // A replicated source is held by every rank of the shard group; HSDP replicas hold the same
  // shard again.
  const int outer = replicate_ ? replicate_->size() : 1;
  const int outer_rank = replicate_ ? replicate_->rank() : 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    const FlatBuffer::ParamSlice slice = source.slice_of(i);
    LocalShard ls;
    ls.name = params_[i].name;
    ls.global_shape = params_[i].shape;
    ls.requires_grad = requires_grad_;
    ls.offset = slice.param_offset;
    ls.local = source.data().narrow(0, slice.length > 0 ? slice.local_offset : 0, slice.length);
    ls.shard_offset = slice.length > 0 ? slice.local_offset : 0;
    ls.replicas = source.sharded() ? outer : outer * comm_->size();
    ls.replica = source.sharded() ? outer_rank : outer_rank * comm_->size() + comm_->rank();
    out.push_back(ls);
  }
  return out;
}

std::vector<at::Tensor> ParamGroup::gather_full_parameters() const {
  const FlatBuffer& source = requires_grad_ ? main_weights_ : model_weights_;
  at::Tensor full = source.data();
  if (source.sharded()) {
    full = at::empty({layout_.total()}, source.data().options());
    comm_->all_gather(full, source.data());
  }
  std::vector<at::Tensor> values;
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& e = layout_.entries[i];
    values.push_back(full.narrow(0, e.offset, e.numel)
                         .view(params_[i].shape)
                         .to(params_[i].original_dtype)
                         .clone());
  }
  return values;
}

void ParamGroup::load_full_parameters(const std::vector<at::Tensor>& values) {
  wait_unshard();
  // Staged in fp64 on the CPU (exact for every parameter dtype), copied into the device buffers.
  at::Tensor flat = at::zeros({layout_.total()}, at::TensorOptions().dtype(at::kDouble));
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& e = layout_.entries[i];
    flat.narrow(0, e.offset, e.numel).copy_(values[i].reshape(-1));
  }
  auto copy_into = [&](const FlatBuffer& b) {
    b.data().copy_(b.sharded() ? flat.narrow(0, b.begin(), layout_.shard) : flat);
  };
  if (requires_grad_ && !main_weights_.aliases(model_weights_)) copy_into(main_weights_);
  copy_into(model_weights_);
  if (model_weights_.sharded() && state_ == ShardState::kUnsharded) unsharded_.copy_(flat);
}

int64_t ParamGroup::main_weight_bytes() const {
  return main_weights_.defined() && !main_weights_.aliases(model_weights_) ? main_weights_.nbytes() : 0;
}

}  // namespace mfsdp::detail
