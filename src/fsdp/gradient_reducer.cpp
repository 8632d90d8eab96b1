// A parameter group's gradient path (src/fsdp/gradient_reducer.h).
#include "fsdp/gradient_reducer.h"

#include <ATen/ATen.h>

#include "fsdp/storage.h"

namespace mfsdp::detail {

GradientReducer::GradientReducer(ReducerSetup setup, FlatBuffer main_grads)
    : s_(std::move(setup)), main_grads_(std::move(main_grads)) {}

void GradientReducer::attach(TransientCounter* transient, BufferAllocator* allocator, const void* owner) {
  transient_ = transient;
  allocator_ = allocator;
  owner_ = owner;
}

void GradientReducer::prepare() {
  if (!defined()) return;
  const FlatLayout& layout = *s_.layout;
  if (!unsharded_grad_.defined()) {
    const auto options = at::TensorOptions().dtype(s_.compute_dtype).device(s_.device);
    const size_t bytes = static_cast<size_t>(layout.total()) * c10::elementSize(s_.compute_dtype);
    unsharded_grad_ = tensor_in(allocator_->allocate(owner_, BufferRole::kGradients, bytes, s_.compute_dtype,
                                                     s_.device),
                                layout.total(), options)
                          .zero_();
    transient_->add(unsharded_grad_.nbytes());
  }
  std::vector<GroupParam>& params = *s_.params;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& e = layout.entries[i];
    at::Tensor& grad = params[i].param.mutable_grad();
    at::Tensor view = unsharded_grad_.narrow(0, e.offset, e.numel).view(params[i].shape);
    if (grad.defined() && grad.data_ptr() == view.data_ptr()) continue;
    if (grad.defined()) view.add_(grad);  // a gradient the user or autograd left elsewhere
    grad = view;
  }
}

void GradientReducer::adopt(size_t i) {
  if (!defined()) return;
  const auto& e = s_.layout->entries[i];
  GroupParam& p = (*s_.params)[i];
  at::Tensor& grad = p.param.mutable_grad();
  if (!grad.defined() || !unsharded_grad_.defined()) return;
  at::Tensor view = unsharded_grad_.narrow(0, e.offset, e.numel).view(p.shape);
  if (grad.data_ptr() == view.data_ptr()) return;
  view.add_(grad);  // autograd replaced our view (e.g. it stole a fresh gradient)
  grad = view;
}

void GradientReducer::release_unsharded() {
  if (!unsharded_grad_.defined()) return;
  for (auto& p : *s_.params) p.param.mutable_grad().reset();
  transient_->sub(unsharded_grad_.nbytes());
  unsharded_grad_.reset();
}

void GradientReducer::drop_unsharded() {
  release_unsharded();
  if (accumulated_.defined()) {
    transient_->sub(accumulated_.nbytes());
    accumulated_.reset();
  }
}

void GradientReducer::stash() {
  if (!defined() || !unsharded_grad_.defined() || s_.compute_dtype == s_.grad_dtype) return;
  // Gradient sync is off for this micro-batch. Autograd accumulates in the parameters' dtype;
  // summing bf16 micro-batches there would lose precision (and saturate), so they are moved
  // into an accumulator of the main-grad dtype until the synced backward reduces them.
  if (!accumulated_.defined()) {
    accumulated_ = at::zeros({s_.layout->total()}, at::TensorOptions().dtype(s_.grad_dtype).device(s_.device));
    transient_->add(accumulated_.nbytes());
  }
  accumulated_.add_(unsharded_grad_);
  release_unsharded();
}

PendingReduction GradientReducer::reduce(Communicator& comm, double divide_factor, bool average_in_collective) {
  if (!defined() || (!unsharded_grad_.defined() && !accumulated_.defined())) return {};
  at::Tensor grads = unsharded_grad_;
  if (accumulated_.defined()) {  // earlier micro-batches, stashed in the main-grad dtype
    if (unsharded_grad_.defined()) accumulated_.add_(unsharded_grad_);
    grads = accumulated_;
  }
  if (s_.deferred) {
    // ZeRO-1 accumulates unreduced gradients in the full main grads; finish_deferred reduces
    // with a plain sum, so the scale (1/world when averaging) is applied here.
    const double scale = 1.0 / (average_in_collective ? s_.dp_size : divide_factor);
    main_grads_.data().add_(grads.to(s_.grad_dtype), scale);
    drop_unsharded();
    return {};
  }
  const double scale = average_in_collective ? 1.0 : 1.0 / divide_factor;
  const ReduceOp op = average_in_collective ? ReduceOp::kAvg : ReduceOp::kSum;
  // The wire dtype (--grad-reduce-in-bf16: bf16), summed as s_.low_precision_sum says.
  at::Tensor wire = grads.scalar_type() == s_.comm_dtype ? grads : grads.to(s_.comm_dtype);
  PendingReduction pending;
  at::Tensor reduced;  // what this rank receives: the whole buffer or its shard
  if (!main_grads_.sharded()) {
    if (scale != 1.0) wire.mul_(scale);
    AllReduceOptions ar;
    ar.op = op;
    ar.low_precision_sum = s_.low_precision_sum;
    pending.work = comm.all_reduce_async(wire, ar);
    reduced = wire;
  } else {
    reduced = at::empty({s_.layout->shard}, wire.options());
    ReduceScatterOptions rs;
    rs.op = op;
    rs.prescale = scale;  // NCCL: a PreMulSum, no scaled copy of the gradients
    rs.low_precision_sum = s_.low_precision_sum;
    pending.work = comm.reduce_scatter_async(reduced, wire, rs);
  }
  pending.finish_fn = [this, wire, reduced, op] {
    at::Tensor mine = reduced;
    if (main_grads_.outer_sharded()) {
      // HFSDP: this replica's sub-shard of the sum over the replicas.
      mine = at::empty({s_.layout->sub_shard()}, reduced.options());
      ReduceScatterOptions across;
      across.op = op;
      across.low_precision_sum = s_.low_precision_sum;
      s_.replicate->reduce_scatter(mine, reduced, across);
    } else if (s_.replicate) {
      AllReduceOptions ar;
      ar.op = op;
      ar.low_precision_sum = s_.low_precision_sum;
      s_.replicate->all_reduce(reduced, ar);  // HSDP: across replicas
    }
    main_grads_.data().add_(mine.to(s_.grad_dtype));
    drop_unsharded();
  };
  return pending;
}

void GradientReducer::finish_deferred() {
  if (!s_.deferred || !defined()) return;
  // In place: this rank's region receives the reduction. Other ranks' regions are zeroed, so
  // that the next sync adds only new local gradients to the value this rank already reduced.
  const at::Tensor& full = main_grads_.data();
  at::Tensor own = main_grads_.own();
  ReduceScatterOptions rs;
  rs.low_precision_sum = s_.low_precision_sum;
  AllReduceOptions ar;
  ar.low_precision_sum = s_.low_precision_sum;
  if (!s_.replicate) {
    s_.comm->reduce_scatter(own, full, rs);
  } else {
    // HSDP: only gradients new since the last sync may cross replicas, so the value this rank
    // already holds (identical on every replica) is taken out and put back around the exchange.
    if (!synced_.defined()) synced_ = at::zeros_like(own);
    own.sub_(synced_);
    s_.comm->reduce_scatter(own, full, rs);
    s_.replicate->all_reduce(own, ar);
    own.add_(synced_);
    synced_.copy_(own);
  }
  const FlatLayout& layout = *s_.layout;
  const int64_t begin = layout.shard_begin(s_.rank), end = begin + layout.shard;
  if (begin > 0) full.narrow(0, 0, begin).zero_();
  if (end < layout.total()) full.narrow(0, end, layout.total() - end).zero_();
}

void GradientReducer::zero() {
  if (main_grads_.defined()) main_grads_.data().zero_();
  if (synced_.defined()) synced_.zero_();
  drop_unsharded();
}

}  // namespace mfsdp::detail
