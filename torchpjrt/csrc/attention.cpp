// scaled_dot_product_attention on pjrt tensors as one op (one program forward, one backward).
//
// PyTorch picks an attention backend per device through a DispatchStub, and a device without an
// entry gets the math path: about a dozen ops forward (the causal mask built, q and k scaled,
// two matmuls, a softmax, grouped keys repeated) and more backward, each a program of its own in
// eager mode. This entry picks the "overrideable" backend for plain pjrt tensors, whose ops
// (_scaled_dot_product_fused_attention_overrideable and its backward) torchpjrt implements;
// anything else keeps the math path, whose results and errors are PyTorch's own.

#include <ATen/Context.h>
#include <ATen/SDPBackend.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/transformers/attention.h>

namespace {

bool plain(const at::Tensor& t) {
  // tensor subclasses (DTensor), fake tensors, functorch's wrappers: the math path, whose ops
  // they all know; a forward-mode gradient: the math path has its formulas
  constexpr c10::DispatchKeySet wrapped({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
                                         c10::DispatchKey::FuncTorchBatched, c10::DispatchKey::FuncTorchGradWrapper,
                                         c10::DispatchKey::Functionalize, c10::DispatchKey::BatchedNestedTensor});
  return t.defined() && !t.key_set().has_any(wrapped) && !t.is_nested() && !t._fw_grad(0).defined();
}

int64_t choose(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
               const std::optional<at::Tensor>& attn_mask, double dropout_p, bool /*is_causal*/,
               std::optional<double> /*scale*/, bool enable_gqa) {
  constexpr int64_t math = static_cast<int64_t>(at::SDPBackend::math);
  if (!at::globalContext().userEnabledOverrideableSDP() || dropout_p != 0.0) return math;
  if (!plain(query) || !plain(key) || !plain(value) || (attn_mask.has_value() && attn_mask->defined() && !plain(*attn_mask)))
    return math;
  const int64_t dims = query.dim();
  if ((dims != 3 && dims != 4) || key.dim() != dims || value.dim() != dims) return math;
  if (query.numel() == 0 || key.numel() == 0 || value.numel() == 0) return math;
  if (!at::isFloatingType(query.scalar_type())) return math;
  // batch and head dims as the math path takes them: equal, or fewer key/value heads that
  // divide the query's when grouped attention is asked for
  for (int64_t d = 0; d < dims - 2; ++d) {
    if (key.size(d) != value.size(d)) return math;
    if (query.size(d) == key.size(d)) continue;
    const bool heads = d == dims - 3;
    if (!heads || !enable_gqa || query.size(d) % key.size(d) != 0) return math;
  }
  if (key.size(-2) != value.size(-2) || query.size(-1) != key.size(-1)) return math;
  if (attn_mask.has_value() && attn_mask->defined()) {
    // broadcast to (..., heads, L, S) by trailing dims, else the math path says why not
    const at::Tensor& mask = *attn_mask;
    if (mask.dim() > dims) return math;
    for (int64_t i = 1; i <= mask.dim(); ++i) {
      const int64_t want = i == 1 ? key.size(-2) : i == 2 ? query.size(-2) : query.size(-i);
      if (mask.size(-i) != 1 && mask.size(-i) != want) return math;
    }
  }
  return static_cast<int64_t>(at::SDPBackend::overrideable);
}

}  // namespace

extern "C" {

// Pick the overrideable backend for pjrt tensors (on != 0), or leave every call to the math
// path (on == 0).
void torchpjrt_native_attention(int on) {
  at::native::_fused_sdp_choice_stub.set_privateuse1_dispatch_ptr(on ? &choose : nullptr);
}

}  // extern "C"
