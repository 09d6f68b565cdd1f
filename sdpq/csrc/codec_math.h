// Building blocks of the CPU codec kernels (codec.cpp): one tile of fp32 values at a time.
// Every loop is branch-free over its elements so that the compiler vectorizes it (-O3
// -march=native); the arithmetic mirrors sdpq/quant/groupwise.py and hadamard.py exactly.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

namespace sdpq {

// 8-lane vectors (GCC/Clang vector extensions: AVX2 registers here, two SSE/NEON registers
// elsewhere). aligned(4): loads and stores need not be 32-byte aligned.
typedef float f8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t i8 __attribute__((vector_size(32), aligned(4)));
typedef uint32_t u8 __attribute__((vector_size(32), aligned(4)));

inline f8 loadu(const float* p) {
  f8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void storeu(float* p, f8 v) { std::memcpy(p, &v, sizeof(v)); }

// Per-thread fp32 work buffer of one tile.
struct Scratch {
  std::vector<float> data;
  explicit Scratch(int64_t n) : data(static_cast<size_t>(n)) {}
  operator float*() { return data.data(); }
};

// Elements per tile: a multiple of every group / block size involved (all powers of two) and
// about 2048, so a tile and its temporaries stay in L1.
inline int64_t tile_size(int64_t n, int64_t a, int64_t b) {
  const int64_t lcm = std::max(a, b);
  int64_t t = lcm;
  while (t < 2048 && t < n) t *= 2;
  return t;
}

// Tiles per parallel task: at least ~32K elements, so small buffers stay on one thread.
inline int64_t grain(int64_t tile) { return std::max<int64_t>(1, (int64_t{1} << 15) / tile); }

struct Spec {
  int64_t bits, G, qmax, scale_size;
  bool stochastic, fp16;
  Spec(int64_t bits_, int64_t G_, bool stochastic_, bool fp16_)
      : bits(bits_), G(G_), qmax((int64_t{1} << (bits_ - 1)) - 1), scale_size(fp16_ ? 2 : 4),
        stochastic(stochastic_), fp16(fp16_) {
    TORCH_CHECK(bits == 4 || bits == 8, "codec: bits=", bits, "; allowed: 4, 8");
    TORCH_CHECK(G >= 2 && G % 2 == 0, "codec: group_size=", G, "; allowed: an even integer >= 2");
  }
  int64_t groups(int64_t n) const { return (n + G - 1) / G; }
  int64_t code_bytes(int64_t n) const { return groups(n) * G * bits / 8; }
  int64_t wire_bytes(int64_t n) const { return code_bytes(n) + groups(n) * scale_size; }
  int64_t group_code_offset(int64_t gi) const { return gi * G * bits / 8; }
};

// ---------------------------------------------------------------------------- conversions

inline float bf16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, NaN kept (as c10::BFloat16).
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return f != f ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
}

// dst[0:len] = fp32(row[c0:c0+len]) for a row of dtype t.
inline void load_float(const uint8_t* row, at::ScalarType t, int64_t c0, int64_t len, float* dst) {
  switch (t) {
    case at::kFloat:
      std::memcpy(dst, reinterpret_cast<const float*>(row) + c0, len * sizeof(float));
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
      std::memcpy(reinterpret_cast<float*>(row) + c0, src, len * sizeof(float));
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

// ---------------------------------------------------------------------------- Hadamard

// Blockwise randomized Walsh-Hadamard H_B D (forward) and D H_B (inverse), each scaled by
// fp32(1 / sqrt(B)) after the butterflies, as sdpq/quant/hadamard.py.
struct Hadamard {
  int64_t B = 1;
  const float* signs = nullptr;
  float inv_sqrt = 1.0f;
  explicit Hadamard(const std::optional<at::Tensor>& s) {
    if (!s) return;
    TORCH_CHECK(s->scalar_type() == at::kFloat && s->is_contiguous() && s->device().is_cpu(),
                "hadamard signs must be a contiguous fp32 CPU tensor");
    B = s->numel();
    TORCH_CHECK(B >= 1 && (B & (B - 1)) == 0, "hadamard block ", B, " is not a power of two");
    signs = s->data_ptr<float>();
    inv_sqrt = static_cast<float>(1.0 / std::sqrt(static_cast<double>(B)));
  }

  // In place, pairs (j, j + h) of every run of 2h become (a + b, a - b) for h = 1, 2, 4, ...
  // The stages h < 8 run inside one 8-lane vector (a shuffle brings each lane its partner:
  // lane j gets x_j + x_{j+h}, lane j + h gets x_j - x_{j+h}, the reference's operands).
  static void butterflies(float* x, int64_t B) {
    int64_t h = 1;
    if (B >= 8) {
      const i8 m1 = {-1, 0, -1, 0, -1, 0, -1, 0}, m2 = {-1, -1, 0, 0, -1, -1, 0, 0};
      const i8 m4 = {-1, -1, -1, -1, 0, 0, 0, 0};
      for (int64_t j = 0; j < B; j += 8) {
        f8 v = loadu(x + j);
        f8 p = __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
        v = m1 ? v + p : p - v;
        p = __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
        v = m2 ? v + p : p - v;
        p = __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
        v = m4 ? v + p : p - v;
        storeu(x + j, v);
      }
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
          const float s = a[i] + b[i], d = a[i] - b[i];
          a[i] = s;
          b[i] = d;
        }
      }
    }
  }

  void forward(float* x, int64_t len) const {
    for (int64_t b0 = 0; b0 < len; b0 += B) {
      float* blk = x + b0;
      for (int64_t i = 0; i < B; ++i) blk[i] = blk[i] * signs[i];
      butterflies(blk, B);
      for (int64_t i = 0; i < B; ++i) blk[i] = blk[i] * inv_sqrt;
    }
  }

  void inverse(float* x, int64_t len) const {
    for (int64_t b0 = 0; b0 < len; b0 += B) {
      float* blk = x + b0;
      butterflies(blk, B);
      for (int64_t i = 0; i < B; ++i) blk[i] = blk[i] * inv_sqrt * signs[i];
    }
  }
};

// ---------------------------------------------------------------------------- quantization

// Uniform [0, 1) with 24 random bits from a counter-based hash of (seed, position); the
// vector form gives lanes pos + 0..7 the same values as the scalar form.
template <typename U>
inline U hash32(U h) {
  h ^= h >> 16;
  h *= 0x7FEB352Du;
  h ^= h >> 15;
  h *= 0x846CA68Bu;
  h ^= h >> 16;
  return h;
}

inline uint32_t mix(uint32_t seed, uint64_t pos) {
  return (static_cast<uint32_t>(pos >> 32) * 0x85EBCA6Bu) ^ (seed * 0x9E3779B9u);
}

inline float uniform01(uint32_t seed, uint64_t pos) {
  const uint32_t h = hash32<uint32_t>(static_cast<uint32_t>(pos) ^ mix(seed, pos));
  return static_cast<float>(h >> 8) * (1.0f / 16777216.0f);
}

// Lanes 0..7 of positions pos..pos+7 (as the scalar form unless they straddle a multiple of 2^32).
inline f8 uniform01(uint32_t seed, uint64_t pos, u8 lane) {
  const u8 h = hash32<u8>(((u8{} + static_cast<uint32_t>(pos)) + lane) ^ mix(seed, pos));
  return __builtin_convertvector((i8)(h >> 8), f8) * (1.0f / 16777216.0f);
}

inline float round_scale(float s, bool fp16) { return fp16 ? static_cast<float>(at::Half(s)) : s; }

// Quantize len <= G values (the rest of the group is zero padding) and write the group's packed
// codes and its scale. Returns false when the group held inf/NaN (scale non-finite, codes 0).
// Round to nearest even for |y| < 2^22 (the codes' range): adding and subtracting 1.5 * 2^23
// leaves no fraction bits, and round-to-nearest-even is the FPU's rounding.
inline f8 round_even(f8 y) {
  const f8 magic = f8{} + 12582912.0f;
  return (y + magic) - magic;
}

// Codes of one full group (G a multiple of 8) as int32, scale `safe` > 0.
inline void codes_full(const float* v, int64_t G, float safe, float qmax, bool stochastic, uint32_t seed,
                       uint64_t pos0, int32_t* q) {
  const f8 vs = f8{} + safe, hi = f8{} + qmax, lo = f8{} - qmax;
  const u8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
  for (int64_t i = 0; i < G; i += 8) {
    f8 y = loadu(v + i) / vs;
    if (stochastic) {  // floor(y + u) = r - (r > z), r = the rounded z
      const f8 z = y + uniform01(seed, pos0 + i, lane);
      const f8 r = round_even(z);
      y = r > z ? r - 1.0f : r;
    } else {
      y = round_even(y);
    }
    y = y > hi ? hi : y;
    y = y < lo ? lo : y;
    const i8 c = __builtin_convertvector(y, i8);
    std::memcpy(q + i, &c, sizeof(c));
  }
}

// Quantize len <= G values (the rest of the group is zero padding) and write the group's packed
// codes and its scale. Returns false when the group held inf/NaN (scale non-finite, codes 0).
inline bool quantize_group(const float* v, int64_t len, const Spec& sp, uint8_t* codes, uint8_t* scale_dst,
                           uint32_t seed, uint64_t pos0) {
  float amax = 0.0f;
  bool nan = false;
  int64_t i = 0;
  if (len >= 8) {
    f8 m = {};
    i8 isnan = {};
    const i8 absmask = i8{} + 0x7FFFFFFF;
    for (; i + 8 <= len; i += 8) {
      const f8 x = loadu(v + i);
      const f8 a = (f8)((i8)x & absmask);
      m = a > m ? a : m;
      isnan |= x != x;
    }
    for (int k = 0; k < 8; ++k) {
      amax = m[k] > amax ? m[k] : amax;
      nan |= isnan[k] != 0;
    }
  }
  for (; i < len; ++i) {
    const float a = std::fabs(v[i]);
    amax = a > amax ? a : amax;
    nan |= v[i] != v[i];
  }
  float s = round_scale(amax / static_cast<float>(sp.qmax), sp.fp16);
  if (nan) s = std::numeric_limits<float>::quiet_NaN();  // the wire's one NaN pattern (as wire.py)
  const bool finite = std::isfinite(s);
  const float safe = (finite && s > 0.0f) ? s : 1.0f;
  const float qmax = static_cast<float>(sp.qmax);
  std::vector<int32_t> big;
  int32_t small[2048];
  int32_t* q = sp.G <= 2048 ? small : (big.resize(sp.G), big.data());
  if (!finite) {
    std::memset(q, 0, sp.G * sizeof(int32_t));
  } else if (len == sp.G && sp.G % 8 == 0) {
    codes_full(v, sp.G, safe, qmax, sp.stochastic, seed, pos0, q);
  } else {
    for (int64_t k = 0; k < len; ++k) {
      const float y = v[k] / safe;
      const float r = sp.stochastic ? std::floor(y + uniform01(seed, pos0 + k)) : std::nearbyint(y);
      q[k] = static_cast<int32_t>(std::min(std::max(r, -qmax), qmax));
    }
    std::memset(q + len, 0, (sp.G - len) * sizeof(int32_t));  // padding quantizes to 0 either way
  }
  if (sp.bits == 8) {
    for (int64_t k = 0; k < sp.G; ++k) codes[k] = static_cast<uint8_t>(q[k]);
  } else {
    for (int64_t k = 0; k < sp.G / 2; ++k) codes[k] = static_cast<uint8_t>((q[2 * k] & 0x0F) | (q[2 * k + 1] << 4));
  }
  if (sp.fp16) {
    const at::Half h(s);
    std::memcpy(scale_dst, &h, 2);
  } else {
    std::memcpy(scale_dst, &s, 4);
  }
  return finite;
}

// dst[0:len] = decoded values [c0, c0 + len) of one wire row (codes at row, scales at row + cb);
// a non-finite scale decodes its whole group to NaN.
inline void dequantize_span(const uint8_t* row, int64_t cb, const Spec& sp, int64_t c0, int64_t len, float* dst) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  int64_t i = 0;
  while (i < len) {
    const int64_t pos = c0 + i, gi = pos / sp.G;
    const int64_t run = std::min(len - i, (gi + 1) * sp.G - pos);
    float s;
    if (sp.fp16) {
      at::Half h;
      std::memcpy(&h, row + cb + gi * 2, 2);
      s = static_cast<float>(h);
    } else {
      std::memcpy(&s, row + cb + gi * 4, 4);
    }
    float* d = dst + i;
    if (!std::isfinite(s)) {
      for (int64_t j = 0; j < run; ++j) d[j] = nan;
    } else if (sp.bits == 8) {
      const int8_t* c = reinterpret_cast<const int8_t*>(row) + pos;
      for (int64_t j = 0; j < run; ++j) d[j] = static_cast<float>(c[j]) * s;
    } else if (pos % 2 == 0 && run % 2 == 0) {
      const uint8_t* c = row + pos / 2;
      for (int64_t j = 0; j < run / 2; ++j) {
        const int8_t b = static_cast<int8_t>(c[j]);
        d[2 * j] = static_cast<float>(static_cast<int8_t>(b << 4) >> 4) * s;
        d[2 * j + 1] = static_cast<float>(b >> 4) * s;
      }
    } else {
      for (int64_t j = 0; j < run; ++j) {
        const int64_t e = pos + j;
        const int8_t b = static_cast<int8_t>(row[e / 2]);
        const int8_t code = (e % 2 == 0) ? static_cast<int8_t>(b << 4) >> 4 : b >> 4;
        d[j] = static_cast<float>(code) * s;
      }
    }
    i += run;
  }
}

}  // namespace sdpq
