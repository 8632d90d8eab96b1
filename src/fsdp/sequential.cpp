#include "mfsdp/fsdp/sequential.h"

namespace mfsdp {

at::Tensor SequentialImpl::forward(at::Tensor x) {
  for (auto& child : *this) {
    detail::UnitState* unit = detail::find_unit(*child.ptr());
    if (unit == nullptr) {
      x = child.forward(x);
      continue;
    }
    x = detail::run_forward(*unit, std::function<at::Tensor()>([&] {
                              return child.forward(detail::cast_forward_input(*unit, x));
                            }));
  }
  return x;
}

}  // namespace mfsdp
