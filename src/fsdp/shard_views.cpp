// The optimizer's and checkpoints' views of a ParamGroup (src/fsdp/shard_views.h).
#include "fsdp/shard_views.h"

#include <ATen/ATen.h>

namespace mfsdp::detail {

OptimizerShard optimizer_shard(const ParamGroup& group) {
  OptimizerShard s;
  if (!group.requires_grad()) return s;
  const FlatBuffer& main = group.main_weights();
  s.main_weight = main.data();
  s.main_grad = group.gradients().main_grads().range(main.begin(), main.data().numel());
  s.replicated = !main.sharded();
  if (s.replicated) s.copies = group.shard_group().size();
  for (size_t i = 0; i < group.params().size(); ++i) {
    const FlatBuffer::ParamSlice slice = main.slice_of(i);
    if (slice.length == 0) continue;
    // Megatron's rule: no weight decay on biases and norm weights (1-D and 0-D parameters).
    const bool decay = group.params()[i].shape.size() >= 2;
    s.segments.push_back({slice.local_offset, slice.length, decay});
    // Which piece of which parameter these elements are (Muon assembles matrices from them).
    s.params.push_back({group.params()[i].name, group.params()[i].shape, slice.local_offset, slice.param_offset,
                        slice.length});
  }
  return s;
}

std::vector<LocalShard> local_shards(const ParamGroup& group) {
  std::vector<LocalShard> out;
  const FlatBuffer& source = group.requires_grad() ? group.main_weights() : group.model_weights();
  // A replicated source is held by every rank of the shard group; HSDP replicas hold the same
  // shard again.
  const Communicator& shards = group.shard_group();
  const Communicator* replicas = group.replicas();
  const int outer = replicas ? replicas->size() : 1;
  const int outer_rank = replicas ? replicas->rank() : 0;
  for (size_t i = 0; i < group.params().size(); ++i) {
    const FlatBuffer::ParamSlice slice = source.slice_of(i);
    LocalShard ls;
    ls.name = group.params()[i].name;
    ls.global_shape = group.params()[i].shape;
    ls.requires_grad = group.requires_grad();
    ls.offset = slice.param_offset;
    ls.local = source.data().narrow(0, slice.length > 0 ? slice.local_offset : 0, slice.length);
    ls.shard_offset = slice.length > 0 ? slice.local_offset : 0;
    // HFSDP: every rank holds a slice of its own.
    ls.replicas = source.outer_sharded() ? 1 : source.sharded() ? outer : outer * shards.size();
    ls.replica = source.outer_sharded() ? 0 : source.sharded() ? outer_rank : outer_rank * shards.size() + shards.rank();
    out.push_back(ls);
  }
  return out;
}

namespace {
const FlatBuffer& full_source(const ParamGroup& group) {
  return group.requires_grad() ? group.main_weights() : group.model_weights();
}
}  // namespace

int64_t full_gather_bytes(const ParamGroup& group) {
  const FlatBuffer& source = full_source(group);
  return source.sharded() ? group.layout().total() * static_cast<int64_t>(source.data().element_size()) : 0;
}

at::Tensor full_gather_scratch(const std::vector<const ParamGroup*>& groups) {
  const ParamGroup* largest = nullptr;
  for (const ParamGroup* g : groups)
    if (full_gather_bytes(*g) > 0 && (!largest || full_gather_bytes(*g) > full_gather_bytes(*largest))) largest = g;
  if (!largest) return {};
  return at::empty({full_gather_bytes(*largest)}, full_source(*largest).data().options().dtype(at::kByte));
}

void for_each_full_parameter(const ParamGroup& group, const at::Tensor& scratch,
                             const std::function<void(size_t, const at::Tensor&)>& visit) {
  const FlatBuffer& source = full_source(group);
  at::Tensor full = source.data();
  if (source.outer_sharded()) {  // HFSDP: this shard from its replicas' sub-shards first
    full = at::empty({group.layout().shard}, source.data().options());
    group.replicas()->all_gather(full, source.data());
  }
  if (source.sharded()) {
    at::Tensor shard = full;
    full = scratch.narrow(0, 0, full_gather_bytes(group)).view(shard.scalar_type());
    group.shard_group().all_gather(full, shard);
  }
  if (!visit) return;
  for (size_t i = 0; i < group.params().size(); ++i) {
    const auto& e = group.layout().entries[i];
    visit(i, full.narrow(0, e.offset, e.numel).view(group.params()[i].shape).to(group.params()[i].original_dtype));
  }
}

std::vector<at::Tensor> gather_full_parameters(const ParamGroup& group) {
  std::vector<at::Tensor> values;
  for_each_full_parameter(group, full_gather_scratch({&group}), [&](size_t, const at::Tensor& full) { values.push_back(full.clone()); });
  return values;
}

void load_full_parameters(ParamGroup& group, const std::vector<at::Tensor>& values) {
  // Each rank's slices straight from the values (no full-size staging of the group).
  group.load_values(values);
}

}  // namespace mfsdp::detail
