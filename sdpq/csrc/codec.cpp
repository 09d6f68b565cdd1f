// CPU kernels of the wire codec: sdpq::encode_rows, sdpq::decode_rows, sdpq::reduce_rows.
//
// The operators are defined in Python (sdpq/kernels/codec_ops.py); this file registers their
// CPU kernels. Each kernel reads its inputs once and writes its outputs once, a tile at a time
// through a small fp32 buffer that stays in L1: difference, Hadamard butterflies, group absmax,
// division, rounding and packing of a tile all happen before the next tile is loaded.
//
// The arithmetic is that of the PyTorch reference (sdpq/quant/rows.py and the modules it
// calls) operation for operation, in fp32 and in the same order, so nearest rounding is bitwise
// equal to it (the build uses -ffp-contract=off: no fused multiply-adds the reference lacks,
// the one written out, x * (+-1) + p, rounds as the add it replaces):
//   scale = fp32(absmax / qmax) [-> rounded up to bf16], code = clamp(round_half_even(v / scale)),
//   the butterflies pair (j, j + h) of every run of 2h as (a + b, a - b), h = 1, 2, 4, ...
//   (forward: after the signs times 1 / B),
//   the received rows are summed in row order.
// Stochastic rounding uses floor(v / scale + u) with u from a counter-based hash of (seed,
// element position): the draws differ from the reference's torch generator (both unbiased),
// and they do not depend on how the work is split between threads.
//
// Wire rows (sdpq/quant/wire.py): [codes: groups * G * bits / 8 bytes | scales: fp32 or bf16,
// little endian]; codes below 8 bits are a little-endian bit stream of two's-complement fields
// (4-bit: element 2i in the low nibble of byte i; 3-bit: 8 codes in 3 bytes).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "blocks.h"

namespace sdpq {
namespace {

// ---------------------------------------------------------------------------- encode_rows

std::tuple<at::Tensor, at::Tensor, at::Tensor> encode_rows(
    const at::Tensor& x, const std::optional<at::Tensor>& ref, int64_t segments, int64_t bits,
    int64_t group_size, bool stochastic, bool scale_bf16, const std::optional<at::Tensor>& signs,
    int64_t own_row, int64_t seed) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "encode_rows: x must be 2-D with contiguous rows");
  const int64_t R = x.size(0), n = x.size(1);
  TORCH_CHECK(segments >= 1 && R % segments == 0, "encode_rows: ", R, " rows do not split into ", segments,
              " segments");
  const Spec spec(bits, group_size, stochastic, scale_bf16);
  TORCH_CHECK(segments == 1 || n % spec.G == 0,
              "encode_rows: segmented rows need n (", n, ") to be a multiple of the group size ", spec.G);
  const Hadamard had(signs);
  TORCH_CHECK(had.B == 1 || n % had.B == 0, "encode_rows: row length ", n,
              " is not a multiple of the Hadamard block ", had.B);
  if (ref) {
    TORCH_CHECK(ref->sizes() == x.sizes() && ref->stride(1) == 1, "encode_rows: ref must match x");
  }
  const int64_t P = R / segments, row_numel = segments * n;
  TORCH_CHECK(own_row < P, "encode_rows: own_row=", own_row, "; allowed: -1 (none) or 0..", P - 1);
  auto out = at::empty({P, spec.wire_bytes(row_numel)}, x.options().dtype(at::kByte));
  auto own = at::empty(own_row >= 0 ? std::vector<int64_t>{segments, n} : std::vector<int64_t>{0},
                       x.options().dtype(at::kFloat));
  const int64_t T = tile_size(n, {spec.G, had.B});
  const int64_t tiles = (n + T - 1) / T;
  std::atomic<bool> nonfinite{false};
  const uint8_t* xp = static_cast<const uint8_t*>(x.data_ptr());
  const uint8_t* rp = ref ? static_cast<const uint8_t*>(ref->data_ptr()) : nullptr;
  const auto xt = x.scalar_type();
  const auto rt = ref ? ref->scalar_type() : xt;
  const int64_t xs = x.stride(0) * x.element_size(), rs = ref ? ref->stride(0) * ref->element_size() : 0;
  uint8_t* op = out.data_ptr<uint8_t>();
  float* ownp = own_row >= 0 ? own.data_ptr<float>() : nullptr;
  const int64_t wb = out.size(1), cb = spec.code_bytes(row_numel);

  at::parallel_for(0, R * tiles, grain(T), [&](int64_t begin, int64_t end) {
    Scratch v(T), tmp(T);
    bool bad = false;
    for (int64_t u = begin; u < end; ++u) {
      const int64_t r = u / tiles, t = u % tiles;
      const int64_t c0 = t * T, len = std::min(T, n - c0);
      const float* vals = v;  // the tile's values to quantize
      const float* xrow = reinterpret_cast<const float*>(xp + r * xs) + c0;
      const int64_t seg = r / P, p = r % P;
      float* own_dst = ownp && p == own_row ? ownp + seg * n + c0 : nullptr;
      // Logical position in the wire row: segment seg occupies [seg * n, (seg + 1) * n).
      uint8_t* row = op + p * wb;
      const int64_t pos0 = seg * n + c0;
      if (xt == at::kFloat && !rp && had.B > 1 &&
          hadamard_quantize(had, xrow, own_dst, len, spec, row, cb, pos0 / spec.G, static_cast<uint32_t>(seed),
                            static_cast<uint64_t>(p * row_numel + pos0), bad)) {
        continue;  // fused in registers
      }
      if (xt == at::kFloat && !rp) {  // already fp32: no staging copy
        if (had.B > 1) {  // transformed straight into `own` when this row is kept
          vals = own_dst ? own_dst : v;
          had.forward(xrow, own_dst ? own_dst : v, len);
          own_dst = nullptr;
        } else {
          vals = xrow;
        }
      } else {
        if (xt == at::kFloat && rt == at::kFloat) {
          subtract(xrow, reinterpret_cast<const float*>(rp + r * rs) + c0, len, v);
        } else {
          load_float(xp + r * xs, xt, c0, len, v);
          if (rp) {
            load_float(rp + r * rs, rt, c0, len, tmp);
            subtract(v, tmp, len, v);
          }
        }
        if (had.B > 1) had.forward(v, len);
      }
      if (own_dst) copy_floats(own_dst, vals, len);
      for (int64_t g0 = 0; g0 < len; g0 += spec.G) {
        const int64_t glen = std::min<int64_t>(spec.G, len - g0);
        const int64_t gi = spec.group_of(pos0 + g0);
        bad |= !quantize_group(vals + g0, glen, spec, row + spec.group_code_offset(gi), row + cb + gi * spec.scale_size,
                               static_cast<uint32_t>(seed), static_cast<uint64_t>(p * row_numel + pos0 + g0));
      }
    }
    if (bad) nonfinite.store(true, std::memory_order_relaxed);
  });
  return {out, own, at::scalar_tensor(nonfinite.load(), x.options().dtype(at::kBool))};
}

// ---------------------------------------------------------------------------- decode_rows

void decode_rows(const at::Tensor& buf, int64_t numel, int64_t bits, int64_t group_size, bool scale_bf16,
                 const at::Tensor& out, bool add) {
  const Spec spec(bits, group_size, false, scale_bf16);
  TORCH_CHECK(buf.dim() == 2 && buf.scalar_type() == at::kByte && buf.stride(1) == 1 &&
                  buf.size(1) == spec.wire_bytes(numel),
              "decode_rows: expected uint8 rows of ", spec.wire_bytes(numel), " bytes for numel=", numel);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == buf.size(0) && out.size(1) == numel && out.stride(1) == 1,
              "decode_rows: out must be [", buf.size(0), ", ", numel, "] with contiguous rows");
  const int64_t R = buf.size(0), T = tile_size(numel, {spec.G}), tiles = (numel + T - 1) / T;
  const int64_t cb = spec.code_bytes(numel), bs = buf.stride(0);
  const uint8_t* bp = buf.data_ptr<uint8_t>();
  uint8_t* optr = static_cast<uint8_t*>(out.data_ptr());
  const auto ot = out.scalar_type();
  const int64_t os = out.stride(0) * out.element_size();
  at::parallel_for(0, R * tiles, grain(T), [&](int64_t begin, int64_t end) {
    Scratch v(T);
    for (int64_t u = begin; u < end; ++u) {
      const int64_t r = u / tiles, c0 = (u % tiles) * T, len = std::min(T, numel - c0);
      if (ot == at::kFloat) {  // straight into out
        float* d = reinterpret_cast<float*>(optr + r * os) + c0;
        add ? dequantize_span<Into::kAdd>(bp + r * bs, cb, spec, c0, len, d)
            : dequantize_span<Into::kStore>(bp + r * bs, cb, spec, c0, len, d);
        continue;
      }
      if (add) {
        load_float(optr + r * os, ot, c0, len, v);
        dequantize_span<Into::kAdd>(bp + r * bs, cb, spec, c0, len, v);
      } else {
        dequantize_span<Into::kStore>(bp + r * bs, cb, spec, c0, len, v);
      }
      store_float(v, len, ot, optr + r * os, c0);
    }
  });
}

// ---------------------------------------------------------------------------- reduce_rows

std::tuple<at::Tensor, at::Tensor, at::Tensor> reduce_rows(
    const at::Tensor& buf, int64_t numel, int64_t bits, int64_t group_size, bool scale_bf16, const at::Tensor& own,
    int64_t own_row, const at::Tensor& bad, const std::optional<at::Tensor>& signs, int64_t enc_bits,
    int64_t enc_group_size, bool enc_stochastic, bool enc_scale_bf16, int64_t enc_numel, int64_t own_seg,
    int64_t seed) {
  const Spec spec(bits, group_size, false, scale_bf16);
  TORCH_CHECK(buf.dim() == 2 && buf.scalar_type() == at::kByte && buf.stride(1) == 1 &&
                  buf.size(1) == spec.wire_bytes(numel),
              "reduce_rows: expected uint8 rows of ", spec.wire_bytes(numel), " bytes for numel=", numel);
  TORCH_CHECK(own.scalar_type() == at::kFloat && own.is_contiguous() && own.numel() == numel,
              "reduce_rows: own must be contiguous fp32 with ", numel, " elements");
  const bool encode = enc_bits != 0;
  const Hadamard had(encode ? std::nullopt : signs);
  TORCH_CHECK(had.B == 1 || numel % had.B == 0, "reduce_rows: ", numel, " is not a multiple of the Hadamard block");
  const Spec enc(encode ? enc_bits : 8, encode ? enc_group_size : 2, enc_stochastic, enc_scale_bf16);
  const int64_t rowlen = encode ? enc_numel : numel;
  TORCH_CHECK(rowlen > 0 && numel % rowlen == 0, "reduce_rows: rows of ", rowlen, " must tile ", numel);
  const int64_t erows = numel / rowlen;
  const float extra = bad.item<bool>() ? std::numeric_limits<float>::quiet_NaN() : 0.0f;

  auto opts = buf.options();
  at::Tensor result = encode ? at::empty({erows, enc.wire_bytes(rowlen)}, opts.dtype(at::kByte))
                             : at::empty({numel}, opts.dtype(at::kFloat));
  at::Tensor own_out = at::empty({encode ? rowlen : 0}, opts.dtype(at::kFloat));
  const int64_t R = buf.size(0), bs = buf.stride(0), cb = spec.code_bytes(numel);
  const int64_t T = tile_size(rowlen, {spec.G, enc.G, had.B}), tiles = (rowlen + T - 1) / T;
  const uint8_t* bp = buf.data_ptr<uint8_t>();
  const float* ownp = own.data_ptr<float>();
  std::atomic<bool> nonfinite{false};
  at::parallel_for(0, erows * tiles, grain(T * R), [&](int64_t begin, int64_t end) {
    Scratch scratch(T);
    bool flag = false;
    for (int64_t u = begin; u < end; ++u) {
      const int64_t e = u / tiles, c0 = e * rowlen + (u % tiles) * T;
      const int64_t len = std::min(T, (e + 1) * rowlen - c0), col = c0 - e * rowlen;
      // The sum lands where it is kept: the result (no re-encode), own_out (its segment), or scratch.
      float* acc = !encode ? result.data_ptr<float>() + c0
                   : e == own_seg ? own_out.data_ptr<float>() + col : static_cast<float*>(scratch);
      // Fused in registers where the blocks fit (the common layouts); the tile-wise path below otherwise.
      const RowSum rows{bp, bs, R, cb, spec, ownp, own_row, extra};
      if (!encode && had.B > 1 && sum_inverse_hadamard(rows, had, c0, len, acc)) continue;
      uint8_t* erow = encode ? result.data_ptr<uint8_t>() + e * result.size(1) : nullptr;
      const int64_t ecb = enc.code_bytes(rowlen);
      if (encode && sum_quantize(rows, enc, c0, len, e == own_seg ? acc : nullptr, erow, ecb, col / enc.G,
                                 static_cast<uint32_t>(seed), flag)) {
        continue;
      }
      for (int64_t k = 0; k < R; ++k) {  // row order, as the reference's sum; the poison last
        const bool last = k == R - 1 && k > 0;
        if (k == own_row) {
          if (k == 0) {
            copy_floats(acc, ownp + c0, len);
          } else if (last) {
            combine<Into::kAddExtra>(acc, ownp + c0, len, extra);
          } else {
            combine<Into::kAdd>(acc, ownp + c0, len, extra);
          }
          continue;
        }
        const uint8_t* row = bp + k * bs;
        if (k == 0) {
          dequantize_span<Into::kStore>(row, cb, spec, c0, len, acc);
        } else if (last) {
          dequantize_span<Into::kAddExtra>(row, cb, spec, c0, len, acc, extra);
        } else {
          dequantize_span<Into::kAdd>(row, cb, spec, c0, len, acc);
        }
      }
      if (R == 1) {
        for (int64_t i = 0; i < len; ++i) acc[i] = acc[i] + extra;
      }
      if (!encode) {
        if (had.B > 1) had.inverse(acc, len);
        continue;
      }
      for (int64_t g0 = 0; g0 < len; g0 += enc.G) {
        const int64_t gi = enc.group_of(col + g0);
        flag |= !quantize_group(acc + g0, std::min<int64_t>(enc.G, len - g0), enc, erow + enc.group_code_offset(gi),
                                erow + ecb + gi * enc.scale_size, static_cast<uint32_t>(seed),
                                static_cast<uint64_t>(c0 + g0));
      }
    }
    if (flag) nonfinite.store(true, std::memory_order_relaxed);
  });
  return {result, own_out, at::scalar_tensor(nonfinite.load(), opts.dtype(at::kBool))};
}

}  // namespace
}  // namespace sdpq

TORCH_LIBRARY_IMPL(sdpq, CPU, m) {
  m.impl("encode_rows", &sdpq::encode_rows);
  m.impl("decode_rows", &sdpq::decode_rows);
  m.impl("reduce_rows", &sdpq::reduce_rows);
}
