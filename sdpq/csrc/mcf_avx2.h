// The MCF weight update of adamw.cpp (mcf_weights) with AVX2, Q vectors in lock-step: the same
// IEEE operations in the same order, so bitwise the scalar loop's results.
//
// Note: each element's chain (one or two divisions, the three bf16 roundings of Collage's Grow) is
// ~60 cycles long. Written one vector after the other, as the compiler vectorizes the scalar
// loop, the out-of-order window holds about two chains and the loop is latency-bound; advancing
// Q independent vectors one operation at a time keeps Q chains in flight.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)  // the scalar loop's fmadd is fused on such CPUs only
#include <immintrin.h>

#include "simd.h"

namespace sdpq {
namespace adamw {
namespace {

// bf16 bits (8 uint16) -> fp32 lanes, and two fp32 vectors' top halves -> 16 uint16.
SDPQ_INLINE f8 load_bf16x8(const uint16_t* p) {
  return (f8)(((i8)_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))) << 16);
}

SDPQ_INLINE void store_bf16x16(uint16_t* p, i8 a, i8 b) {  // a, b: bf16 bits in the low 16 bits of each lane
  const __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32((__m256i)a, (__m256i)b), 0xD8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), w);
}

// round_bf16_unchecked / round_bf16 / float_to_bf16 of adamw_math.h and simd.h, on 8 lanes.
SDPQ_INLINE i8 round_bits(f8 f) {
  return bf16_rounding_add((i8)f) & static_cast<int32_t>(0xFFFF0000u);
}

SDPQ_INLINE i8 round_bits_nan(f8 f) { return f != f ? i8{} + 0x7FC00000 : round_bits(f); }

// The step's scalars: kOneDivision, step = (m neg_step) / (sqrt(v) + eps) with bc2 folded into
// eps and neg_step by the caller (bc2 unused); else step = (m / (v / bc2 + eps)) neg_step.
struct WeightScalars {
  float bc2, eps, neg_step, neg_lr_wd;
};

// Elements [0, n - n % (8 Q)) of mcf_weights<kDecay, kOneDivision>; returns how many.
template <bool kDecay, bool kOneDivision, int Q = 8>
int64_t mcf_weights_avx2(uint16_t* w, uint16_t* lo, const float* m, const float* sq, int64_t n,
                         const WeightScalars& c) {
  static_assert(Q % 2 == 0, "bf16 stores take two vectors");
  int64_t i = 0;
  for (; i + 8 * Q <= n; i += 8 * Q) {
    f8 h[Q], l[Q], d[Q], s[Q], l1[Q];
    i8 hi[Q], out_lo[Q];
#define SDPQ_EACH _Pragma("GCC unroll 8") for (int q = 0; q < Q; ++q)
    if (kOneDivision) {
      SDPQ_EACH d[q] = (f8)_mm256_sqrt_ps((__m256)loadu(sq + i + 8 * q)) + c.eps;
      SDPQ_EACH d[q] = (loadu(m + i + 8 * q) * c.neg_step) / d[q];
    } else {
      SDPQ_EACH d[q] = loadu(sq + i + 8 * q) / c.bc2 + c.eps;
      SDPQ_EACH d[q] = (loadu(m + i + 8 * q) / d[q]) * c.neg_step;
    }
    SDPQ_EACH {
      h[q] = load_bf16x8(w + i + 8 * q);
      l[q] = load_bf16x8(lo + i + 8 * q);
    }
    if (kDecay) {
      SDPQ_EACH d[q] = fma8(h[q] + l[q], f8{} + c.neg_lr_wd, d[q]);
    }
    SDPQ_EACH s[q] = (f8)round_bits(h[q] + d[q]);
    SDPQ_EACH l1[q] = (f8)round_bits(l[q] + (d[q] - (s[q] - h[q])));
    SDPQ_EACH hi[q] = round_bits_nan(s[q] + l1[q]);
    SDPQ_EACH {
      const f8 rest = l1[q] - ((f8)hi[q] - s[q]);
      out_lo[q] = rest != rest ? i8{} + 0x7FC0 : (i8)((u8)round_bits(rest) >> 16);
      hi[q] = (i8)((u8)hi[q] >> 16);
    }
#undef SDPQ_EACH
    for (int q = 0; q < Q; q += 2) {
      store_bf16x16(w + i + 8 * q, hi[q], hi[q + 1]);
      store_bf16x16(lo + i + 8 * q, out_lo[q], out_lo[q + 1]);
    }
  }
  return i;
}

}  // namespace
}  // namespace adamw
}  // namespace sdpq
#endif
