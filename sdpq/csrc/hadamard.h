// Blockwise randomized Walsh-Hadamard transform of fp32 tiles (sdpq/quant/hadamard.py).
#pragma once

#include "simd.h"

namespace sdpq {

// Blockwise randomized Walsh-Hadamard H_B D / B (forward) and D H_B (inverse), as
// sdpq/quant/hadamard.py. Note: the forward halves before every stage (exact), so no finite
// input overflows; kHalve below is that choice, a template argument so the loops stay branchless.
struct Hadamard {
  int64_t B = 1;
  const float* signs = nullptr;
  explicit Hadamard(const std::optional<at::Tensor>& s) {
    if (!s) return;
    TORCH_CHECK(s->scalar_type() == at::kFloat && s->is_contiguous() && s->device().is_cpu(),
                "hadamard signs must be a contiguous fp32 CPU tensor");
    B = s->numel();
    TORCH_CHECK(B >= 1 && (B & (B - 1)) == 0, "hadamard block ", B, " is not a power of two");
    signs = s->data_ptr<float>();
  }

  // Stages h = 1, 2, 4 inside one 8-lane vector: a shuffle brings each lane its partner p and
  // the upper lane of each pair is negated (a sign-bit flip, exact), so one add gives lane j
  // p + x_j = x_{j+h} + x_j and lane j + h x_j + (-x_{j+h}): the reference's a + b and a - b.
  // Halving happens before a stage's adds: a + b may overflow, a / 2 + b / 2 cannot.
  template <bool kHalve>
  SDPQ_INLINE static f8 halve(f8 v) { return kHalve ? v * 0.5f : v; }

  template <bool kHalve>
  SDPQ_INLINE static f8 stages_in_vector(f8 v) {
    const i8 n1 = {0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN};
    const i8 n2 = {0, 0, INT32_MIN, INT32_MIN, 0, 0, INT32_MIN, INT32_MIN};
    const i8 n4 = {0, 0, 0, 0, INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN};
    v = halve<kHalve>(v);
    v = __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6) + (f8)((i8)v ^ n1);
    v = halve<kHalve>(v);
    v = __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5) + (f8)((i8)v ^ n2);
    v = halve<kHalve>(v);
    return __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3) + (f8)((i8)v ^ n4);
  }

  // In place, pairs (j, j + h) of every run of 2h become (a + b, a - b) for h = 1, 2, 4, ...
  // (both halved first if kHalve).
  template <bool kHalve>
  static void butterflies(float* x, int64_t B) {
    const float half = kHalve ? 0.5f : 1.0f;
    int64_t h = 1;
    if (B >= 8) {
      for (int64_t j = 0; j < B; j += 8) storeu(x + j, stages_in_vector<kHalve>(loadu(x + j)));
      h = 8;
    }
    for (; h < B; h *= 2) {
      for (int64_t j = 0; j < B; j += 2 * h) {
        float* a = x + j;
        float* b = x + j + h;
        if (h >= 8) {
          for (int64_t i = 0; i < h; i += 8) {
            const f8 va = halve<kHalve>(loadu(a + i)), vb = halve<kHalve>(loadu(b + i));
            storeu(a + i, va + vb);
            storeu(b + i, va - vb);
          }
          continue;
        }
        for (int64_t i = 0; i < h; ++i) {
          const float va = a[i] * half, vb = b[i] * half;
          const float s = va + vb, d = va - vb;
          a[i] = s;
          b[i] = d;
        }
      }
    }
  }

  // The transform of one block of NV * 8 values held in registers r (loaded by the caller):
  // signs and all stages, the same operations in the same order as forward / inverse below.
  template <int NV, bool kForward>
  void transform_registers(f8 (&r)[NV]) const {
#pragma GCC unroll 16
    for (int k = 0; k < NV; ++k) {
      if (kForward) r[k] = r[k] * loadu(signs + 8 * k);
      r[k] = stages_in_vector<kForward>(r[k]);
    }
#pragma GCC unroll 4
    for (int h = 1; h < NV; h *= 2) {
#pragma GCC unroll 16
      for (int j = 0; j < NV; j += 2 * h) {
#pragma GCC unroll 16
        for (int i = 0; i < h; ++i) {
          const f8 a = halve<kForward>(r[j + i]), b = halve<kForward>(r[j + i + h]);
          r[j + i] = a + b;
          r[j + i + h] = a - b;
        }
      }
    }
    if (!kForward) {
#pragma GCC unroll 16
      for (int k = 0; k < NV; ++k) r[k] = r[k] * loadu(signs + 8 * k);
    }
  }

  template <int NV, bool kForward>
  void block_in_registers(const float* src, float* dst) const {
    f8 r[NV];
#pragma GCC unroll 16
    for (int k = 0; k < NV; ++k) r[k] = loadu(src + 8 * k);
    transform_registers<NV, kForward>(r);
#pragma GCC unroll 16
    for (int k = 0; k < NV; ++k) storeu(dst + 8 * k, r[k]);
  }

  template <bool kForward>
  bool try_registers(const float* src, float* dst, int64_t len) const {
    return with_block(B, [&](auto nv) {
      for (int64_t b0 = 0; b0 < len; b0 += B) block_in_registers<decltype(nv)::value, kForward>(src + b0, dst + b0);
      return true;
    });
  }


  // dst[0:len] = the transform of src[0:len] (dst may be src).
  void forward(const float* src, float* dst, int64_t len) const {
    if (try_registers<true>(src, dst, len)) return;
    if (dst != src) std::memcpy(dst, src, len * sizeof(float));
    forward(dst, len);
  }

  void forward(float* x, int64_t len) const {
    if (try_registers<true>(x, x, len)) return;
    for (int64_t b0 = 0; b0 < len; b0 += B) {
      float* blk = x + b0;
      for (int64_t i = 0; i < B; ++i) blk[i] = blk[i] * signs[i];
      butterflies<true>(blk, B);
    }
  }

  void inverse(float* x, int64_t len) const {
    if (try_registers<false>(x, x, len)) return;
    for (int64_t b0 = 0; b0 < len; b0 += B) {
      float* blk = x + b0;
      butterflies<false>(blk, B);
      for (int64_t i = 0; i < B; ++i) blk[i] = blk[i] * signs[i];
    }
  }
};

}  // namespace sdpq
