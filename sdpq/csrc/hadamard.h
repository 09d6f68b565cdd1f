// Blockwise randomized Walsh-Hadamard transform of fp32 tiles (sdpq/quant/hadamard.py).
#pragma once

#include "simd.h"

namespace sdpq {

// Blockwise randomized Walsh-Hadamard H_B (D / B) (forward) and D H_B (inverse), as
// sdpq/quant/hadamard.py: the forward multiplies by the signs over B first (exact: B is a power
// of two), so every butterfly stage of both directions is a plain a + b, a - b.
struct Hadamard {
  int64_t B = 1;
  const float* signs = nullptr;
  std::vector<float> scaled;  // signs / B
  explicit Hadamard(const std::optional<at::Tensor>& s) {
    if (!s) return;
    TORCH_CHECK(s->scalar_type() == at::kFloat && s->is_contiguous() && s->device().is_cpu(),
                "hadamard signs must be a contiguous fp32 CPU tensor");
    B = s->numel();
    TORCH_CHECK(B >= 1 && (B & (B - 1)) == 0, "hadamard block ", B, " is not a power of two");
    signs = s->data_ptr<float>();
    scaled.resize(B);
    for (int64_t i = 0; i < B; ++i) scaled[i] = signs[i] / static_cast<float>(B);
  }

  // One butterfly stage of span h (1, 2, 4) inside an 8-lane vector: lane j gets its partner
  // p = x_{j^h} (a shuffle) plus x_j times +1 (lower lane of the pair) or -1 (upper lane), i.e.
  // the reference's a + b and a - b. Multiplying by +-1 is exact, so the fused multiply-add
  // rounds once, as the add.
  template <int h>
  SDPQ_INLINE static f8 stage_in_vector(f8 v) {
    constexpr float a = 1.0f, b = -1.0f;
    f8 p, pm;
    if (h == 1) {
      p = __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
      pm = f8{a, b, a, b, a, b, a, b};
    } else if (h == 2) {
      p = __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
      pm = f8{a, a, b, b, a, a, b, b};
    } else {
      p = __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
      pm = f8{a, a, a, a, b, b, b, b};
    }
#ifdef __FMA__
    return fma8(v, pm, p);
#else
    return p + (f8)((i8)v ^ ((i8)pm & (i8{} + INT32_MIN)));  // a sign flip, exact
#endif
  }

  SDPQ_INLINE static f8 stages_in_vector(f8 v) {
    return stage_in_vector<4>(stage_in_vector<2>(stage_in_vector<1>(v)));
  }

  // In place, pairs (j, j + h) of every run of 2h become (a + b, a - b) for h = 1, 2, 4, ...
  static void butterflies(float* x, int64_t B) {
    int64_t h = 1;
    if (B >= 8) {
      for (int64_t j = 0; j < B; j += 8) storeu(x + j, stages_in_vector(loadu(x + j)));
      h = 8;
    }
    for (; h < B; h *= 2) {
      for (int64_t j = 0; j < B; j += 2 * h) {
        float* a = x + j;
        float* b = x + j + h;
        if (h >= 8) {
          for (int64_t i = 0; i < h; i += 8) {
            const f8 va = loadu(a + i), vb = loadu(b + i);
            storeu(a + i, va + vb);
            storeu(b + i, va - vb);
          }
          continue;
        }
        for (int64_t i = 0; i < h; ++i) {
          const float va = a[i], vb = b[i];
          a[i] = va + vb;
          b[i] = va - vb;
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
      if (kForward) r[k] = r[k] * loadu(scaled.data() + 8 * k);
      r[k] = stages_in_vector(r[k]);
    }
#pragma GCC unroll 4
    for (int h = 1; h < NV; h *= 2) {
#pragma GCC unroll 16
      for (int j = 0; j < NV; j += 2 * h) {
#pragma GCC unroll 16
        for (int i = 0; i < h; ++i) {
          const f8 a = r[j + i], b = r[j + i + h];
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
    if (dst != src) copy_floats(dst, src, len);
    forward(dst, len);
  }

  void forward(float* x, int64_t len) const {
    if (try_registers<true>(x, x, len)) return;
    for (int64_t b0 = 0; b0 < len; b0 += B) {
      float* blk = x + b0;
      for (int64_t i = 0; i < B; ++i) blk[i] = blk[i] * scaled[i];
      butterflies(blk, B);
    }
  }

  void inverse(float* x, int64_t len) const {
    if (try_registers<false>(x, x, len)) return;
    for (int64_t b0 = 0; b0 < len; b0 += B) {
      float* blk = x + b0;
      butterflies(blk, B);
      for (int64_t i = 0; i < B; ++i) blk[i] = blk[i] * signs[i];
    }
  }
};

}  // namespace sdpq
