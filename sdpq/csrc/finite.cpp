// CPU kernel of sdpq::first_nonfinite (defined in sdpq/kernels/finite_ops.py): the index of the
// first tensor of a list that holds an inf or a NaN, -1 when none does. The optimizer's guard
// runs it over every gradient before each step.
//
// torch's own check (aminmax per tensor, then isfinite of the results) costs ~10 us of dispatch
// per tensor, more than the scan itself for the small shards of norms and biases, and reads
// large gradients at ~12 GB/s; here one call scans each tensor's bits once: a float is not
// finite exactly when its exponent field is all ones, a test that vectorizes.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

namespace sdpq {
namespace finite {
namespace {

// Whether any of n values has all the bits of kExponent set (inf or NaN). Blocks of 4096 values
// are tested without a branch (GCC vectorizes the loop); the scan stops after the first bad one.
template <class U, U kExponent>
bool any_nonfinite(const U* p, int64_t n) {
  constexpr int64_t kBlock = 4096;
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t i1 = std::min(n, i0 + kBlock);
    U bad = 0;
    for (int64_t i = i0; i < i1; ++i) bad |= static_cast<U>((p[i] & kExponent) == kExponent);
    if (bad) return true;
  }
  return false;
}

bool nonfinite(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), "first_nonfinite: CPU tensors only, got one on ", t.device());
  if (t.is_contiguous()) {
    const void* p = t.data_ptr();
    switch (t.scalar_type()) {
      case at::kFloat:
        return any_nonfinite<uint32_t, 0x7F800000u>(static_cast<const uint32_t*>(p), t.numel());
      case at::kBFloat16:
        return any_nonfinite<uint16_t, 0x7F80u>(static_cast<const uint16_t*>(p), t.numel());
      case at::kHalf:
        return any_nonfinite<uint16_t, 0x7C00u>(static_cast<const uint16_t*>(p), t.numel());
      default:
        break;
    }
  }
  return t.numel() > 0 && !at::isfinite(t).all().item<bool>();  // other dtypes and layouts
}

int64_t first_nonfinite(at::TensorList tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (nonfinite(tensors[i])) return static_cast<int64_t>(i);
  }
  return -1;
}

}  // namespace
}  // namespace finite
}  // namespace sdpq

TORCH_LIBRARY_IMPL(sdpq, CPU, m) { m.impl("first_nonfinite", &sdpq::finite::first_nonfinite); }
