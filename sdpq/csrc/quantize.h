// Groupwise absmax quantization of fp32 tiles to 4/8-bit codes and back, as
// sdpq/quant/groupwise.py and wire.py, operation for operation.
#pragma once

#include "hadamard.h"
#include "simd.h"

namespace sdpq {

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

typedef int32_t i4 __attribute__((vector_size(16)));
typedef uint8_t b4 __attribute__((vector_size(4)));
typedef uint8_t b8 __attribute__((vector_size(8)));
typedef uint8_t b32 __attribute__((vector_size(32)));

// Packed codes of one full group (G a multiple of 8), scale `safe` > 0: 8 values per step,
// rounded, clamped and packed in registers (8 bytes at 8 bits, 4 bytes at 4 bits).
inline void codes_full(const float* v, int64_t G, int64_t bits, float safe, float qmax, bool stochastic,
                       uint32_t seed, uint64_t pos0, uint8_t* codes) {
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
    // Byte 0 of each lane is the code's two's-complement byte (little endian); byte shuffles
    // pick them (a converting cast would be split into scalar moves by GCC).
    if (bits == 8) {
      const b32 bytes = (b32)c;
      const b8 packed = __builtin_shufflevector(bytes, bytes, 0, 4, 8, 12, 16, 20, 24, 28);
      std::memcpy(codes + i, &packed, 8);
    } else {  // element 2k in the low nibble of byte k
      const i8 pairs = (c & 0x0F) | (__builtin_shufflevector(c, c, 1, 0, 3, 2, 5, 4, 7, 6) << 4);
      const b32 bytes = (b32)pairs;
      const b4 packed = __builtin_shufflevector(bytes, bytes, 0, 8, 16, 24);
      std::memcpy(codes + i / 2, &packed, 4);
    }
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
  if (!finite) {
    std::memset(codes, 0, sp.G * sp.bits / 8);
  } else if (len == sp.G && sp.G % 8 == 0) {
    codes_full(v, sp.G, sp.bits, safe, qmax, sp.stochastic, seed, pos0, codes);
  } else {  // a short last group: scalar, zero padding quantizes to 0 either way
    std::memset(codes, 0, sp.G * sp.bits / 8);
    for (int64_t k = 0; k < len; ++k) {
      const float y = v[k] / safe;
      const float r = sp.stochastic ? std::floor(y + uniform01(seed, pos0 + k)) : std::nearbyint(y);
      const auto q = static_cast<uint8_t>(static_cast<int32_t>(std::min(std::max(r, -qmax), qmax)));
      if (sp.bits == 8) {
        codes[k] = q;
      } else {
        codes[k / 2] |= static_cast<uint8_t>(k % 2 == 0 ? (q & 0x0F) : (q << 4));
      }
    }
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
