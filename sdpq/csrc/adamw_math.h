// Building blocks of the fused AdamW step (adamw.cpp): scalar helpers that are branch-free
// (selects, bit operations, polynomials) so that the loops calling them vectorize under -O3
// -march=native -- bf16 and FP8 rounding on the fp32 bits, log2 / exp2 within about 1 ulp
// (torch's come from MKL or Sleef, the C library's are scalar calls); the FP8 group codec built
// on them is fp8_groups.h.
// Internal linkage (an unnamed namespace): no calls through the PLT in the shared library, and
// no clash with codec.cpp's helpers, which are built from the same folder.
#pragma once

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "simd.h"  // bf16 conversions

#ifdef __AVX2__
#include <immintrin.h>
#endif

// Every helper is inlined: a call left in a loop would keep it from vectorizing.
#define SDPQ_ADAMW_INLINE inline __attribute__((always_inline))

namespace sdpq {
namespace adamw {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// bits_of / float_of (the bits of a float and back): simd.h.

// c ? a : b as a bitwise blend. GCC (with the default -ftrapping-math) moves float operations
// that only one side of a ?: needs into a branch, and then does not vectorize the loop; with
// both sides combined bitwise every operation stays unconditional.
SDPQ_ADAMW_INLINE uint32_t select(bool c, uint32_t a, uint32_t b) {
  const uint32_t keep = 0u - static_cast<uint32_t>(c);
  return (a & keep) | (b & ~keep);
}

SDPQ_ADAMW_INLINE float select(bool c, float a, float b) { return float_of(select(c, bits_of(a), bits_of(b))); }

// a * b + c rounded once, as torch's vectorized CPU kernels compute lerp, addcmul and add with
// alpha (Vectorized::fmadd). The build uses -ffp-contract=off, so every other a * b + c here
// rounds twice, like the reference's separate tensor operations.
SDPQ_ADAMW_INLINE float fmadd(float a, float b, float c) {
#ifdef __FP_FAST_FMAF
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

// ---------------------------------------------------------------------------- bf16

// bf16_to_float and float_to_bf16 (round to nearest even, NaN kept): simd.h.

// The same rounding without the NaN test, for intermediate values whose NaN is tested later: a
// NaN produced by arithmetic (the default NaN, or one propagated from bf16 or torch tensors) has
// zero low 16 bits and stays a NaN; only payloads 0x7FFF8000-0x7FFFFFFF (sign either) would not.
SDPQ_ADAMW_INLINE float round_bf16_unchecked(float f) {
  const uint32_t u = bits_of(f);
  return float_of(bf16_rounding_add(u) & 0xFFFF0000u);
}

SDPQ_ADAMW_INLINE float round_bf16(float f) { return f != f ? float_of(0x7FC00000u) : round_bf16_unchecked(f); }

// ---------------------------------------------------------------------------- FP8

// The two OCP formats as c10::Float8_e4m3fn / Float8_e5m2 encode them: mantissa bits, exponent
// bias, smallest normal (as fp32 bits), the power of two whose addition rounds a subnormal to
// the format's subnormal step, and the codes (sign excluded) that are not finite.
struct E4M3 {
  static constexpr float kMax = 448.0f;
  static constexpr int kMant = 3, kBias = 7;
  static constexpr uint32_t kMinNormal = 121u << 23;        // 2^-6
  static constexpr float kDenormAdd = 16384.0f;              // 2^14: ulp 2^-9
  static constexpr int kFirstSpecial = 0x7F, kInfCode = -1;  // 0x7F: NaN; no inf
};

struct E5M2 {
  static constexpr float kMax = 57344.0f;
  static constexpr int kMant = 2, kBias = 15;
  static constexpr uint32_t kMinNormal = 113u << 23;           // 2^-14
  static constexpr float kDenormAdd = 128.0f;                   // 2^7: ulp 2^-16
  static constexpr int kFirstSpecial = 0x7C, kInfCode = 0x7C;  // 0x7C: inf, 0x7D-0x7F: NaN
};

// FP8 bits (sign excluded) of a magnitude a in [0, F::kMax], rounded to nearest even: c10's
// conversion written as a select between its subnormal and normal branches, so equal to it on
// these inputs.
template <class F>
SDPQ_ADAMW_INLINE uint32_t fp8_bits(float a) {
  constexpr int kShift = 23 - F::kMant;
  const uint32_t u = bits_of(a);
  const uint32_t sub = bits_of(a + F::kDenormAdd) - bits_of(F::kDenormAdd);
  const uint32_t normal = (u + (static_cast<uint32_t>(F::kBias - 127) << 23) + ((1u << (kShift - 1)) - 1u) +
                           ((u >> kShift) & 1u)) >> kShift;
  // a >= 0: a signed compare orders the bits (AVX2 has no unsigned one)
  return select(static_cast<int32_t>(u) < static_cast<int32_t>(F::kMinNormal), sub, normal);
}

// ---------------------------------------------------------------------------- log2, exp2

// log2(x) for finite x > 0 (subnormals included). x = 2^e m with m in [sqrt(1/2), sqrt(2))
// (subnormal x are scaled by 2^23 first); log2(m) = t P(t^2) with t = (m - 1) / (m + 1),
// |t| <= 0.172, P a minimax polynomial (relative error 7e-10). Within 1 ulp of the correctly
// rounded value except near x = 1 (at most 3 ulp there, an absolute error below 2^-25).
SDPQ_ADAMW_INLINE float log2_positive(float x) {
  const bool tiny = static_cast<int32_t>(bits_of(x)) < 0x00800000;
  const uint32_t u = bits_of(x * select(tiny, 0x1p23f, 1.0f));
  const int32_t e = static_cast<int32_t>(u - 0x3F3504F3u) >> 23;  // 0x3F3504F3: sqrt(1/2)
  const float m = float_of(u - (static_cast<uint32_t>(e) << 23));
  const float t = (m - 1.0f) / (m + 1.0f);
  const float t2 = t * t;
  const float p = t * fmadd(fmadd(fmadd(0x1.ba18fap-2f, t2, 0x1.27471cp-1f), t2, 0x1.ec70e6p-1f), t2,
                            0x1.715476p+1f);
  return static_cast<float>(e - (tiny ? 23 : 0)) + p;
}

// log2(x) for x >= +0, +inf or NaN: log2(0) = -inf, log2(inf) = inf, NaN stays.
SDPQ_ADAMW_INLINE float fast_log2(float x) {
  const int32_t u = static_cast<int32_t>(bits_of(x));
  const float special = select(u == 0, -kInf, x);
  return select((u == 0) | (u >= 0x7F800000), special, log2_positive(x));
}

// 2^x = 2^n 2^f for |x| < 2^22: n = round(x) (nearest even, by the 1.5 * 2^23 shift) is
// returned, f = x - n (exact, |f| <= 1/2) is stored; 2^f by a minimax polynomial (relative
// error 2e-9). The result is within 1 ulp.
SDPQ_ADAMW_INLINE int32_t exp2_split(float x, float& p) {
  constexpr float kShift = 0x1.8p23f;
  const float shifted = x + kShift;
  const float f = x - (shifted - kShift);
  p = fmadd(0x1.41fbbcp-13f, f, 0x1.5f3e54p-10f);
  p = fmadd(p, f, 0x1.3b2d4cp-7f);
  p = fmadd(p, f, 0x1.c6aee8p-5f);
  p = fmadd(p, f, 0x1.ebfbdcp-3f);
  p = fmadd(p, f, 0x1.62e430p-1f);
  p = fmadd(p, f, 1.0f);
  return static_cast<int32_t>(bits_of(shifted) - bits_of(kShift));
}

// 2^x for |x| <= 125, where the result is a normal number: 2^n goes into the exponent bits.
SDPQ_ADAMW_INLINE float exp2_normal(float x) {
  float p;
  const int32_t n = exp2_split(x, p);
  return float_of(bits_of(p) + (static_cast<uint32_t>(n) << 23));
}

// 2^x for any x: 2^n applied as two powers of two so that results in the subnormal range
// round once and those past 2^128 overflow to inf. |x| > 200 (where the shift is no longer
// exact) gives 0 or inf, NaN stays.
SDPQ_ADAMW_INLINE float fast_exp2(float x) {
  float p;
  const uint32_t n = static_cast<uint32_t>(exp2_split(x, p));
  const uint32_t n1 = static_cast<uint32_t>(static_cast<int32_t>(n) >> 1), n2 = n - n1;
  const float r = p * float_of((n1 + 127u) << 23) * float_of((n2 + 127u) << 23);
  const int32_t u = static_cast<int32_t>(bits_of(x)), a = u & 0x7FFFFFFF;
  const float out = select(a > 0x7F800000, x, select(u < 0, 0.0f, kInf));
  return select(a > 0x43480000, out, r);  // 0x43480000: 200
}

}  // namespace
}  // namespace adamw
}  // namespace sdpq
