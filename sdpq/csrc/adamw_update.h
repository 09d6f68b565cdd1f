// The per-element arithmetic of one step of the fused AdamW (adamw.cpp): the step's scalars,
// the moment updates, Collage's Grow and the weight updates, each the reference's operations
// (sdpq/optim/adamw.py, sdpq/quant/mcf.py) in fp32 and in the same order, but for the MCF
// weight step with FP8 states, which takes one division instead of two (see mcf_weights).
#pragma once

#include <ATen/ATen.h>
#include <ATen/ops/sqrt_cpu_dispatch.h>

#include "adamw_math.h"
#include "mcf_avx2.h"

namespace sdpq {
namespace adamw {
namespace {

// The step's scalars, rounded to fp32 exactly where the reference's tensor operations round
// its Python floats (computed in double first, as Python does).
struct Hyper {
  float lerp_w;                // m.lerp_(g, 1 - b1)
  float b2, c2;                // v.mul_(b2).addcmul_(g, g, value=1 - b2)
  float b2_hi, b2_lo, b2_sum;  // mcf.split_scalar(b2) and b2_hi + b2_lo (pair v)
  float bc2, eps, neg_step;    // denom = sqrt(v) / bc2 + eps; step = -step_size m / denom
  float eps_bc2, neg_step_bc2; // the same times bc2 (FP8 states): step = (-step_size bc2 m) / (sqrt(v) + eps bc2)
  float decay, neg_lr_wd;      // native: w (1 - lr wd); MCF: + (w + lo) (-lr wd)
  bool wd;
};

Hyper make_hyper(double lr, double b1, double b2, double eps, double wd, int64_t step) {
  const double t = static_cast<double>(step);
  const double step_size = lr / (1 - std::pow(b1, t));
  const double bc2 = std::pow(1 - std::pow(b2, t), 0.5);
  const float b2f = static_cast<float>(b2);
  const float hi = round_bf16(b2f), lo = b2f - hi;
  return {static_cast<float>(1 - b1), b2f, static_cast<float>(1 - b2), hi, lo,
          static_cast<float>(static_cast<double>(hi) + lo), static_cast<float>(bc2), static_cast<float>(eps),
          static_cast<float>(-step_size), static_cast<float>(eps * bc2), static_cast<float>(-step_size * bc2),
          static_cast<float>(1 - lr * wd), static_cast<float>(-lr * wd), wd != 0};
}

// ---------------------------------------------------------------------------- element types

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return bf16_to_float(x.x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

template <class T>
inline T from_float(float x) { return T(x); }
template <>
inline c10::BFloat16 from_float(float x) { return c10::BFloat16(float_to_bf16(x), c10::BFloat16::from_bits()); }

template <class T>
void load(const T* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

// fn(T{}) for the element type of a float32 / bfloat16 / float16 tensor.
template <class Fn>
void dispatch_float(at::ScalarType t, const char* what, const Fn& fn) {
  switch (t) {
    case at::kFloat:
      return fn(float{});
    case at::kBFloat16:
      return fn(c10::BFloat16{});
    case at::kHalf:
      return fn(c10::Half{});
    default:
      TORCH_CHECK(false, "adamw_step: ", what, " has dtype ", t, "; allowed: float32, bfloat16, float16");
  }
}

// ---------------------------------------------------------------------------- moment updates

struct FirstMoment {  // m.lerp_(g, w): torch's formula for w < 0.5 and for w >= 0.5
  float w;
  void operator()(float* x, const float* g, int64_t n) const {
    if (std::fabs(w) < 0.5f) {
      for (int64_t i = 0; i < n; ++i) x[i] = fmadd(w, g[i] - x[i], x[i]);
    } else {
      const float c = w - 1.0f;
      for (int64_t i = 0; i < n; ++i) x[i] = fmadd(c, g[i] - x[i], g[i]);
    }
  }
};

// Both moment updates in one pass over the gradient, read in its own dtype: m as FirstMoment,
// v.mul_(b2).addcmul_(g, g, value=c2) for v (two passes less than converting the gradient first
// and updating each moment in turn).
template <bool kSmallW, class T>
void update_moments(const T* grad, float* m, float* v, int64_t n, const Hyper& h) {
  const float w = kSmallW ? h.lerp_w : h.lerp_w - 1.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float g = to_float(grad[i]);
    m[i] = kSmallW ? fmadd(w, g - m[i], m[i]) : fmadd(w, g - m[i], g);
    v[i] = fmadd(h.c2 * g, g, v[i] * h.b2);
  }
}

struct Bf16Pair {
  uint16_t hi, lo;
};

// Collage Grow (mcf.grow_): (h, l) += d, the rounding error of hi kept in lo. Any NaN or inf
// along the way makes both outputs NaN, as in the reference: only they need the NaN test.
SDPQ_ADAMW_INLINE Bf16Pair grow(float h, float l, float d) {
  const float s = round_bf16_unchecked(h + d);
  const float l1 = round_bf16_unchecked(l + (d - (s - h)));
  const float hi = round_bf16(s + l1);
  return {static_cast<uint16_t>(bits_of(hi) >> 16), float_to_bf16(l1 - (hi - s))};
}

// v as an MCF pair: mcf.mul_ by (b2_hi + b2_lo) with the product error kept, then mcf.grow_ by
// (1 - b2) g^2; x = hi + lo.
void pair_second_moment(uint16_t* hi, uint16_t* lo, int64_t n, const float* g, float* x, const Hyper& h) {
  for (int64_t i = 0; i < n; ++i) {
    const float vh = bf16_to_float(hi[i]), vl = bf16_to_float(lo[i]);
    const float p = vh * h.b2_hi + (vh * h.b2_lo + vl * h.b2_sum);
    const float ph = round_bf16_unchecked(p);
    const Bf16Pair q = grow(ph, round_bf16_unchecked(p - ph), (g[i] * g[i]) * h.c2);
    hi[i] = q.hi;
    lo[i] = q.lo;
    x[i] = bf16_to_float(q.hi) + bf16_to_float(q.lo);
  }
}

// sqrt(v) in place. With FP8 states the step cannot match the reference bitwise anyway, and the
// IEEE sqrt is both exact and fast; otherwise torch's own sqrt, which on MKL builds is not the
// correctly rounded one, so that fp32 / bf16 states match the reference (and fp32 ones
// torch.optim.AdamW) bitwise.
void sqrt_inplace(float* v, int64_t n, bool ieee) {
  if (ieee) {
    for (int64_t i = 0; i < n; ++i) v[i] = std::sqrt(v[i]);
    return;
  }
  at::Tensor t = at::from_blob(v, {n}, at::TensorOptions().dtype(at::kFloat));
  at::cpu::sqrt_(t);
}

// ---------------------------------------------------------------------------- weights

// Native master: w.mul_(1 - lr wd) (when wd != 0); w.addcdiv_(m, denom, value=-step_size).
template <bool kDecay, class T>
void native_weights(T* w, const float* m, const float* sq, int64_t n, const Hyper& h) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = kDecay ? to_float(w[i]) * h.decay : to_float(w[i]);
    const float denom = sq[i] / h.bc2 + h.eps;
    w[i] = from_float<T>(x + (h.neg_step * m[i]) / denom);
  }
}

// MCF master: one Grow of (w, lo) by -step_size m / denom [- lr wd (w + lo)].
// kFp8 (FP8 states, whose step differs from the reference's anyway): v holds the second moment,
// its IEEE sqrt is taken here, and the step is (-step_size bc2 m) / (sqrt(v) + eps bc2), one
// division instead of two (-15% in this loop: the divider is its busiest unit). Otherwise v
// holds sqrt(v) and the step is the reference's (m / (sqrt(v) / bc2 + eps)) (-step_size), bitwise.
template <bool kDecay, bool kFp8>
void mcf_weights(uint16_t* w, uint16_t* lo, const float* m, const float* v, int64_t n, const Hyper& h) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  i = kFp8 ? mcf_weights_avx2<kDecay, true>(w, lo, m, v, n, {0.0f, h.eps_bc2, h.neg_step_bc2, h.neg_lr_wd})
           : mcf_weights_avx2<kDecay, false>(w, lo, m, v, n, {h.bc2, h.eps, h.neg_step, h.neg_lr_wd});
#endif
  for (; i < n; ++i) {
    const float hi = bf16_to_float(w[i]), l = bf16_to_float(lo[i]);
    const float d = kFp8 ? (m[i] * h.neg_step_bc2) / (std::sqrt(v[i]) + h.eps_bc2)
                         : (m[i] / (v[i] / h.bc2 + h.eps)) * h.neg_step;
    const Bf16Pair q = grow(hi, l, kDecay ? fmadd(hi + l, h.neg_lr_wd, d) : d);
    w[i] = q.hi;
    lo[i] = q.lo;
  }
}

}  // namespace
}  // namespace adamw
}  // namespace sdpq
