// Several pjrt devices in one process: what PyTorch's Python device backend cannot say.
//
// The Python PrivateUse1 backend (torch._C._acc) reports one device, index 0, and builds every
// tensor on pjrt:0. PyTorch's autograd engine sizes its per-device worker threads from the
// device guard's count, and a tensor's device is fixed in its TensorImpl. This library gives
// the pjrt device a real device guard (a count, a current device per thread, as CUDA's) and
// moves a freshly made tensor onto another index. torchpjrt loads it with ctypes (no Python
// API here); without it, only pjrt:0 holds tensors.

#include <c10/core/Device.h>
#include <c10/core/Stream.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <atomic>

namespace {

constexpr c10::DeviceType kPjrt = c10::DeviceType::PrivateUse1;

std::atomic<c10::DeviceIndex> device_count{1};
thread_local c10::DeviceIndex current_index = 0;

struct PjrtGuard final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kPjrt; }
  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kPjrt, current_index); }
  void setDevice(c10::Device d) const override { uncheckedSetDevice(d); }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0) current_index = d.index();
  }
  // one in-order queue per device (JAX's): every stream is the default stream
  c10::Stream getStream(c10::Device d) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream getNewStream(c10::Device d, int priority = 0) const override {
    (void)priority;
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, s.device());
  }
  c10::DeviceIndex deviceCount() const noexcept override { return device_count.load(); }
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
};

PjrtGuard guard;

}  // namespace

extern "C" {

// Make this library's guard the pjrt device's, for `count` devices.
void torchpjrt_register_guard(int count) {
  device_count.store(static_cast<c10::DeviceIndex>(count));
  c10::impl::registerDeviceGuard(kPjrt, &guard);
}

int torchpjrt_current_device() { return current_index; }

void torchpjrt_set_current_device(int index) { current_index = static_cast<c10::DeviceIndex>(index); }

// Put a tensor that is alone on its storage (just made) on pjrt:`index`: the storage's device,
// then the TensorImpl's cached copy of it.
void torchpjrt_place(void* tensor_impl, int index) {
  auto* impl = static_cast<c10::TensorImpl*>(tensor_impl);
  c10::Storage storage = impl->storage();
  storage.unsafeGetStorageImpl()->_mutable_data_ptr_no_checks().unsafe_set_device(
      c10::Device(kPjrt, static_cast<c10::DeviceIndex>(index)));
  impl->set_storage_keep_dtype(std::move(storage));
}

}  // extern "C"
