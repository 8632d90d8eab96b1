#include "fsdp/storage.h"

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>

namespace mfsdp {
namespace {
size_t required_bytes(const at::Tensor& flat) {
  return (flat.storage_offset() + flat.numel()) * flat.element_size();
}
}  // namespace

void free_storage(const at::Tensor& flat) {
  c10::StorageImpl* storage = flat.storage().unsafeGetStorageImpl();
  if (storage->nbytes() == 0) return;
  storage->reset();  // drops the allocation and sets nbytes to 0
}

size_t storage_bytes_needed(const at::Tensor& flat) { return required_bytes(flat); }

void regrow_storage(const at::Tensor& flat, c10::DataPtr memory) {
  c10::StorageImpl* storage = flat.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(std::move(memory));
  storage->set_nbytes(required_bytes(flat));
}

at::Tensor tensor_in(c10::DataPtr memory, int64_t numel, const at::TensorOptions& options) {
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
  // LibTorch's meta set_ insists on a resizable storage; a meta tensor (plan_memory runs the
  // runtime on them) holds no memory, so its storage may say so.
  const bool meta = options.device().is_meta();
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, std::move(memory),
                       /*allocator=*/meta ? c10::GetAllocator(c10::kMeta) : nullptr, /*resizable=*/meta);
  return at::empty({0}, options).set_(storage, 0, {numel}, {1});
}

bool has_storage(const at::Tensor& flat) {
  return flat.storage().unsafeGetStorageImpl()->nbytes() >= required_bytes(flat);
}

}  // namespace mfsdp
