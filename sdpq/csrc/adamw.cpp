// CPU kernel of sdpq::adamw_step: one step of sdpq.optim.AdamW for one parameter, every state
// layout (the operator and its arguments are defined in sdpq/kernels/adamw_ops.py).
//
// The PyTorch path of sdpq/optim/adamw.py makes ~30 passes over memory per chunk (decode,
// lerp, encode, ... each a tensor operation); here every state byte is read once and written
// once. The parameter is cut into tiles of whole FP8 groups (~8K elements, several rows when
// rows are short); a tile goes through fp32 buffers that stay in the L2 cache:
//   m, v <- decoded                                    (E4M3 / E5M2 with COAT expansion, bf16, fp32)
//   m <- lerp toward g, v <- b2 v + (1 - b2) g^2        (one pass over the gradient, update_moments)
//   m, v -> encoded back
//   (an MCF bf16 pair v: g in an fp32 buffer first, m as above, v by pair_second_moment)
//   v  <- sqrt(v)                                      (sqrt_inplace, or inside the MCF update)
//   w  <- w (1 - lr wd) - step_size m / denom          (native fp32 / bf16 / fp16 parameter)
//      or Grow (w, lo) by the decay and the step       (MCF master: bf16 parameter + bf16 lo)
// m and v enter the weight update unquantized, as in the reference.
//
// Every loop over elements is branch-free so that GCC vectorizes it (adamw_math.h): an encoded
// FP8 value costs a polynomial log2 and exp2; a decoded one a lookup in per-group tables of
// exp2 values (AVX2), else a table lookup of log2|code| and one exp2. The arithmetic is the
// reference's (sdpq/optim/adamw.py, sdpq/quant/fp8.py, sdpq/quant/mcf.py) operation by operation,
// in fp32 and in the same order, with torch's fused multiply-adds where its CPU kernels have them
// (lerp, addcmul, add with alpha) and none elsewhere (the build uses -ffp-contract=off). Hence
//   - without FP8 states the step equals the reference bitwise (and, with fp32 states and a
//     native fp32 master, torch.optim.AdamW's single-tensor step): no log2 / exp2 is involved;
//   - with FP8 states it differs by the rounding of log2 / exp2 (torch's come from MKL / Sleef):
//     decoded values agree to ~2^-19 relative, and a code may land one FP8 step away; and the
//     MCF weight step is computed with one division instead of two (mcf_weights), a few ulp.
// Tiles are independent, so the result does not depend on the number of threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "adamw_update.h"
#include "fp8_groups.h"

namespace sdpq {
namespace adamw {
namespace {

constexpr int64_t kTile = 8192;  // elements per tile (three fp32 buffers: 96 KiB)

enum class Fmt { kE4M3, kE5M2, kBF16, kFP32, kPair };

bool is_fp8(Fmt f) { return f == Fmt::kE4M3 || f == Fmt::kE5M2; }

Fmt parse_format(c10::string_view s, const char* which) {
  if (s == "e4m3") return Fmt::kE4M3;
  if (s == "e5m2") return Fmt::kE5M2;
  if (s == "bf16") return Fmt::kBF16;
  if (s == "fp32") return Fmt::kFP32;
  if (s == "pair") return Fmt::kPair;
  TORCH_CHECK(false, "adamw_step: ", which, "='", std::string(s), "'; allowed: e4m3, e5m2, bf16, fp32, pair");
}

// One moment's storage ([rows, cols]; FP8 metadata [rows, groups]).
struct Moment {
  Fmt fmt;
  uint8_t* codes = nullptr;
  float *scale = nullptr, *k = nullptr, *gm = nullptr;
  int64_t groups = 0;
  float* f32 = nullptr;
  uint16_t *hi = nullptr, *lo = nullptr;  // bf16 state, or the pair's two halves
};

void check_like(const at::Tensor& t, at::IntArrayRef shape, at::ScalarType dtype, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.sizes() == shape && t.is_contiguous(),
              "adamw_step: ", what, " must be a contiguous CPU ", dtype, " tensor of shape ", shape, ", got ",
              t.scalar_type(), " ", t.sizes(), t.is_contiguous() ? "" : " (not contiguous)");
}

uint16_t* bf16_ptr(const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

size_t storage_count(Fmt fmt) { return is_fp8(fmt) ? 4 : fmt == Fmt::kPair ? 2 : 1; }

Moment make_moment(at::TensorList t, Fmt fmt, int64_t R, int64_t C, int64_t G, const char* name) {
  const size_t want = storage_count(fmt);
  TORCH_CHECK(t.size() == want, "adamw_step: ", name, " needs ", want, " tensors for its format, got ", t.size());
  Moment s{fmt};
  switch (fmt) {
    case Fmt::kE4M3:
    case Fmt::kE5M2:
      s.groups = (C + G - 1) / G;
      check_like(t[0], {R, C}, at::kByte, "FP8 codes");
      for (size_t i = 1; i < 4; ++i) check_like(t[i], {R, s.groups}, at::kFloat, "FP8 metadata");
      s.codes = t[0].data_ptr<uint8_t>();
      s.scale = t[1].data_ptr<float>();
      s.k = t[2].data_ptr<float>();
      s.gm = t[3].data_ptr<float>();
      break;
    case Fmt::kFP32:
      check_like(t[0], {R, C}, at::kFloat, name);
      s.f32 = t[0].data_ptr<float>();
      break;
    case Fmt::kPair:
      check_like(t[1], {R, C}, at::kBFloat16, name);
      s.lo = bf16_ptr(t[1]);
      [[fallthrough]];
    case Fmt::kBF16:
      check_like(t[0], {R, C}, at::kBFloat16, name);
      s.hi = bf16_ptr(t[0]);
      break;
  }
  return s;
}

// ---------------------------------------------------------------------------- tiles

// Tiles: whole rows (rows_per of them) when a row fits in kTile, else row segments of `width`
// columns, a multiple of the group size. Either way a tile is contiguous in memory.
struct Tiling {
  int64_t R, C, G, width, rows_per, per_row, count;

  Tiling(int64_t R_, int64_t C_, int64_t G_) : R(R_), C(C_), G(G_) {
    const int64_t cap = capacity();
    width = C <= cap ? C : cap / G * G;
    rows_per = C <= cap ? cap / C : 1;
    per_row = (C + width - 1) / width;
    count = (R + rows_per - 1) / rows_per * per_row;
  }
  int64_t capacity() const { return std::max(kTile, G); }
};

struct Tile {
  int64_t r0, r1, c0, c1;
  int64_t offset(int64_t C) const { return r0 * C + c0; }
  int64_t numel() const { return (r1 - r0) * (c1 - c0); }
};

// Per-thread fp32 buffers of one tile: gradient, m, v, and 8 floats per FP8 group.
struct Scratch {
  std::vector<float> data;
  float *g, *m, *v, *groups;
  explicit Scratch(const Tiling& t) : data(3 * t.capacity() + 8 * ((t.capacity() + t.G - 1) / t.G)) {
    g = data.data();
    m = g + t.capacity();
    v = m + t.capacity();
    groups = v + t.capacity();
  }
};

Tile tile_at(const Tiling& t, int64_t i) {
  const int64_t r0 = i / t.per_row * t.rows_per, c0 = i % t.per_row * t.width;
  return {r0, std::min(t.R, r0 + t.rows_per), c0, std::min(t.C, c0 + t.width)};
}

// A tile's FP8 groups as runs of consecutive groups, whose codes and metadata are contiguous:
// one run when the tile holds whole rows of whole groups (so the per-row work, group constants
// and loop set-up, runs once per tile: -3% for rows of 1024 values), else one run per row. Run i
// starts at value at(i) of the parameter, value x0(i) of the tile's buffers and group meta(i) of
// the metadata, and holds `width` values.
struct GroupRuns {
  int64_t count, width, groups, at0, at_step, meta0, meta_step;
  GroupRuns(const Tiling& t, const Tile& tile) {
    const int64_t W = tile.c1 - tile.c0, rows = tile.r1 - tile.r0, per_row = (t.C + t.G - 1) / t.G;
    const bool whole = W == t.C && t.C % t.G == 0;
    count = whole ? 1 : rows;
    width = whole ? rows * W : W;
    groups = (width + t.G - 1) / t.G;
    at0 = tile.offset(t.C);
    at_step = t.C;
    meta0 = tile.r0 * per_row + tile.c0 / t.G;
    meta_step = per_row;
  }
  int64_t at(int64_t i) const { return at0 + i * at_step; }
  int64_t x0(int64_t i) const { return i * width; }
  int64_t meta(int64_t i) const { return meta0 + i * meta_step; }
};

// One FP8 moment of a tile, run by run, into fp32 x and back. tmp: 4 floats per group.
template <class F>
void fp8_decode(const Moment& s, const Tiling& t, const Tile& tile, float* x, float* tmp) {
  const GroupRuns runs(t, tile);
  float *inv_k = tmp, *bias = tmp + runs.groups;
  for (int64_t i = 0; i < runs.count; ++i) {
    const int64_t meta = runs.meta(i);
    decode_constants(s.scale + meta, s.k + meta, s.gm + meta, runs.groups, inv_k, bias);
    decode_row<F>(s.codes + runs.at(i), runs.width, t.G, runs.groups, inv_k, bias, x + runs.x0(i));
  }
}

// One run of an FP8 moment from fp32 x, its groups' ranges (mx, mn) known. bias: 1 float per group.
template <class F>
void encode_row(const Moment& s, int64_t meta, uint8_t* codes, const float* x, int64_t W, int64_t G,
                const float* mx, const float* mn, float* bias, bool nonnegative) {
  const int64_t groups = (W + G - 1) / G;
  encode_constants<F>(mx, mn, groups, s.scale + meta, s.k + meta, s.gm + meta, bias);
  for (int64_t j = 0; j < groups; ++j) {
    encode_group<F>(x + j * G, std::min(G, W - j * G), s.k[meta + j], bias[j], mn[j], codes + j * G, nonnegative);
  }
}

template <class F>
void fp8_encode(const Moment& s, const Tiling& t, const Tile& tile, const float* x, float* tmp, bool nonnegative) {
  const GroupRuns runs(t, tile);
  const int64_t W = runs.width, G = t.G, groups = runs.groups;
  float *bias = tmp + groups, *mx = tmp + 2 * groups, *mn = tmp + 3 * groups;
  for (int64_t i = 0; i < runs.count; ++i) {
    const float* xr = x + runs.x0(i);
    for (int64_t j = 0; j < groups; ++j) group_range(xr + j * G, std::min(G, W - j * G), mx + j, mn + j);
    encode_row<F>(s, runs.meta(i), s.codes + runs.at(i), xr, W, G, mx, mn, bias, nonnegative);
  }
}

// The tile's moment (any format but the pair) into fp32 x, and x back into it.
void decode_moment(const Moment& s, const Tiling& t, const Tile& tile, float* x, float* tmp) {
  const int64_t off = tile.offset(t.C), n = tile.numel();
  if (s.fmt == Fmt::kE4M3) {
    fp8_decode<E4M3>(s, t, tile, x, tmp);
  } else if (s.fmt == Fmt::kE5M2) {
    fp8_decode<E5M2>(s, t, tile, x, tmp);
  } else if (s.fmt == Fmt::kBF16) {
    for (int64_t i = 0; i < n; ++i) x[i] = bf16_to_float(s.hi[off + i]);
  } else {
    copy_floats(x, s.f32 + off, n);
  }
}

// nonnegative: x is +0 or positive (v: b2 v + (1 - b2) g^2 from +0 or positive values).
void encode_moment(const Moment& s, const Tiling& t, const Tile& tile, const float* x, float* tmp, bool nonnegative) {
  const int64_t off = tile.offset(t.C), n = tile.numel();
  if (s.fmt == Fmt::kE4M3) {
    fp8_encode<E4M3>(s, t, tile, x, tmp, nonnegative);
  } else if (s.fmt == Fmt::kE5M2) {
    fp8_encode<E5M2>(s, t, tile, x, tmp, nonnegative);
  } else if (s.fmt == Fmt::kBF16) {
    for (int64_t i = 0; i < n; ++i) s.hi[off + i] = float_to_bf16(x[i]);
  } else {
    copy_floats(s.f32 + off, x, n);
  }
}

// The weight update of one tile from m and v in fp32 (v is overwritten by sqrt(v) where the
// sqrt is not fused into the update).
void weights(const at::Tensor& param, const at::Tensor& lo, int64_t off, int64_t n, const float* m, float* v,
             bool ieee_sqrt, const Hyper& h) {
  if (lo.defined() && ieee_sqrt) {
    uint16_t *w = bf16_ptr(param) + off, *l = bf16_ptr(lo) + off;
    h.wd ? mcf_weights<true, true>(w, l, m, v, n, h) : mcf_weights<false, true>(w, l, m, v, n, h);
    return;
  }
  sqrt_inplace(v, n, ieee_sqrt);
  if (lo.defined()) {
    uint16_t *w = bf16_ptr(param) + off, *l = bf16_ptr(lo) + off;
    h.wd ? mcf_weights<true, false>(w, l, m, v, n, h) : mcf_weights<false, false>(w, l, m, v, n, h);
    return;
  }
  dispatch_float(param.scalar_type(), "param", [&](auto t) {
    auto* w = param.data_ptr<decltype(t)>() + off;
    h.wd ? native_weights<true>(w, m, v, n, h) : native_weights<false>(w, m, v, n, h);
  });
}

// ---------------------------------------------------------------------------- the step

struct Step {
  at::Tensor param, lo, grad;
  Moment m, v;
  Hyper h;
  Tiling tiling;
};

// FP8 m and v of one format: per run, decode, moment update and group ranges one group at a
// time, while the group is in L1 (as separate passes over the tile, the three streamed its
// buffers through L2), then both encodes. tmp: 8 floats per group.
template <class F, bool kSmallW, class T>
void fp8_moments_fused(const Step& s, const Tile& tile, const T* grad, float* xm, float* xv, float* tmp) {
  const GroupRuns runs(s.tiling, tile);
  const int64_t W = runs.width, G = s.tiling.G, groups = runs.groups;
  float* dm = tmp;  // decode: inv_k, bias of m, then of v; encode: bias
  float* dv = tmp + 2 * groups;
  float* rm = tmp + 4 * groups;  // ranges: mx, mn of m, then of v
  float* rv = tmp + 6 * groups;
  for (int64_t i = 0; i < runs.count; ++i) {
    const int64_t meta = runs.meta(i), at = runs.at(i), x0 = runs.x0(i);
    decode_constants(s.m.scale + meta, s.m.k + meta, s.m.gm + meta, groups, dm, dm + groups);
    decode_constants(s.v.scale + meta, s.v.k + meta, s.v.gm + meta, groups, dv, dv + groups);
    for (int64_t j0 = 0; j0 < groups; j0 += 8) {
      const int64_t j1 = std::min(groups, j0 + 8);
      const DecodeChunk<F> cm(dm + j0, dm + groups + j0, j1 - j0), cv(dv + j0, dv + groups + j0, j1 - j0);
      for (int64_t j = j0; j < j1; ++j) {
        const int64_t o = x0 + j * G, len = std::min(G, W - j * G);
        cm.decode(j - j0, s.m.codes + at + j * G, len, xm + o);
        cv.decode(j - j0, s.v.codes + at + j * G, len, xv + o);
        update_moments<kSmallW>(grad + o, xm + o, xv + o, len, s.h);
        group_range(xm + o, len, rm + j, rm + groups + j);
        group_range(xv + o, len, rv + j, rv + groups + j);
      }
    }
    encode_row<F>(s.m, meta, s.m.codes + at, xm + x0, W, G, rm, rm + groups, dm, false);
    encode_row<F>(s.v, meta, s.v.codes + at, xv + x0, W, G, rv, rv + groups, dv, true);
  }
}

void step_tile(const Step& s, const Tile& tile, const Scratch& b) {
  const int64_t off = tile.offset(s.tiling.C), n = tile.numel();
  if (s.v.fmt == Fmt::kPair) {  // the pair's update reads the gradient in fp32
    dispatch_float(s.grad.scalar_type(), "grad", [&](auto t) {
      load(s.grad.data_ptr<decltype(t)>() + off, n, b.g);
    });
    decode_moment(s.m, s.tiling, tile, b.m, b.groups);
    FirstMoment{s.h.lerp_w}(b.m, b.g, n);
    encode_moment(s.m, s.tiling, tile, b.m, b.groups, false);
    pair_second_moment(s.v.hi + off, s.v.lo + off, n, b.g, b.v, s.h);
  } else if (is_fp8(s.m.fmt) && s.v.fmt == s.m.fmt) {
    dispatch_float(s.grad.scalar_type(), "grad", [&](auto t) {
      const auto* g = s.grad.data_ptr<decltype(t)>() + off;
      const bool small = std::fabs(s.h.lerp_w) < 0.5f;
      if (s.m.fmt == Fmt::kE4M3) {
        small ? fp8_moments_fused<E4M3, true>(s, tile, g, b.m, b.v, b.groups)
              : fp8_moments_fused<E4M3, false>(s, tile, g, b.m, b.v, b.groups);
      } else {
        small ? fp8_moments_fused<E5M2, true>(s, tile, g, b.m, b.v, b.groups)
              : fp8_moments_fused<E5M2, false>(s, tile, g, b.m, b.v, b.groups);
      }
    });
  } else {
    decode_moment(s.m, s.tiling, tile, b.m, b.groups);
    decode_moment(s.v, s.tiling, tile, b.v, b.groups);
    dispatch_float(s.grad.scalar_type(), "grad", [&](auto t) {
      const auto* g = s.grad.data_ptr<decltype(t)>() + off;
      std::fabs(s.h.lerp_w) < 0.5f ? update_moments<true>(g, b.m, b.v, n, s.h)
                                   : update_moments<false>(g, b.m, b.v, n, s.h);
    });
    encode_moment(s.m, s.tiling, tile, b.m, b.groups, false);
    encode_moment(s.v, s.tiling, tile, b.v, b.groups, true);
  }
  weights(s.param, s.lo, off, n, b.m, b.v, is_fp8(s.m.fmt) || is_fp8(s.v.fmt), s.h);
}

void adamw_step(const at::Tensor& param, const std::optional<at::Tensor>& param_lo, const at::Tensor& grad,
                at::TensorList exp_avg, at::TensorList exp_avg_sq, c10::string_view m_format,
                c10::string_view v_format, double lr, double beta1, double beta2, double eps, double weight_decay,
                int64_t step, int64_t group_size) {
  TORCH_CHECK(param.dim() == 2, "adamw_step: param must be 2-D (rows x cols), got ", param.sizes());
  TORCH_CHECK(group_size >= 1, "adamw_step: group_size=", group_size, "; must be >= 1");
  const int64_t R = param.size(0), C = param.size(1);
  dispatch_float(param.scalar_type(), "param", [](auto) {});
  dispatch_float(grad.scalar_type(), "grad", [](auto) {});
  check_like(param, {R, C}, param.scalar_type(), "param");
  check_like(grad, {R, C}, grad.scalar_type(), "grad");
  at::Tensor lo;
  if (param_lo) {
    TORCH_CHECK(param.scalar_type() == at::kBFloat16, "adamw_step: an MCF master (param_lo) needs a bfloat16 param");
    check_like(*param_lo, {R, C}, at::kBFloat16, "param_lo");
    lo = *param_lo;
  }
  const Fmt fm = parse_format(m_format, "m_format");
  TORCH_CHECK(fm != Fmt::kPair, "adamw_step: m_format='pair' is not a layout of sdpq.optim.AdamW");
  const Moment m = make_moment(exp_avg, fm, R, C, group_size, "exp_avg");
  const Moment v = make_moment(exp_avg_sq, parse_format(v_format, "v_format"), R, C, group_size, "exp_avg_sq");
  if (R * C == 0) return;
  const Step s{param, lo, grad, m, v, make_hyper(lr, beta1, beta2, eps, weight_decay, step), Tiling(R, C, group_size)};
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / (s.tiling.rows_per * s.tiling.width));
  at::parallel_for(0, s.tiling.count, grain, [&](int64_t begin, int64_t end) {
    const Scratch buffers(s.tiling);
    for (int64_t i = begin; i < end; ++i) step_tile(s, tile_at(s.tiling, i), buffers);
  });
}

// adamw_step for each parameter of a list, in one call (a call through the dispatcher costs
// ~15 us, as much as the step of a parameter of ~4K values). exp_avg and exp_avg_sq hold every
// parameter's storage tensors one after the other, as many as its format takes; param_lo is
// empty (native masters) or holds one tensor per parameter.
void adamw_step_many(at::TensorList params, at::TensorList param_lo, at::TensorList grads, at::TensorList exp_avg,
                     at::TensorList exp_avg_sq, const c10::List<std::string>& m_formats,
                     const c10::List<std::string>& v_formats, double lr, double beta1, double beta2, double eps,
                     double weight_decay, at::IntArrayRef steps, int64_t group_size) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && m_formats.size() == n && v_formats.size() == n && steps.size() == n &&
                  (param_lo.empty() || param_lo.size() == n),
              "adamw_step_many: ", n, " params need as many grads, m_formats, v_formats and steps (got ", grads.size(),
              ", ", m_formats.size(), ", ", v_formats.size(), ", ", steps.size(), ") and 0 or ", n, " param_lo (got ",
              param_lo.size(), ")");
  size_t im = 0, iv = 0;
  for (size_t i = 0; i < n; ++i) {
    const std::string fm = m_formats[i], fv = v_formats[i];
    const size_t km = storage_count(parse_format(fm, "m_formats")), kv = storage_count(parse_format(fv, "v_formats"));
    TORCH_CHECK(im + km <= exp_avg.size() && iv + kv <= exp_avg_sq.size(), "adamw_step_many: parameter ", i,
                " needs more exp_avg / exp_avg_sq tensors than given for its formats");
    const std::optional<at::Tensor> lo = param_lo.empty() ? std::nullopt : std::optional<at::Tensor>(param_lo[i]);
    adamw_step(params[i], lo, grads[i], exp_avg.slice(im, km), exp_avg_sq.slice(iv, kv), fm, fv, lr, beta1, beta2, eps,
               weight_decay, steps[i], group_size);
    im += km;
    iv += kv;
  }
  TORCH_CHECK(im == exp_avg.size() && iv == exp_avg_sq.size(),
              "adamw_step_many: more exp_avg / exp_avg_sq tensors than the formats take");
}

}  // namespace
}  // namespace adamw
}  // namespace sdpq

TORCH_LIBRARY_IMPL(sdpq, CPU, m) {
  m.impl("adamw_step", &sdpq::adamw::adamw_step);
  m.impl("adamw_step_many", &sdpq::adamw::adamw_step_many);
}
