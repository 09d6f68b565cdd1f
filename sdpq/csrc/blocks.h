// Fused blocks of NV * 8 values (NV <= 16: up to 128 values, 16 AVX2 registers) that go from
// their inputs to their outputs without leaving registers: the Hadamard transform, the sum of
// received rows, absmax, quantization and packing. Each is bitwise the same as the tile-wise
// composition it replaces (forward / inverse, dequantize_span + combine, quantize_group): the
// same fp32 operations in the same order.
#pragma once

#include "hadamard.h"
#include "quantize.h"
#include "simd.h"

namespace sdpq {

// Quantizes n consecutive groups of sp.G = NV * 8 values that produce(g, r) puts in registers
// (group gi0 + g at element pos0 + g G of the output row; its codes at sp.group_code_offset,
// scales at row + cb), each bitwise as quantize_group(), keeping the values in keep[g G:] when
// `keep` is not null. `bad`: a group held inf/NaN.
// Note: kBehind writes the codes one group behind. A group's codes wait on a long chain (its
// production, absmax over NV vectors, the scalar scale, NV divisions); written at once, the next
// group cannot start until most of that chain has retired. Behind, group g - 1 is encoded from an
// L1 buffer while group g is produced: two independent chains. It pays where producing a group is
// itself a long chain (the Hadamard transform: int8 encode of 4M values 2.60 -> 2.35 ms), not
// where it is short (a sum of two received rows: the requantize went 1.01 -> 1.12 ms).
template <int NV, bool kBehind, typename Produce>
SDPQ_INLINE void quantize_groups(int64_t n, const Spec& sp, uint8_t* row, int64_t cb, int64_t gi0, uint64_t pos0,
                                 uint32_t seed, float* keep, bool& bad, Produce&& produce) {
  alignas(32) float parked[2][NV * 8];
  float prev_safe = 1.0f;
  bool prev_finite = true;
  const float qmax = static_cast<float>(sp.qmax);
  const auto encode = [&](int64_t g, auto&& load, float safe, bool finite) __attribute__((always_inline)) {
    uint8_t* codes = row + sp.group_code_offset(gi0 + g);
    if (!finite) {
      std::memset(codes, 0, NV * sp.bits);
      return;
    }
    const f8 scale = f8{} + safe;
    with_format(sp, [&](auto bits, auto stochastic) {
      encode_vectors<bits, stochastic>(std::integral_constant<int, NV>{}, load, scale, qmax, seed, pos0 + g * sp.G,
                                       codes);
    });
  };
  const i8 absmask = i8{} + 0x7FFFFFFF;
  for (int64_t g = 0; g < n; ++g) {
    f8 r[NV];
    produce(g, r);
    float* cur = parked[g & 1];
    f8 m = {};
    i8 isnan = {};
#pragma GCC unroll 16
    for (int k = 0; k < NV; ++k) {
      if (kBehind) storeu(cur + 8 * k, r[k]);
      if (keep) storeu(keep + g * sp.G + 8 * k, r[k]);
      const f8 a = (f8)((i8)r[k] & absmask);
      m = a > m ? a : m;
      isnan |= r[k] != r[k];
    }
    const float* prev = parked[(g - 1) & 1];
    if (kBehind && g > 0) encode(g - 1, [&](int k) { return loadu(prev + 8 * k); }, prev_safe, prev_finite);
    const GroupScale gs(max_lane(m), any_lane(isnan), sp);
    gs.write(sp, row + cb + (gi0 + g) * sp.scale_size);
    bad |= !gs.finite;
    if (!kBehind) encode(g, [&](int k) { return r[k]; }, gs.safe, gs.finite);
    prev_safe = gs.safe;
    prev_finite = gs.finite;
  }
  const float* last = parked[(n - 1) & 1];
  if (kBehind && n > 0) encode(n - 1, [&](int k) { return loadu(last + 8 * k); }, prev_safe, prev_finite);
}

// Transform and encode src[0:len] (whole groups; group gi0 onwards of a wire row whose scales
// start at row + cb) when the Hadamard block is the group size and fits in registers; false
// (nothing done) otherwise. Kept rows go to `keep` (when not null). `bad`: a group held inf/NaN.
inline bool hadamard_quantize(const Hadamard& had, const float* src, float* keep, int64_t len, const Spec& sp,
                              uint8_t* row, int64_t cb, int64_t gi0, uint32_t seed, uint64_t pos0, bool& bad) {
  if (had.B != sp.G || len % sp.G != 0) return false;
  return with_block(sp.G, [&](auto nv) {
    constexpr int NV = decltype(nv)::value;
    quantize_groups<NV, true>(len / sp.G, sp, row, cb, gi0, pos0, seed, keep, bad, [&](int64_t g, f8(&r)[NV]) {
#pragma GCC unroll 16
      for (int k = 0; k < NV; ++k) r[k] = loadu(src + g * sp.G + 8 * k);
      had.transform_registers<NV, true>(r);
    });
    return true;
  });
}

// The received rows of a reduce, for summing in registers: R wire rows (stride bs, codes of
// `sp`, scales at + cb), row own_row replaced by the fp32 `own`, NaN `extra` added last.
struct RowSum {
  const uint8_t* buf;
  int64_t bs, R, cb;
  const Spec& sp;
  const float* own;
  int64_t own_row;
  float extra;

  // r = the sum of elements [pos, pos + NV * 8) (pos a multiple of 8, sp.G a multiple of 8), in
  // row order: bitwise dequantize_span<kStore / kAdd / kAddExtra> as the reduce kernel chains them.
  // Every decision (own row, bit width, where in the chain) is taken once per row, not per vector.
  template <int NV>
  SDPQ_INLINE void load(int64_t pos, f8 (&r)[NV]) const {
    const f8 ve = f8{} + extra;
    if (R == 2 && own_row < 2 && sp.group_of(pos) == sp.group_of(pos + 8 * NV - 1)) {
      load_two<NV>(pos, r, ve);
      return;
    }
    for (int64_t k = 0; k < R; ++k) {
      const Into mode = k == 0 ? Into::kStore : (k == R - 1 ? Into::kAddExtra : Into::kAdd);
      with_into(mode, [&](auto m) __attribute__((always_inline)) {
        if (k == own_row) {
#pragma GCC unroll 16
          for (int j = 0; j < NV; ++j) r[j] = into<m.value>(r[j], loadu(own + pos + 8 * j), ve);
          return;
        }
        const uint8_t* row = buf + k * bs;
        auto decode = [&](auto bits) __attribute__((always_inline)) {
          int64_t gi = sp.group_of(pos), next = (gi + 1) * sp.G;
          f8 scale = f8{} + read_scale(row, cb, sp, gi);
#pragma GCC unroll 16
          for (int j = 0; j < NV; ++j) {
            const int64_t e = pos + 8 * j;
            if (e >= next) {  // a new group (never, when the group holds the block)
              ++gi;
              next += sp.G;
              scale = f8{} + read_scale(row, cb, sp, gi);
            }
            r[j] = into<m.value>(r[j], decode_vector(row + e * bits.value / 8, bits.value, scale), ve);
          }
        };
        with_bits(sp.bits, decode);
      });
    }
    if (R == 1) {
#pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) r[j] = r[j] + ve;
    }
  }

  // The same for two rows when the block lies in one group (the 2-node and 2-GPU layouts): both
  // rows summed in one pass, so the block never leaves registers. Note: (row 0 + row 1) + extra,
  // the order of the general path.
  template <int NV>
  SDPQ_INLINE void load_two(int64_t pos, f8 (&r)[NV], f8 ve) const {
    const int64_t gi = sp.group_of(pos);
    const f8 s0 = f8{} + read_scale(buf, cb, sp, gi), s1 = f8{} + read_scale(buf + bs, cb, sp, gi);
    auto sum = [&](auto bits, auto own0, auto own1) __attribute__((always_inline)) {
      constexpr int B = decltype(bits)::value;
#pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) {
        const int64_t e = pos + 8 * j;
        const f8 a = own0 ? loadu(own + e) : decode_vector(buf + e * B / 8, B, s0);
        const f8 b = own1 ? loadu(own + e) : decode_vector(buf + bs + e * B / 8, B, s1);
        r[j] = (a + b) + ve;
      }
    };
    using T = std::true_type;
    using F = std::false_type;
    auto rows = [&](auto bits) __attribute__((always_inline)) {
      own_row == 0 ? sum(bits, T{}, F{}) : own_row == 1 ? sum(bits, F{}, T{}) : sum(bits, F{}, F{});
    };
    with_bits(sp.bits, rows);
  }
};

// dst[0:len] = inverse Hadamard of the row sum of elements [c0, c0 + len), a block at a time
// in registers; false (nothing done) when the block does not fit or the tile is not aligned.
inline bool sum_inverse_hadamard(const RowSum& rows, const Hadamard& had, int64_t c0, int64_t len, float* dst) {
  if (len % had.B != 0 || c0 % 8 != 0 || rows.sp.G % 8 != 0) return false;
  return with_block(had.B, [&](auto nv) {
    constexpr int NV = decltype(nv)::value;
    for (int64_t off = 0; off < len; off += had.B) {
      f8 r[NV];
      rows.load<NV>(c0 + off, r);
      had.transform_registers<NV, false>(r);
#pragma GCC unroll 16
      for (int k = 0; k < NV; ++k) storeu(dst + off + 8 * k, r[k]);
    }
    return true;
  });
}

// Re-encode the row sum of elements [c0, c0 + len) as groups of `enc` (group gi0 onwards of
// the output row at `row`, scales at + cb), keeping the sum in `keep` when not null; false
// (nothing done) when a group does not fit in registers or the tile is not aligned.
inline bool sum_quantize(const RowSum& rows, const Spec& enc, int64_t c0, int64_t len, float* keep, uint8_t* row,
                         int64_t cb, int64_t gi0, uint32_t seed, bool& bad) {
  if (len % enc.G != 0 || c0 % 8 != 0 || rows.sp.G % 8 != 0) return false;
  return with_block(enc.G, [&](auto nv) {
    constexpr int NV = decltype(nv)::value;
    quantize_groups<NV, false>(len / enc.G, enc, row, cb, gi0, static_cast<uint64_t>(c0), seed, keep, bad,
                               [&](int64_t g, f8(&r)[NV]) { rows.load<NV>(c0 + g * enc.G, r); });
    return true;
  });
}

}  // namespace sdpq
