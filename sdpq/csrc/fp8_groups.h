// The FP8 group codec of sdpq/quant/fp8.py (COAT expansion) for one row of groups at a time, as
// the fused AdamW step (adamw.cpp) uses it: decoding by per-group tables, the group ranges and
// expansion metadata, and encoding; AVX2 paths with the scalar ones (adamw_math.h helpers) for
// the remainders and other CPUs.
#pragma once

#include "adamw_math.h"

namespace sdpq {
namespace adamw {
namespace {

template <class F>
const float* log2_table() {  // log2|c| for every code (the sign is the code's bit 7)
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) {
      using T = std::conditional_t<std::is_same_v<F, E4M3>, c10::Float8_e4m3fn, c10::Float8_e5m2>;
      t[c] = std::log2(std::fabs(static_cast<float>(T(static_cast<uint8_t>(c), T::from_bits()))));
    }
    return t;
  }();
  return table.data();
}

// Per group of a row: inv_k = 1 / k and bias = log2 s / k + log2 gm, NaN for a group whose
// scale is not finite (it held inf/nan: it decodes to NaN everywhere, zeros included).
void decode_constants(const float* s, const float* k, const float* gm, int64_t groups, float* __restrict inv_k,
                      float* __restrict bias) {
  for (int64_t j = 0; j < groups; ++j) {
    const float ik = 1.0f / k[j];
    const bool finite = (bits_of(s[j]) & 0x7FFFFFFFu) < 0x7F800000u;
    inv_k[j] = ik;
    bias[j] = select(finite, fast_log2(s[j]) * ik + fast_log2(gm[j]), kNaN);
  }
}

// y = sign(c) |c s|^(1/k) gm = sign(c) exp2(log2|c| / k + bias), as dequantize_fp8.
template <class F>
void decode_elementwise(const uint8_t* c, int64_t n, float inv_k, float bias, float* y) {
  const float* table = log2_table<F>();
#pragma GCC unroll 8
  for (int64_t i = 0; i < n; ++i) y[i] = table[c[i]];  // a gather: not vectorized, but short
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t sign = static_cast<uint32_t>(c[i] & 0x80u) << 24;
    y[i] = float_of(bits_of(fast_exp2(y[i] * inv_k + bias)) | sign);
  }
}

#ifdef __AVX2__
template <class F>
struct FieldLog2 {  // log2(1 + m 2^-M) and log2(m 2^(1 - bias - M)) for each mantissa field m
  float normal[8], sub[8];
  FieldLog2() {
    for (int i = 0; i < 8; ++i) {
      const int m = i & ((1 << F::kMant) - 1);
      normal[i] = static_cast<float>(std::log2(1.0 + std::ldexp(m, -F::kMant)));
      sub[i] = static_cast<float>(std::log2(std::ldexp(m, 1 - F::kBias - F::kMant)));
    }
  }
};

// The same decoding with the exponent and mantissa fields apart: code (e, m) decodes to
// 2^((e - bias_F) / k + bias) 2^(log2(1 + m 2^-M) / k), or 2^(log2(m 2^(1 - bias_F - M)) / k +
// bias) for e = 0. A group's 2^(7-M) + 16 factors (DecodeTable) fill vector registers and every
// element is looked up with vpermps: no exp2 and no gather per element (Zen 3 and older run
// gathers no faster than scalar loads). The exponents round differently from exp2(log2|c| / k +
// bias), by about |log2 y| ulp like the reference's own; the product adds ~2 ulp while every
// factor is a normal number, so groups whose factors may not be (DecodeTable::build says which)
// are left to decode_elementwise.
template <class F>
struct DecodeTable {
  static constexpr int kExponents = 1 << (7 - F::kMant);
  alignas(32) float e[kExponents], m[8], s[8];

  // Fills the factors; false when the group must be decoded elementwise: a non-finite bias, a
  // smallest factor s[1] below 2^-126, or a largest exponent factor past 2^125.
  // Note: the factors a group uses all lie between those two, so they are normal numbers and
  // exp2_normal (2^n placed in the exponent bits) gives fast_exp2's values at fewer operations.
  // e[0] goes unused (e = 0 codes take s) and s[0], the zero code's, is set apart.
  // s[1] >= 2^-126 is tested on its exponent, x = sub[1] / k + bias >= -126: exp2 of x rounds
  // x to n + f with f in [-1/2, 1/2] and scales 2^n by a polynomial that is 1 at f = 0 and
  // increasing, so it is below 2^-126 exactly when x is below -126 (a scalar exp2 less per group:
  // the test had cost a quarter of the build).
  SDPQ_ADAMW_INLINE bool build(float inv_k, float bias) {
    static const FieldLog2<F> fields;
    const float top = static_cast<float>(kExponents - 1 - F::kBias) * inv_k + bias;
    if (!(std::isfinite(bias) && fields.sub[1] * inv_k + bias >= -126.0f && top <= 125.0f)) return false;
    for (int i = 0; i < kExponents; ++i) e[i] = exp2_normal(static_cast<float>(i - F::kBias) * inv_k + bias);
    for (int i = 0; i < 8; ++i) {
      m[i] = exp2_normal(fields.normal[i] * inv_k);
      s[i] = exp2_normal(select(i & ((1 << F::kMant) - 1), fields.sub[i], 0.0f) * inv_k + bias);
    }
    e[0] = 1.0f;  // any normal number: its products are blended away
    s[0] = 0.0f;
    return true;
  }
};

// Decodes the first n - n % 8 values with the table; returns how many.
// Note: vpermps reads the low 3 bits of each index only, so the 8-entry tables m and s take the
// code itself (FieldLog2 repeats E5M2's 4 entries) and e the code shifted by M (the sign bit
// lands above those 3 bits); blendv reads the top bit only, so a chunk of e is picked by its
// bit of the code shifted to the top.
template <class F>
int64_t decode_avx2(const DecodeTable<F>& t, const uint8_t* c, int64_t n, float* y) {
  constexpr int M = F::kMant, kChunks = DecodeTable<F>::kExponents / 8;
  static_assert(kChunks == 2 || kChunks == 4, "E4M3 or E5M2");
  __m256 e_vec[kChunks];
  for (int j = 0; j < kChunks; ++j) e_vec[j] = _mm256_load_ps(t.e + 8 * j);
  const __m256 m_vec = _mm256_load_ps(t.m), s_vec = _mm256_load_ps(t.s);
  const __m256i low7 = _mm256_set1_epi32(0x7F), first_normal = _mm256_set1_epi32(1 << M);
  const __m256i sign_bit = _mm256_set1_epi32(static_cast<int32_t>(0x80000000u));
  const auto ps = [](__m256i m) { return _mm256_castsi256_ps(m); };
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i full = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + i)));
    const __m256i code = _mm256_and_si256(full, low7), e = _mm256_srli_epi32(full, M);
    const __m256 bit3 = ps(_mm256_slli_epi32(full, 31 - (M + 3)));  // e's bit 3 on top
    __m256 scale = _mm256_blendv_ps(_mm256_permutevar8x32_ps(e_vec[0], e), _mm256_permutevar8x32_ps(e_vec[1], e), bit3);
    if (kChunks == 4) {
      const __m256 hi = _mm256_blendv_ps(_mm256_permutevar8x32_ps(e_vec[2], e), _mm256_permutevar8x32_ps(e_vec[3], e), bit3);
      scale = _mm256_blendv_ps(scale, hi, ps(_mm256_slli_epi32(full, 31 - (M + 4))));
    }
    __m256 v = _mm256_mul_ps(scale, _mm256_permutevar8x32_ps(m_vec, full));
    // e = 0 (code < 2^M): code - 2^M is negative, its top bit picks the subnormal factor
    v = _mm256_blendv_ps(v, _mm256_permutevar8x32_ps(s_vec, full), ps(_mm256_sub_epi32(code, first_normal)));
    if (F::kInfCode < 0) {  // E4M3: 0x7F alone is not finite (NaN: every bit set)
      v = _mm256_or_ps(v, ps(_mm256_cmpeq_epi32(code, low7)));
    } else {  // E5M2: inf, then NaNs
      const __m256 special = _mm256_blendv_ps(_mm256_set1_ps(kNaN), _mm256_set1_ps(kInf),
                                              ps(_mm256_cmpeq_epi32(code, _mm256_set1_epi32(F::kInfCode))));
      v = _mm256_blendv_ps(v, special, ps(_mm256_cmpgt_epi32(code, _mm256_set1_epi32(F::kFirstSpecial - 1))));
    }
    const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(full, 24), sign_bit);
    _mm256_storeu_ps(y + i, _mm256_or_ps(v, ps(sign)));
  }
  return i;
}
#endif

// The decoders of up to 8 consecutive groups of a row, their tables built together.
// Note: built one group at a time, each table's exp2 chains waited behind the previous group's
// lookups; 8 independent builds overlap, and the build had cost as much as a third of the decode.
template <class F>
struct DecodeChunk {
  const float *inv_k, *bias;  // the chunk's first group's
#ifdef __AVX2__
  DecodeTable<F> tables[8];
  bool ok[8];
#endif
  DecodeChunk(const float* inv_k_, const float* bias_, int64_t count) : inv_k(inv_k_), bias(bias_) {
#ifdef __AVX2__
    for (int64_t j = 0; j < count; ++j) ok[j] = tables[j].build(inv_k[j], bias[j]);
#endif
  }

  // The chunk's group j: len codes c into y.
  void decode(int64_t j, const uint8_t* c, int64_t len, float* y) const {
    int64_t done = 0;
#ifdef __AVX2__
    if (ok[j]) done = decode_avx2<F>(tables[j], c, len, y);
#endif
    decode_elementwise<F>(c + done, len - done, inv_k[j], bias[j], y + done);
  }
};

// Decodes a row of `groups` groups of G codes (the last one n - (groups - 1) G long) into y.
template <class F>
void decode_row(const uint8_t* c, int64_t n, int64_t G, int64_t groups, const float* inv_k, const float* bias,
                float* y) {
  for (int64_t j0 = 0; j0 < groups; j0 += 8) {
    const int64_t j1 = std::min(groups, j0 + 8);
    const DecodeChunk<F> chunk(inv_k + j0, bias + j0, j1 - j0);
    for (int64_t j = j0; j < j1; ++j) chunk.decode(j - j0, c + j * G, std::min(G, n - j * G), y + j * G);
  }
}

// max |x| (inf or NaN when the group holds one: NaN's bits order above inf's) and the minimum
// over the non-zero |x|, on the bits: integer max / min reductions vectorize, float ones with
// NaN do not. u - 1 sends zeros to the top so the minimum skips them.
void group_range(const float* x, int64_t n, float* mx_out, float* mn_out) {
  uint32_t mx = 0, mn = ~0u;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = bits_of(x[i]) & 0x7FFFFFFFu;
    mx = u > mx ? u : mx;
    mn = u - 1u < mn ? u - 1u : mn;
  }
  *mx_out = float_of(mx);
  *mn_out = float_of(mn + 1u);
}

// quantize_fp8's expansion metadata of each group of a row from its range (mx, mn), stored in
// place, and bias = -(k log2 gm + log2 s) (NaN for a non-finite group) for encode_group.
template <class F>
void encode_constants(const float* mx, const float* mn, int64_t groups, float* __restrict scale,
                      float* __restrict k_out, float* __restrict gm_out, float* __restrict bias) {
  // Python's 16 * (2 * math.log2(fmax) - 1) and math.log2(fmax), rounded to fp32 by torch
  const float span = static_cast<float>(16 * (2 * std::log2(static_cast<double>(F::kMax)) - 1));
  const float log2_fmax = static_cast<float>(std::log2(static_cast<double>(F::kMax)));
  for (int64_t j = 0; j < groups; ++j) {
    const uint32_t umx = bits_of(mx[j]);
    const bool bad = umx >= 0x7F800000u;
    const bool empty = (umx == 0) | bad;  // R = 1, k = 1, gm = 1
    const float lmx = fast_log2(select(empty, 1.0f, mx[j])), lmn = fast_log2(select(empty, 1.0f, mn[j]));
    const float log_r = lmx - lmn;
    // floor(span / log_r) / 16 (torch's float / tensor is reciprocal * float), clamped to [1/16,
    // 65536] below: past 2^21 the value no longer matters, and below it truncation is floor.
    const float y = (1.0f / log_r) * span;
    float k = static_cast<float>(static_cast<int32_t>(select(y > 0x1p21f, 0x1p21f, y))) / 16.0f;
    k = select(log_r > 0.0f, k, 1.0f);
    k = select(k < 1.0f / 16.0f, 1.0f / 16.0f, select(k > 65536.0f, 65536.0f, k));
    const float gm = fast_exp2(0.5f * (lmx + lmn));
    const float lgm = fast_log2(gm);
    const float s = fast_exp2(k * (lmx - lgm) - log2_fmax);
    scale[j] = select(bad, kNaN, s);
    k_out[j] = k;
    gm_out[j] = gm;
    bias[j] = select(bad, kNaN, -(k * lgm + fast_log2(s)));
  }
}

// Note: with FMA only: the scalar path's fmadd is a fused multiply-add exactly when the CPU has
// one (__FP_FAST_FMAF), and the vector path must round as it does.
#if defined(__AVX2__) && defined(__FMA__)

// encode_group's codes of 8 Q values x[0:8Q] (a finite group: bias finite) as int32 lanes: the
// scalar path's operations (log2_positive, exp2_normal, fp8_bits) on vectors, so the same codes.
// Keep it so: a table-based log2 without the division flipped 31 in 256000 codes by one step and
// that alone moved a Lightning training run's loss by 2% (tests/integrations/test_lightning.py).
// Note: the Q vectors advance in lock-step, one operation on all Q before the next. Each
// vector's chain is ~40 dependent operations; written one vector after the other (as the
// compiler emits the vectorized scalar loop), the out-of-order window held about two of them and
// the loop ran at ~1 operation per cycle.
// kTiny: the group holds subnormal values (scaled by 2^23 first, as log2_positive does); groups
// without them skip that step. kSigned: x may be negative (or -0); second moments, +0 or positive,
// skip the sign's four operations.
template <class F, int Q, bool kTiny, bool kSigned>
SDPQ_ADAMW_INLINE void encode_lockstep(const float* x, f8 k, f8 bias, i8 (&out)[Q]) {
  constexpr int kShift = 23 - F::kMant;
  const f8 magic = f8{} + 0x1.8p23f;  // 1.5 * 2^23: adding it rounds to an integer
  i8 ux[Q], e[Q];
  f8 t[Q], t2[Q], p[Q], y[Q], sh[Q];
#define SDPQ_EACH _Pragma("GCC unroll 16") for (int q = 0; q < Q; ++q)
  SDPQ_EACH ux[q] = kSigned ? (i8)loadu(x + 8 * q) & 0x7FFFFFFF : (i8)loadu(x + 8 * q);
  SDPQ_EACH {  // log2_positive: x = 2^e m, m in [sqrt(1/2), sqrt(2)), subnormals scaled by 2^23
    i8 u = ux[q], rescaled = {};
    if (kTiny) {
      const i8 tiny = ux[q] < 0x00800000;
      u = (i8)((f8)ux[q] * (tiny ? f8{} + 0x1p23f : f8{} + 1.0f));
      rescaled = tiny & 23;
    }
    const i8 ex = (u - 0x3F3504F3) >> 23;
    const f8 m = (f8)(u - (ex << 23));
    t[q] = (m - 1.0f) / (m + 1.0f);
    e[q] = ex - rescaled;
  }
  SDPQ_EACH t2[q] = t[q] * t[q];
  SDPQ_EACH p[q] = fma8(fma8(fma8(f8{} + 0x1.ba18fap-2f, t2[q], f8{} + 0x1.27471cp-1f), t2[q], f8{} + 0x1.ec70e6p-1f),
                         t2[q], f8{} + 0x1.715476p+1f);
  SDPQ_EACH {
    const f8 l = __builtin_convertvector(e[q], f8) + t[q] * p[q];
    y[q] = l * k + bias;
    sh[q] = y[q] + magic;
    y[q] = y[q] - (sh[q] - magic);  // f in [-1/2, 1/2]
  }
  SDPQ_EACH p[q] = fma8(y[q], f8{} + 0x1.41fbbcp-13f, f8{} + 0x1.5f3e54p-10f);
  SDPQ_EACH p[q] = fma8(p[q], y[q], f8{} + 0x1.3b2d4cp-7f);
  SDPQ_EACH p[q] = fma8(p[q], y[q], f8{} + 0x1.c6aee8p-5f);
  SDPQ_EACH p[q] = fma8(p[q], y[q], f8{} + 0x1.ebfbdcp-3f);
  SDPQ_EACH p[q] = fma8(p[q], y[q], f8{} + 0x1.62e430p-1f);
  SDPQ_EACH p[q] = fma8(p[q], y[q], f8{} + 1.0f);
  SDPQ_EACH {
    i8 mag = (i8)p[q] + ((i8)sh[q] << 23);  // the magic's bits end in 9 zero bits: n << 23
    const i8 fmax = i8{} + static_cast<int32_t>(bits_of(F::kMax));
    mag = mag < fmax ? mag : fmax;
    const i8 sub = (i8)((f8)mag + F::kDenormAdd) - static_cast<int32_t>(bits_of(F::kDenormAdd));
    const i8 normal = (mag + static_cast<int32_t>((static_cast<uint32_t>(F::kBias - 127) << 23) +
                                                  ((1u << (kShift - 1)) - 1u)) + ((mag >> kShift) & 1)) >> kShift;
    const i8 code = mag < static_cast<int32_t>(F::kMinNormal) ? sub : normal;
    out[q] = ux[q] == 0 ? 0 : code;
    if (kSigned) out[q] |= ((i8)loadu(x + 8 * q) >> 24) & 0x80;
  }
#undef SDPQ_EACH
}

// Codes of the first n - n % 64 values; returns how many.
template <class F, bool kTiny, bool kSigned>
int64_t encode_avx2(const float* x, int64_t n, float k, float bias, uint8_t* codes) {
  constexpr int Q = 8;
  const f8 vk = f8{} + k, vb = f8{} + bias;
  int64_t i = 0;
  for (; i + 8 * Q <= n; i += 8 * Q) {
    i8 c[Q];
    encode_lockstep<F, Q, kTiny, kSigned>(x + i, vk, vb, c);
    for (int h = 0; h < Q; h += 2) {  // codes 0..255: saturating packs keep them; dwords back in order
      const __m256i w = _mm256_packus_epi32((__m256i)c[h], (__m256i)c[h + 1]);
      const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(w, w), _mm256_setr_epi32(0, 4, 1, 5, 0, 0, 0, 0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i + 8 * h), _mm256_castsi256_si128(b));
    }
  }
  return i;
}
#endif

// code = fp8(sign(x) min(exp2(k log2|x| + bias), fmax)). For x != 0, k log2|x| + bias =
// k (log2|x| - log2 mx) + log2 fmax lies in [1 - log2 fmax, log2 fmax] (k log2 R <= 2 log2 fmax
// - 1): exp2 stays normal. Zeros (log2 = -inf in the reference) give code 0 with their sign; a
// NaN bias (non-finite group) gives NaN codes, 0x7F | sign as torch converts NaN. mn: the
// group's smallest non-zero |x| (group_range); below 2^-126 the vector path takes subnormals.
// nonnegative: every x is +0 or positive (a second moment), so the codes carry no sign.
template <class F>
void encode_group(const float* x, int64_t n, float k, float bias, float mn, uint8_t* codes, bool nonnegative) {
  if (bias != bias) {
    for (int64_t i = 0; i < n; ++i) codes[i] = static_cast<uint8_t>(0x7Fu | ((bits_of(x[i]) >> 24) & 0x80u));
    return;
  }
#if defined(__AVX2__) && defined(__FMA__)
  const bool tiny = bits_of(mn) < 0x00800000u;
  const int64_t done = nonnegative ? (tiny ? encode_avx2<F, true, false>(x, n, k, bias, codes)
                                           : encode_avx2<F, false, false>(x, n, k, bias, codes))
                                   : (tiny ? encode_avx2<F, true, true>(x, n, k, bias, codes)
                                           : encode_avx2<F, false, true>(x, n, k, bias, codes));
  x += done;
  codes += done;
  n -= done;
#endif
  const uint32_t fmax_bits = bits_of(F::kMax);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t ux = bits_of(x[i]) & 0x7FFFFFFFu;
    const uint32_t mag = std::min(bits_of(exp2_normal(log2_positive(float_of(ux)) * k + bias)), fmax_bits);
    const uint32_t code = select(ux == 0, 0u, fp8_bits<F>(float_of(mag)));
    codes[i] = static_cast<uint8_t>(code | ((bits_of(x[i]) >> 24) & 0x80u));
  }
}

}  // namespace
}  // namespace adamw
}  // namespace sdpq
