// The view ops that reach the pjrt device, as CPU's own kernels.
//
// PyTorch's composite kernels build t(), transpose, permute, expand, slicing, select, split,
// squeeze, unsqueeze and detach from three ops: as_strided, view and _reshape_alias. The CPU's
// kernels for those three only set sizes, strides and offset on a new TensorImpl that shares
// the input's storage, which is all a pjrt view is (a pjrt storage's bytes are a JAX array kept
// on the Python storage object, untouched by a view). Registered for PrivateUse1 they replace
// torchpjrt's Python view kernel for these ops: the same geometry and the same errors, without
// the trip into Python (about 7 us a view, against under 1 us here).

#include <ATen/core/Tensor.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/view_native.h>
#include <torch/library.h>

#include <memory>
#include <mutex>

namespace {

std::mutex registration_lock;
std::unique_ptr<torch::Library> registration;  // dropping it removes the kernels again

}  // namespace

extern "C" {

// Register (on != 0) or remove (on == 0) the native view kernels; idempotent.
void torchpjrt_native_views(int on) {
  std::lock_guard<std::mutex> hold(registration_lock);
  if (!on) {
    registration.reset();
    return;
  }
  if (registration) return;
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1,
                                              __FILE__, __LINE__);
  lib->impl("as_strided", TORCH_FN(at::native::as_strided_tensorimpl));
  lib->impl("view", TORCH_FN(at::native::view));
  lib->impl("_reshape_alias", TORCH_FN(at::native::_reshape_alias));
  registration = std::move(lib);
}

}  // extern "C"
