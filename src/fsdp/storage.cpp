#include "fsdp/storage.h"

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

bool regrow_storage(const at::Tensor& flat) {
  c10::StorageImpl* storage = flat.storage().unsafeGetStorageImpl();
  const size_t bytes = required_bytes(flat);
  if (storage->nbytes() >= bytes) return false;
  storage->set_data_ptr_noswap(storage->allocator()->allocate(bytes));
  storage->set_nbytes(bytes);
  return true;
}

bool has_storage(const at::Tensor& flat) {
  return flat.storage().unsafeGetStorageImpl()->nbytes() >= required_bytes(flat);
}

}  // namespace mfsdp
