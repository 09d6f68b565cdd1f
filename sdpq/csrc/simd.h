// Building blocks shared by the CPU codec kernels: 8-lane fp32 vectors, dtype conversions,
// per-thread tiles. Loops are branch-free over their elements so that the compiler vectorizes
// them (-O3 -march=native).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <numeric>
#include <optional>
#include <type_traits>
#include <vector>

#ifdef __FMA__
#include <immintrin.h>
#endif

// Small vector helpers are always inlined: a call would pass 8-lane arguments through memory.
#define SDPQ_INLINE inline __attribute__((always_inline))

namespace sdpq {

// 8-lane vectors (GCC/Clang vector extensions: AVX2 registers here, two SSE/NEON registers
// elsewhere). Note: the register types keep their natural alignment; an under-aligned vector
// type is kept in memory by GCC (4x slower loops), so only loads and stores go through the
// 4-byte-aligned `f8u`: data need not be 32-byte aligned.
typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));
typedef uint32_t u8 __attribute__((vector_size(32)));
typedef float f8u __attribute__((vector_size(32), aligned(4)));
typedef int32_t i8u __attribute__((vector_size(32), aligned(4)));

SDPQ_INLINE f8 loadu(const float* p) { return *reinterpret_cast<const f8u*>(p); }
SDPQ_INLINE void storeu(float* p, f8 v) { *reinterpret_cast<f8u*>(p) = v; }

// Per-thread fp32 work buffer of one tile.
struct Scratch {
  std::vector<float> data;
  explicit Scratch(int64_t n) : data(static_cast<size_t>(n)) {}
  operator float*() { return data.data(); }
};

// Elements per tile: a multiple of every group / block size involved (their lcm: groups may be
// any even size) and at least about 2048, so a tile and its temporaries stay in L1.
inline int64_t tile_size(int64_t n, std::initializer_list<int64_t> sizes) {
  int64_t t = 1;
  for (int64_t s : sizes) t = std::lcm(t, s);
  while (t < 2048 && t < n) t *= 2;
  return t;
}

// Tiles per parallel task: at least ~32K elements, so small buffers stay on one thread.
inline int64_t grain(int64_t tile) { return std::max<int64_t>(1, (int64_t{1} << 15) / tile); }

// The largest lane of m (lanes >= 0, no NaN) and whether any lane of mask is set: three
// shuffle + max steps instead of eight dependent scalar maxes (once per quantization group,
// where this chain delays the group's scale and so every code of it).
SDPQ_INLINE float max_lane(f8 m) {
  f8 t = __builtin_shufflevector(m, m, 4, 5, 6, 7, 0, 1, 2, 3);
  m = m > t ? m : t;
  t = __builtin_shufflevector(m, m, 2, 3, 0, 1, 6, 7, 4, 5);
  m = m > t ? m : t;
  t = __builtin_shufflevector(m, m, 1, 0, 3, 2, 5, 4, 7, 6);
  m = m > t ? m : t;
  return m[0];
}

SDPQ_INLINE bool any_lane(i8 mask) {
  i8 t = mask | __builtin_shufflevector(mask, mask, 4, 5, 6, 7, 0, 1, 2, 3);
  t |= __builtin_shufflevector(t, t, 2, 3, 0, 1, 6, 7, 4, 5);
  t |= __builtin_shufflevector(t, t, 1, 0, 3, 2, 5, 4, 7, 6);
  return t[0] != 0;
}

#ifdef __FMA__
// a * b + c rounded once, on 8 lanes (the build keeps -ffp-contract=off: only where written).
SDPQ_INLINE f8 fma8(f8 a, f8 b, f8 c) { return (f8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
#endif

// ---------------------------------------------------------------------------- conversions

SDPQ_INLINE uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

SDPQ_INLINE float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

SDPQ_INLINE float bf16_to_float(uint16_t b) { return float_of(static_cast<uint32_t>(b) << 16); }

// The fp32 bits u plus the bias that rounds them to nearest even at bit 16: the bf16 value is
// the result's top 16 bits (u: uint32_t, or 8 int32 lanes).
template <typename U>
SDPQ_INLINE U bf16_rounding_add(U u) {
  return u + 0x7FFF + ((u >> 16) & 1);
}

// Round to nearest even, NaN kept (as c10::BFloat16).
SDPQ_INLINE uint16_t float_to_bf16(float f) {
  const uint32_t rounded = bf16_rounding_add(bits_of(f)) >> 16;
  return f != f ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
}

// dst[0:n] = src[0:n] for the kernels' fp32 buffers (they may overlap only if equal).
// Note: not std::memcpy. glibc copies KiB-sized blocks with `rep movsb`, which on AMD Zen 3
// (this project's CPU machines) drops from ~50 to ~3 GB/s when the destination lies 1-31 bytes
// past the source modulo 4 KiB (measured with 32 KiB copies); two tensors' rows or tiles can.
SDPQ_INLINE void copy_floats(float* dst, const float* src, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) storeu(dst + i, loadu(src + i));
  for (; i < n; ++i) dst[i] = src[i];
}

// dst[0:len] = fp32(row[c0:c0+len]) for a row of dtype t.
inline void load_float(const uint8_t* row, at::ScalarType t, int64_t c0, int64_t len, float* dst) {
  switch (t) {
    case at::kFloat:
      copy_floats(dst, reinterpret_cast<const float*>(row) + c0, len);
      return;
    case at::kBFloat16: {
      const uint16_t* s = reinterpret_cast<const uint16_t*>(row) + c0;
      for (int64_t i = 0; i < len; ++i) dst[i] = bf16_to_float(s[i]);
      return;
    }
    case at::kHalf: {
      const at::Half* s = reinterpret_cast<const at::Half*>(row) + c0;
      for (int64_t i = 0; i < len; ++i) dst[i] = static_cast<float>(s[i]);
      return;
    }
    case at::kDouble: {
      const double* s = reinterpret_cast<const double*>(row) + c0;
      for (int64_t i = 0; i < len; ++i) dst[i] = static_cast<float>(s[i]);
      return;
    }
    default:
      TORCH_CHECK(false, "codec: dtype ", t, " not supported; allowed: float32, bfloat16, float16, float64");
  }
}

// row[c0:c0+len] = src[0:len] converted to dtype t (round to nearest even).
inline void store_float(const float* src, int64_t len, at::ScalarType t, uint8_t* row, int64_t c0) {
  switch (t) {
    case at::kFloat:
      copy_floats(reinterpret_cast<float*>(row) + c0, src, len);
      return;
    case at::kBFloat16: {
      uint16_t* d = reinterpret_cast<uint16_t*>(row) + c0;
      for (int64_t i = 0; i < len; ++i) d[i] = float_to_bf16(src[i]);
      return;
    }
    case at::kHalf: {
      at::Half* d = reinterpret_cast<at::Half*>(row) + c0;
      for (int64_t i = 0; i < len; ++i) d[i] = at::Half(src[i]);
      return;
    }
    case at::kDouble: {
      double* d = reinterpret_cast<double*>(row) + c0;
      for (int64_t i = 0; i < len; ++i) d[i] = src[i];
      return;
    }
    default:
      TORCH_CHECK(false, "codec: dtype ", t, " not supported; allowed: float32, bfloat16, float16, float64");
  }
}

// dst[0:len] = a[0:len] - b[0:len] (fp32).
inline void subtract(const float* a, const float* b, int64_t len, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) storeu(dst + i, loadu(a + i) - loadu(b + i));
  for (; i < len; ++i) dst[i] = a[i] - b[i];
}

// f(std::integral_constant<int, NV>) for a block of NV = size / 8 vectors that fits in the 16
// vector registers (size 8..128, a power of two); false (f not called) for any other size.
template <typename F>
inline bool with_block(int64_t size, F&& f) {
  switch (size) {
    case 8: return f(std::integral_constant<int, 1>{});
    case 16: return f(std::integral_constant<int, 2>{});
    case 32: return f(std::integral_constant<int, 4>{});
    case 64: return f(std::integral_constant<int, 8>{});
    case 128: return f(std::integral_constant<int, 16>{});
    default: return false;
  }
}

// How a computed span lands in its destination d: d = v, d = d + v, or d = (d + v) + extra
// (the reference's order of additions: the running sum first, the NaN poison last).
enum class Into { kStore, kAdd, kAddExtra };

template <Into kMode>
SDPQ_INLINE f8 into(f8 d, f8 v, f8 extra) {
  if (kMode == Into::kStore) return v;
  if (kMode == Into::kAdd) return d + v;
  return (d + v) + extra;
}

template <Into kMode>
SDPQ_INLINE float into(float d, float v, float extra) {
  if (kMode == Into::kStore) return v;
  if (kMode == Into::kAdd) return d + v;
  return (d + v) + extra;
}

// f(std::integral_constant<Into, mode>) with the mode as a compile-time constant.
template <typename F>
SDPQ_INLINE void with_into(Into mode, F&& f) {
  switch (mode) {
    case Into::kStore: return f(std::integral_constant<Into, Into::kStore>{});
    case Into::kAdd: return f(std::integral_constant<Into, Into::kAdd>{});
    case Into::kAddExtra: return f(std::integral_constant<Into, Into::kAddExtra>{});
  }
}

// d[0:len] = into(d, src, extra) elementwise.
template <Into kMode>
inline void combine(float* d, const float* src, int64_t len, float extra) {
  const f8 ve = f8{} + extra;
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) storeu(d + i, into<kMode>(loadu(d + i), loadu(src + i), ve));
  for (; i < len; ++i) d[i] = into<kMode>(d[i], src[i], extra);
}

}  // namespace sdpq
