// A pjrt storage's c10 fields, set in one call: the address it reports as data_ptr() (see
// storage.py's "addresses") and its size in bytes, which CPU's view kernels (views.cpp) check a
// view's geometry against. storage.py writes the same two words with ctypes when this helper
// is not loaded.

#include <c10/core/StorageImpl.h>

#include <cstdint>

extern "C" void torchpjrt_give_storage(void* storage_impl, std::uint64_t address, std::int64_t nbytes) {
  auto* impl = static_cast<c10::StorageImpl*>(storage_impl);
  impl->set_data_ptr_noswap(
      c10::DataPtr(reinterpret_cast<void*>(static_cast<std::uintptr_t>(address)), impl->device()));
  impl->set_nbytes(nbytes);
}
