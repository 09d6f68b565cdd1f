// Groupwise absmax quantization of fp32 tiles to 2/3/4/8-bit codes and back, as
// sdpq/quant/groupwise.py and wire.py, operation for operation.
//
// Note: codes are a little-endian bit stream, element e in bits [e * bits, (e + 1) * bits) of a
// row's code region (two's complement). 8 elements always fill exactly `bits` bytes, so every
// 8-element vector starts on a byte: at 3 bits, 8 codes are one 24-bit word in 3 bytes.
#pragma once

#include "hadamard.h"
#include "simd.h"

#ifdef __AVX__
#include <immintrin.h>
#endif

namespace sdpq {

struct Spec {
  int64_t bits, G, qmax, scale_size;
  bool stochastic, bf16;  // bf16: scales travel as bf16 (rounded up), else fp32
  int g_shift;            // log2(G) when G is a power of two, else -1
  float scale_cap;        // the largest bf16 scale whose qmax multiple is finite (as groupwise.py)
  Spec(int64_t bits_, int64_t G_, bool stochastic_, bool bf16_)
      : bits(bits_), G(G_), qmax((int64_t{1} << (bits_ - 1)) - 1), scale_size(bf16_ ? 2 : 4),
        stochastic(stochastic_), bf16(bf16_), g_shift((G_ & (G_ - 1)) == 0 ? __builtin_ctzll(G_) : -1),
        scale_cap(float_of(bits_of(std::numeric_limits<float>::max() / static_cast<float>(qmax)) & 0xFFFF0000u)) {
    TORCH_CHECK(bits == 2 || bits == 3 || bits == 4 || bits == 8, "codec: bits=", bits, "; allowed: 2, 3, 4, 8");
    TORCH_CHECK(G >= 2 && G % 2 == 0 && (bits >= 4 || G % 8 == 0), "codec: group_size=", G,
                "; allowed: an even integer >= 2 (a multiple of 8 at 2 or 3 bits)");
  }
  // The group of element e. Note: a 64-bit division costs ~40 cycles on the CPUs measured (it
  // was 40% of the reduce kernels' decode), a shift one; group sizes are powers of two in practice.
  SDPQ_INLINE int64_t group_of(int64_t e) const { return g_shift >= 0 ? e >> g_shift : e / G; }
  int64_t groups(int64_t n) const { return (n + G - 1) / G; }
  int64_t code_bytes(int64_t n) const { return groups(n) * G * bits / 8; }
  int64_t wire_bytes(int64_t n) const { return code_bytes(n) + groups(n) * scale_size; }
  int64_t group_code_offset(int64_t gi) const { return gi * G * bits / 8; }
};

// Uniform [0, 1) with 24 random bits from a counter-based hash of (seed, position); the
// vector form gives lanes pos + 0..7 the same values as the scalar form.
template <typename U>
SDPQ_INLINE U hash32(U h) {
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
SDPQ_INLINE f8 uniform01(uint32_t seed, uint64_t pos, u8 lane) {
  const u8 h = hash32<u8>(((u8{} + static_cast<uint32_t>(pos)) + lane) ^ mix(seed, pos));
  return __builtin_convertvector((i8)(h >> 8), f8) * (1.0f / 16777216.0f);
}

// The smallest bf16 value >= s (s >= 0; NaN is handled by the caller), as fp32: bf16 is the top
// half of an fp32, and adding 0xFFFF carries into it unless the low half is already zero. A
// finite s is capped at `cap` so that qmax * scale stays finite (sdpq/quant/groupwise.py's Note).
inline float round_scale(float s, bool bf16, float cap) {
  if (!bf16) return s;
  const float up = float_of((bits_of(s) + 0xFFFFu) & 0xFFFF0000u);
  return (std::isfinite(s) && up > cap) ? cap : up;
}

// Round to nearest even for |y| < 2^22 (the codes' range): adding and subtracting 1.5 * 2^23
// leaves no fraction bits, and round-to-nearest-even is the FPU's rounding.
SDPQ_INLINE f8 round_even(f8 y) {
  const f8 magic = f8{} + 12582912.0f;
  return (y + magic) - magic;
}

typedef int32_t i4 __attribute__((vector_size(16)));
typedef uint8_t b4 __attribute__((vector_size(4)));
typedef uint8_t b8 __attribute__((vector_size(8)));
typedef uint8_t b32 __attribute__((vector_size(32)));

// Integer codes (int32 lanes) of 8 values x at positions pos..pos+7 of the row: x / scale
// rounded (to nearest even, or stochastically) and clamped to [-qmax, qmax].
template <bool stochastic>
SDPQ_INLINE i8 quantize_vector(f8 x, f8 scale, float qmax, uint32_t seed, uint64_t pos) {
  const u8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
  const f8 hi = f8{} + qmax, lo = f8{} - qmax;
  f8 y = x / scale;
#ifdef __AVX__
  // Note: clamping to the integers +-qmax commutes with rounding, so the rounding can be the
  // conversion's own: vcvtps2dq rounds to nearest even (the default MXCSR mode, which the
  // 1.5 * 2^23 trick of round_even relies on too), vroundps floors exactly.
  if (stochastic) y = (f8)_mm256_floor_ps((__m256)(y + uniform01(seed, pos, lane)));
  y = y > hi ? hi : y;
  y = y < lo ? lo : y;
  return stochastic ? __builtin_convertvector(y, i8) : (i8)_mm256_cvtps_epi32((__m256)y);
#else
  if (stochastic) {  // floor(y + u) = r - (r > z), r = the rounded z
    const f8 z = y + uniform01(seed, pos, lane);
    const f8 r = round_even(z);
    y = r > z ? r - 1.0f : r;
  } else {
    y = round_even(y);
  }
  y = y > hi ? hi : y;
  y = y < lo ? lo : y;
  return __builtin_convertvector(y, i8);
#endif
}

// The 8 codes c packed into codes: `bits` bytes (8 bits: one byte each; 4 bits: element 2k in
// the low nibble of byte k; 2 and 3 bits: the fields of one little-endian word). Byte 0 of each lane is the code's two's-complement byte (little
// endian); byte shuffles pick them (a converting cast would be split into scalar moves by GCC).
template <int bits>
SDPQ_INLINE void pack_codes(i8 c, uint8_t* codes) {
  if constexpr (bits == 2 || bits == 3) {  // fields shifted into one 32-bit word (8 x 3 = 24 bits at most)
    const u8 f = ((u8)c & ((1u << bits) - 1)) << (u8){0, bits, 2 * bits, 3 * bits, 4 * bits, 5 * bits, 6 * bits, 7 * bits};
    const uint32_t w = f[0] | f[1] | f[2] | f[3] | f[4] | f[5] | f[6] | f[7];
    std::memcpy(codes, &w, bits);  // little endian: the low `bits` bytes
  } else if constexpr (bits == 8) {
    const b32 bytes = (b32)c;
    const b8 packed = __builtin_shufflevector(bytes, bytes, 0, 4, 8, 12, 16, 20, 24, 28);
    std::memcpy(codes, &packed, 8);
  } else {
    const i8 pairs = (c & 0x0F) | (__builtin_shufflevector(c, c, 1, 0, 3, 2, 5, 4, 7, 6) << 4);
    const b32 bytes = (b32)pairs;
    const b4 packed = __builtin_shufflevector(bytes, bytes, 0, 8, 16, 24);
    std::memcpy(codes, &packed, 4);
  }
}

// The 16 codes a, b (in [-127, 127]) packed as pack_codes(a) then pack_codes(b). Note: AVX2's
// saturating packs narrow two vectors at once (7 instructions for 16 codes instead of 18).
template <int bits>
SDPQ_INLINE void pack_codes2(i8 a, i8 b, uint8_t* codes) {
  if constexpr (bits == 2 || bits == 3) {
    pack_codes<bits>(a, codes);
    pack_codes<bits>(b, codes + bits);
    return;
  }
#ifdef __AVX2__
  const __m256i w = _mm256_packs_epi32((__m256i)a, (__m256i)b);  // per 128-bit half: a0-3 b0-3 | a4-7 b4-7
  const __m256i s8 = _mm256_packs_epi16(w, w);                    // dwords: a0-3 b0-3 a0-3 b0-3 | a4-7 b4-7 ..
  const __m128i v = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(s8, _mm256_setr_epi32(0, 4, 1, 5, 0, 0, 0, 0)));
  if (bits == 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes), v);  // a0..a7 b0..b7
  } else {  // byte k = low nibble of code 2k + 16 * low nibble of code 2k + 1
    const __m128i pairs = _mm_maddubs_epi16(_mm_and_si128(v, _mm_set1_epi8(0x0F)), _mm_set1_epi16(0x1001));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes), _mm_packus_epi16(pairs, pairs));
  }
#else
  pack_codes<bits>(a, codes);
  pack_codes<bits>(b, codes + bits);
#endif
}

template <int bits, bool stochastic>
SDPQ_INLINE void encode_vector(f8 x, f8 scale, float qmax, uint32_t seed, uint64_t pos, uint8_t* codes) {
  pack_codes<bits>(quantize_vector<stochastic>(x, scale, qmax, seed, pos), codes);
}

// Codes of the n vectors load(k) of a group (positions pos0 + 8k): two vectors at a time.
// n: an int, or a std::integral_constant for loops unrolled over registers.
template <int bits, bool stochastic, typename N, typename Load>
SDPQ_INLINE void encode_vectors(N n, Load&& load, f8 scale, float qmax, uint32_t seed, uint64_t pos0,
                                uint8_t* codes) {
  int k = 0;
#pragma GCC unroll 8
  for (; k + 2 <= n; k += 2) {
    const i8 a = quantize_vector<stochastic>(load(k), scale, qmax, seed, pos0 + 8 * k);
    const i8 b = quantize_vector<stochastic>(load(k + 1), scale, qmax, seed, pos0 + 8 * k + 8);
    pack_codes2<bits>(a, b, codes + k * bits);
  }
  if (k < n) encode_vector<bits, stochastic>(load(k), scale, qmax, seed, pos0 + 8 * k, codes + k * bits);
}

// f(bits) with the code width as a compile-time constant.
template <typename F>
SDPQ_INLINE void with_bits(int64_t bits, F&& f) {
  switch (bits) {
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

// f(bits, stochastic) with both as compile-time constants (the encoding loops are
// specialized: no per-vector branches on the format).
template <typename F>
SDPQ_INLINE void with_format(const Spec& sp, F&& f) {
  with_bits(sp.bits, [&](auto bits) __attribute__((always_inline)) {
    sp.stochastic ? f(bits, std::true_type{}) : f(bits, std::false_type{});
  });
}

// The code of element e of a code region, and its setting (the region zeroed first): a field
// may straddle two bytes at 3 bits.
SDPQ_INLINE int8_t get_code(const uint8_t* codes, int64_t e, int64_t bits) {
  if (bits == 8) return static_cast<int8_t>(codes[e]);
  const int64_t bit = e * bits, byte = bit >> 3, shift = bit & 7;
  uint32_t w = codes[byte];
  if (shift + bits > 8) w |= static_cast<uint32_t>(codes[byte + 1]) << 8;
  const int32_t field = static_cast<int32_t>((w >> shift) << (32 - bits));
  return static_cast<int8_t>(field >> (32 - bits));  // sign-extended
}

SDPQ_INLINE void set_code(uint8_t* codes, int64_t e, int64_t bits, int32_t q) {
  if (bits == 8) {
    codes[e] = static_cast<uint8_t>(q);
    return;
  }
  const int64_t bit = e * bits, byte = bit >> 3, shift = bit & 7;
  const uint32_t w = (static_cast<uint32_t>(q) & ((1u << bits) - 1)) << shift;
  codes[byte] |= static_cast<uint8_t>(w);
  if (shift + bits > 8) codes[byte + 1] |= static_cast<uint8_t>(w >> 8);
}

// A group's scale from its absmax: fp32(amax / qmax), rounded to the wire dtype; NaN when the
// group held a NaN. `safe` is what values are divided by (1 for zero and non-finite scales).
struct GroupScale {
  float s, safe;
  bool finite;
  SDPQ_INLINE GroupScale(float amax, bool nan, const Spec& sp) {
    s = round_scale(amax / static_cast<float>(sp.qmax), sp.bf16, sp.scale_cap);
    if (nan) s = std::numeric_limits<float>::quiet_NaN();  // the wire's one NaN pattern (as wire.py)
    finite = std::isfinite(s);
    safe = (finite && s > 0.0f) ? s : 1.0f;
  }
  void write(const Spec& sp, uint8_t* dst) const {
    if (sp.bf16) {
      const uint16_t h = static_cast<uint16_t>(bits_of(s) >> 16);  // exact: s is a bf16 value
      std::memcpy(dst, &h, 2);
    } else {
      std::memcpy(dst, &s, 4);
    }
  }
};

// Quantize len <= G values (the rest of the group is zero padding) and write the group's packed
// codes and its scale. Returns false when the group held inf/NaN (scale non-finite, codes 0).
inline bool quantize_group(const float* v, int64_t len, const Spec& sp, uint8_t* codes, uint8_t* scale_dst,
                           uint32_t seed, uint64_t pos0) {
  float amax = 0.0f;
  bool nan = false;
  int64_t i = 0;
  if (len >= 8) {
    // Note: four running maxima, not one: a chain through every vector of a 2048-value group
    // is 256 dependent steps. The maximum does not depend on the order (NaN is flagged apart).
    f8 m[4] = {};
    i8 isnan = {};
    const i8 absmask = i8{} + 0x7FFFFFFF;
    for (; i + 32 <= len; i += 32) {
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const f8 x = loadu(v + i + 8 * j);
        const f8 a = (f8)((i8)x & absmask);
        m[j] = a > m[j] ? a : m[j];
        isnan |= x != x;
      }
    }
    for (; i + 8 <= len; i += 8) {
      const f8 x = loadu(v + i);
      const f8 a = (f8)((i8)x & absmask);
      m[0] = a > m[0] ? a : m[0];
      isnan |= x != x;
    }
    m[0] = m[1] > m[0] ? m[1] : m[0];
    m[2] = m[3] > m[2] ? m[3] : m[2];
    amax = max_lane(m[2] > m[0] ? m[2] : m[0]);
    nan = any_lane(isnan);
  }
  for (; i < len; ++i) {
    const float a = std::fabs(v[i]);
    amax = a > amax ? a : amax;
    nan |= v[i] != v[i];
  }
  const GroupScale gs(amax, nan, sp);
  const float qmax = static_cast<float>(sp.qmax);
  if (!gs.finite) {
    std::memset(codes, 0, sp.G * sp.bits / 8);
  } else if (len == sp.G && sp.G % 8 == 0) {
    const f8 scale = f8{} + gs.safe;
    with_format(sp, [&](auto bits, auto stochastic) {
      encode_vectors<bits, stochastic>(static_cast<int>(sp.G / 8), [&](int k) { return loadu(v + 8 * k); }, scale,
                                       qmax, seed, pos0, codes);
    });
  } else {  // a short last group: scalar, zero padding quantizes to 0 either way
    std::memset(codes, 0, sp.G * sp.bits / 8);
    for (int64_t k = 0; k < len; ++k) {
      const float y = v[k] / gs.safe;
      const float r = sp.stochastic ? std::floor(y + uniform01(seed, pos0 + k)) : std::nearbyint(y);
      set_code(codes, k, sp.bits, static_cast<int32_t>(std::min(std::max(r, -qmax), qmax)));
    }
  }
  gs.write(sp, scale_dst);
  return gs.finite;
}

// Decoded codes of 8 elements starting at an element e with e % 8 == 0: the `bits` bytes at
// `codes` (8 bits: one byte each; 4 bits: element 2k in the low nibble of byte k; 2 and 3 bits:
// the fields of one little-endian word).
SDPQ_INLINE f8 decode_vector(const uint8_t* codes, int64_t bits, f8 scale) {
  typedef int8_t c8 __attribute__((vector_size(8)));
  i8 c;
  if (bits == 8) {
#ifdef __AVX2__  // GCC splits the generic int8 -> int32 conversion into scalar moves
    c = (i8)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
#else
    c8 b;
    std::memcpy(&b, codes, 8);
    c = __builtin_convertvector(b, i8);
#endif
  } else if (bits == 2 || bits == 3) {  // the `bits` bytes as one word, each lane's field to the top
    uint32_t w = 0;
    std::memcpy(&w, codes, bits);
    const uint32_t b = static_cast<uint32_t>(bits);
    const u8 up = (u8){32 - b, 32 - 2 * b, 32 - 3 * b, 32 - 4 * b, 32 - 5 * b, 32 - 6 * b, 32 - 7 * b, 32 - 8 * b};
    c = (i8)((u8{} + w) << up) >> static_cast<int32_t>(32 - b);  // lane j: field j at the top, then down
  } else {  // each byte in two lanes, then the lane's nibble moved to the top and sign-extended down
    uint32_t w;
    std::memcpy(&w, codes, 4);
    const i8 bytes = (i8)(u8{} + w) >> (i8){0, 0, 8, 8, 16, 16, 24, 24};
    const i8 up = {28, 24, 28, 24, 28, 24, 28, 24};
    c = (bytes << up) >> 28;
  }
  return __builtin_convertvector(c, f8) * scale;
}

// Scale of group gi of a wire row (scales at row + cb); NaN when not finite: every value of
// such a group decodes to code * NaN = NaN.
SDPQ_INLINE float read_scale(const uint8_t* row, int64_t cb, const Spec& sp, int64_t gi) {
  float s;
  if (sp.bf16) {
    uint16_t h;
    std::memcpy(&h, row + cb + gi * 2, 2);
    s = bf16_to_float(h);
  } else {
    std::memcpy(&s, row + cb + gi * 4, 4);
  }
  return std::isfinite(s) ? s : std::numeric_limits<float>::quiet_NaN();
}

// dst[0:len] = into(dst, decoded values [c0, c0 + len) of one wire row) (codes at row, scales
// at row + cb); a non-finite scale decodes its whole group to NaN.
template <Into kMode>
inline void dequantize_span(const uint8_t* row, int64_t cb, const Spec& sp, int64_t c0, int64_t len, float* dst,
                            float extra = 0.0f) {
  const f8 ve = f8{} + extra;
  int64_t i = 0;
  while (i < len) {
    const int64_t pos = c0 + i, gi = sp.group_of(pos);
    const int64_t run = std::min(len - i, (gi + 1) * sp.G - pos);
    float s = read_scale(row, cb, sp, gi);
    float* d = dst + i;
    int64_t j = 0;
    if (s == s && pos % 8 == 0) {
      const f8 vs = f8{} + s;
      for (; j + 8 <= run; j += 8)
        storeu(d + j, into<kMode>(loadu(d + j), decode_vector(row + (pos + j) * sp.bits / 8, sp.bits, vs), ve));
    }
    for (; j < run; ++j) {
      const int8_t code = get_code(row, pos + j, sp.bits);
      d[j] = into<kMode>(d[j], static_cast<float>(code) * s, extra);
    }
    i += run;
  }
}

}  // namespace sdpq
