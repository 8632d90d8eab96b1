#include "fsdp/param_group.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/variable.h>

#include <stdexcept>

#include "fsdp/storage.h"
#include "mfsdp/device_mesh.h"

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

ParamGroup::ParamGroup(std::vector<GroupParam> params, const FullyShardOptions& options,
                       TransientCounter* transient)
    : params_(std::move(params)),
      comm_(options.comm),
      replicate_(replicate_group(options)),
      dp_size_(data_parallel_size(options)),
      strategy_(options.strategy),
      requires_grad_(params_.at(0).param.requires_grad()),
      rank_(options.comm->rank()),
      transient_(transient) {
  const MixedPrecisionPolicy& mp = options.mixed_precision;
  const at::ScalarType original = params_[0].original_dtype;
  compute_dtype_ = mp.param_dtype && at::isFloatingType(original) ? *mp.param_dtype : original;
  main_dtype_ = at::isFloatingType(original) ? mp.main_params_dtype : original;
  grad_dtype_ = mp.main_grads_dtype;
  comm_dtype_ = mp.grad_comm_dtype.value_or(grad_dtype_);

  std::vector<std::vector<int64_t>> shapes;
  for (const auto& p : params_) shapes.push_back(p.shape);
  layout_ = FlatLayout::build(shapes, comm_->size(), options.align_rows);

  // The original values, packed (padding zero), in their own dtype: main weights start from
  // them at full precision, model weights from their cast.
  at::Tensor original_flat = at::zeros({layout_.total()}, at::TensorOptions().dtype(original));
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& e = layout_.entries[i];
    original_flat.narrow(0, e.offset, e.numel).copy_(params_[i].param.detach().reshape(-1));
  }
  unsharded_ = original_flat.to(compute_dtype_).clone();
  point_params_at_unsharded();

  const int64_t begin = layout_.shard_begin(rank_), shard = layout_.shard;
  if (sharded_model()) {
    model_shard_ = unsharded_.narrow(0, begin, shard).clone();
    free_storage(unsharded_);
  }
  if (requires_grad_) {
    at::Tensor model_main_range =
        sharded_model() ? model_shard_
                        : (sharded_main() ? unsharded_.narrow(0, begin, shard) : unsharded_);
    if (model_main_range.scalar_type() == main_dtype_) {
      main_weight_ = model_main_range;  // one copy serves both roles
      main_aliases_model_ = true;
    } else {
      main_weight_ = sharded_main() ? original_flat.narrow(0, begin, shard).to(main_dtype_).clone()
                                    : original_flat.to(main_dtype_);
    }
    main_grad_ = at::zeros({sharded_grads() ? shard : layout_.total()},
                           at::TensorOptions().dtype(grad_dtype_));
  }
}

void ParamGroup::point_params_at_unsharded() {
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& e = layout_.entries[i];
    at::Tensor view = unsharded_.narrow(0, e.offset, e.numel).view(params_[i].shape);
    params_[i].param.set_data(view);
  }
}

bool ParamGroup::is_unsharded() const { return has_storage(unsharded_); }

ParamGroup::~ParamGroup() {
  // The communication thread may still be writing into the unsharded buffer.
  try {
    wait_unshard();
  } catch (...) {
  }
}

bool ParamGroup::start_unshard() {
  if (!sharded_model() || is_unsharded()) return false;
  regrow_storage(unsharded_, allocator_->allocate(this, BufferRole::kWeights, storage_bytes_needed(unsharded_),
                                                  compute_dtype_, unsharded_.device()));
  transient_->add(unsharded_.nbytes());
  gathering_ = comm_->all_gather_async(unsharded_, model_shard_);
  return true;
}

void ParamGroup::wait_unshard() {
  if (!gathering_) return;
  WorkHandle work = std::move(gathering_);
  gathering_ = nullptr;
  work->wait();
}

bool ParamGroup::unshard() {
  const bool started = start_unshard();
  wait_unshard();
  return started;
}

void ParamGroup::reshard() {
  if (!sharded_model() || !is_unsharded()) return;
  wait_unshard();
  free_storage(unsharded_);
  transient_->sub(unsharded_.nbytes());
}

void ParamGroup::prepare_gradients() {
  if (!requires_grad_) return;
  if (!unsharded_grad_.defined()) {
    const auto options = at::TensorOptions().dtype(compute_dtype_).device(unsharded_.device());
    const size_t bytes = static_cast<size_t>(layout_.total()) * c10::elementSize(compute_dtype_);
    unsharded_grad_ = tensor_in(allocator_->allocate(this, BufferRole::kGradients, bytes, compute_dtype_,
                                                     options.device()),
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
    accumulated_ = at::zeros({layout_.total()}, at::TensorOptions().dtype(grad_dtype_));
    transient_->add(accumulated_.nbytes());
  }
  accumulated_.add_(unsharded_grad_);
  release_unsharded_grad();
}

PendingReduction ParamGroup::reduce_gradients(double divide_factor, bool average_in_collective) {
  if (!requires_grad_ || (!unsharded_grad_.defined() && !accumulated_.defined())) return {};
  at::Tensor grads = unsharded_grad_;
  if (accumulated_.defined()) {  // earlier micro-batches, stashed in the main-grad dtype
    if (unsharded_grad_.defined()) accumulated_.add_(unsharded_grad_);
    grads = accumulated_;
  }
  if (strategy_ == ShardingStrategy::kOptim) {
    // ZeRO-1 accumulates unreduced gradients in the full main grads; finish_optim_sync reduces
    // with a plain sum, so the scale (1/world when averaging) is applied here.
    const double scale =
        1.0 / (average_in_collective ? dp_size_ : divide_factor);
    main_grad_.add_(grads.to(grad_dtype_), scale);
    drop_unsharded_gradients();
    return {};
  }
  const double scale = average_in_collective ? 1.0 : 1.0 / divide_factor;
  const ReduceOp op = average_in_collective ? ReduceOp::kAvg : ReduceOp::kSum;
  at::Tensor wire = grads.scalar_type() == comm_dtype_ ? grads : grads.to(comm_dtype_);
  PendingReduction pending;
  if (strategy_ == ShardingStrategy::kNoShard) {
    if (scale != 1.0) wire.mul_(scale);
    pending.work = comm_->all_reduce_async(wire, {op});
    pending.finish_fn = [this, wire, op] {
      if (replicate_) replicate_->all_reduce(wire, {op});
      main_grad_.add_(wire.to(grad_dtype_));
      drop_unsharded_gradients();
    };
  } else {
    at::Tensor shard = at::empty({layout_.shard}, wire.options());
    ReduceScatterOptions rs;
    rs.op = op;
    rs.prescale = scale;
    pending.work = comm_->reduce_scatter_async(shard, wire, rs);
    pending.finish_fn = [this, wire, shard, op] {
      if (replicate_) replicate_->all_reduce(shard, {op});  // HSDP: across replicas
      main_grad_.add_(shard.to(grad_dtype_));
      drop_unsharded_gradients();
    };
  }
  return pending;
}

void ParamGroup::finish_optim_sync() {
  if (strategy_ != ShardingStrategy::kOptim || !requires_grad_) return;
  // In place: this rank's region receives the reduction. Other ranks' regions are zeroed, so
  // that the next sync adds only new local gradients to the value this rank already reduced.
  const int64_t begin = layout_.shard_begin(rank_), shard = layout_.shard;
  at::Tensor own = main_grad_.narrow(0, begin, shard);
  if (!replicate_) {
    comm_->reduce_scatter(own, main_grad_);
  } else {
    // HSDP: only gradients new since the last sync may cross replicas, so the value this rank
    // already holds (identical on every replica) is taken out and put back around the exchange.
    if (!synced_.defined()) synced_ = at::zeros_like(own);
    own.sub_(synced_);
    comm_->reduce_scatter(own, main_grad_);
    replicate_->all_reduce(own);
    own.add_(synced_);
    synced_.copy_(own);
  }
  if (begin > 0) main_grad_.narrow(0, 0, begin).zero_();
  const int64_t end = begin + shard;
  if (end < layout_.total()) main_grad_.narrow(0, end, layout_.total() - end).zero_();
}

void ParamGroup::zero_main_grads() {
  if (main_grad_.defined()) main_grad_.zero_();
  if (synced_.defined()) synced_.zero_();
  drop_unsharded_gradients();
}

void ParamGroup::copy_main_to_model_weights() {
  if (!requires_grad_) return;
  wait_unshard();  // a prefetch may still be reading the model shard
  const int64_t begin = layout_.shard_begin(rank_), shard = layout_.shard;
  switch (strategy_) {
    case ShardingStrategy::kOptimGradsParams:
      if (!main_aliases_model_) model_shard_.copy_(main_weight_);
      break;
    case ShardingStrategy::kNoShard:
      if (!main_aliases_model_) unsharded_.copy_(main_weight_);
      break;
    default: {
      // ZeRO-1/2: every rank updated its region; gather the full model weights.
      at::Tensor own = unsharded_.narrow(0, begin, shard);
      if (!main_aliases_model_) own.copy_(main_weight_);
      comm_->all_gather(unsharded_, own);
    }
  }
}

OptimizerShard ParamGroup::optimizer_shard() const {
  OptimizerShard s;
  if (!requires_grad_) return s;
  s.main_weight = main_weight_;
  const int64_t begin = main_begin();
  s.main_grad = strategy_ == ShardingStrategy::kOptim
                    ? main_grad_.narrow(0, begin, layout_.shard)
                    : main_grad_;
  s.replicated = strategy_ == ShardingStrategy::kNoShard;
  const int64_t length = main_weight_.numel();
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& e = layout_.entries[i];
    int64_t lo = std::max(e.offset, begin), hi = std::min(e.offset + e.numel, begin + length);
    if (hi <= lo) continue;
    // Megatron's rule: no weight decay on biases and norm weights (1-D and 0-D parameters).
    bool decay = params_[i].shape.size() >= 2;
    s.segments.push_back({lo - begin, hi - lo, decay});
  }
  return s;
}

std::vector<LocalShard> ParamGroup::local_shards() const {
  std::vector<LocalShard> out;
  at::Tensor source = requires_grad_ ? main_weight_
                                     : (sharded_model() ? model_shard_ : unsharded_);
  const int64_t length = source.numel();
  // The source is sharded over comm_ unless it is a full copy (no_shard main weights, frozen
  // weights outside ZeRO-3); HSDP replicas hold the same shard again.
  const bool full_copy = requires_grad_ ? !sharded_main() : !sharded_model();
  const int64_t begin = full_copy ? 0 : layout_.shard_begin(rank_);
  const int outer = replicate_ ? replicate_->size() : 1;
  const int outer_rank = replicate_ ? replicate_->rank() : 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& e = layout_.entries[i];
    int64_t lo = std::max(e.offset, begin), hi = std::min(e.offset + e.numel, begin + length);
    LocalShard ls;
    ls.name = params_[i].name;
    ls.global_shape = params_[i].shape;
    ls.requires_grad = requires_grad_;
    ls.offset = hi > lo ? lo - e.offset : 0;
    ls.local = hi > lo ? source.narrow(0, lo - begin, hi - lo) : source.narrow(0, 0, 0);
    ls.shard_offset = hi > lo ? lo - begin : 0;
    ls.replicas = full_copy ? outer * comm_->size() : outer;
    ls.replica = full_copy ? outer_rank * comm_->size() + comm_->rank() : outer_rank;
    out.push_back(ls);
  }
  return out;
}

std::vector<at::Tensor> ParamGroup::gather_full_parameters() const {
  at::Tensor full;
  if (requires_grad_ && sharded_main()) {
    full = at::empty({layout_.total()}, main_weight_.options());
    comm_->all_gather(full, main_weight_);
  } else if (requires_grad_) {
    full = main_weight_;
  } else if (sharded_model()) {
    full = at::empty({layout_.total()}, model_shard_.options());
    comm_->all_gather(full, model_shard_);
  } else {
    full = unsharded_;
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
  at::Tensor flat = at::zeros({layout_.total()}, at::TensorOptions().dtype(at::kDouble));
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& e = layout_.entries[i];
    flat.narrow(0, e.offset, e.numel).copy_(values[i].reshape(-1));
  }
  const int64_t begin = layout_.shard_begin(rank_), shard = layout_.shard;
  if (requires_grad_ && !main_aliases_model_) {
    main_weight_.copy_(sharded_main() ? flat.narrow(0, begin, shard) : flat);
  }
  if (sharded_model()) {
    model_shard_.copy_(flat.narrow(0, begin, shard));
    if (is_unsharded()) unsharded_.copy_(flat);
  } else {
    unsharded_.copy_(flat);
  }
}

int64_t ParamGroup::model_weight_bytes() const {
  return sharded_model() ? model_shard_.nbytes() : unsharded_.nbytes();
}

int64_t ParamGroup::main_weight_bytes() const {
  return main_weight_.defined() && !main_aliases_model_ ? main_weight_.nbytes() : 0;
}

int64_t ParamGroup::main_grad_bytes() const {
  return (main_grad_.defined() ? main_grad_.nbytes() : 0) + (synced_.defined() ? synced_.nbytes() : 0);
}

}  // namespace mfsdp::detail
