"""One fused AdamW step on FP8 (E4M3, COAT-expanded) moments and an MCF (bf16 pair) master.

Per group of ``G`` elements of one row, in registers: decode m and v (256-entry log2 table + the
group's k, gm, scale), m = lerp(m, g, 1 - b1), v = b2 v + (1 - b2) g^2, re-encode both with
fresh expansion metadata, then Grow the bf16 pair (w, lo) by -step_size m / (sqrt(v)/bc2 + eps)
- lr wd (w + lo). One read and one write of every state byte; the PyTorch path in
``sdpq.optim.adamw`` makes ~30 passes.

The formulas are ``sdpq.quant.fp8`` and ``sdpq.quant.mcf`` step for step, with IEEE division and
square root. Compiled for a GPU, log2 and exp2 are the approximate instructions
(``_tile.log2_approx`` / ``exp2_approx``, about 2^-22 of the result; CUDA's math library
spends ~25 instructions on a log2, and Triton links it with flush-to-zero). Every log2 and
exp2 here feeds an E4M3 code (3 mantissa bits) or a group's expansion metadata, so the results
agree with the reference within rounding, not bitwise (``benchmarks/log2_approx_effect.py``
measures how far; torch's CUDA kernels may also contract a multiply and an add, and the
interpreter's log2/exp2 are numpy's). On an H100 (sm_90) the
step issues 189 instructions an element, under the 204 that 0.8 of its bandwidth leaves
(279 with the math library's log2; tests/kernels/test_sm90_compile.py). fp32 -> E4M3 is the
conversion instruction on sm_89 and later, else encoded by hand (round to nearest even on the
fp32 bits): the interpreter has no fp8 and GPUs before sm_89 have no conversion instruction.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._launch import fp8_hw_for, launch, libdevice_for, num_warps, program_index
from ._tile import absmax, exp2_approx, log2_approx, round_half_even, to_bf16_rne

__all__ = ["adamw_fp8_mcf_step"]

_E4M3_MAX = 448.0
_LOG2_FMAX = math.log2(_E4M3_MAX)
_TABLES: dict = {}


def _e4m3_table(device: torch.device) -> torch.Tensor:
    """The fp32 value of every E4M3 code."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().to(device)


def _log2_table(device: torch.device) -> torch.Tensor:
    """log2 |value| of every E4M3 code, computed by torch on `device`: the numbers the PyTorch
    path's ``c.abs().log2()`` gives there (0 -> -inf, NaN -> NaN), one load instead of a log2."""
    if device not in _TABLES:
        _TABLES[device] = _e4m3_table(device).abs().log2()
    return _TABLES[device]


@triton.jit
def _encode_e4m3(x, LIBDEVICE: tl.constexpr, FP8_HW: tl.constexpr = False):
    """fp32 (|x| <= 448 or NaN) -> E4M3 code bits (int32 0..255), round to nearest even.
    FP8_HW (sm_89 and later): the conversion instruction, the same bits (it saturates, which
    |x| <= 448 never needs, and its NaN is 0x7F as here)."""
    if FP8_HW:
        return x.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True).to(tl.int32)
    a = tl.abs(x)
    bits = a.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    mant = bits & 0x7FFFFF
    r = mant >> 20
    rem = mant & 0xFFFFF
    up = (rem > 0x80000) | ((rem == 0x80000) & ((r & 1) == 1))
    normal = ((e + 7) << 3) + r + up.to(tl.int32)
    sub = round_half_even(a * 512.0, LIBDEVICE).to(tl.int32)  # below 2^-6: steps of 2^-9 (8 = the first normal)
    code = tl.where(e < -6, sub, normal)
    code = tl.where(x.to(tl.int32, bitcast=True) < 0, code | 0x80, code)  # the sign bit: -0.0 too
    return tl.where(x != x, 0x7F, code)


@triton.jit
def _decode_group(codes_ptr, s_ptr, k_ptr, gm_ptr, log2_ptr, offs, m, goffs, gmask, LIBDEVICE: tl.constexpr):
    """The fp32 values of one moment's groups (codes decoded through the group's s, k, gm)."""
    s = tl.load(s_ptr + goffs, mask=gmask, other=0.0)
    k = tl.load(k_ptr + goffs, mask=gmask, other=1.0)
    gm = tl.load(gm_ptr + goffs, mask=gmask, other=1.0)
    code = tl.load(codes_ptr + offs, mask=m, other=0).to(tl.int32)
    inv_k = tl.math.div_rn(tl.full(k.shape, 1.0, tl.float32), k)  # torch's reciprocal: IEEE
    bias = log2_approx(s, LIBDEVICE) * inv_k + log2_approx(gm, LIBDEVICE)
    bias = tl.where(tl.abs(s) < float("inf"), bias, float("nan"))
    y = exp2_approx(tl.load(log2_ptr + code) * inv_k[:, None] + bias[:, None], LIBDEVICE)
    return tl.where(code >= 0x80, -y, y)  # copysign: the code's sign bit


@triton.jit
def _encode_group(
    x, codes_ptr, s_ptr, k_ptr, gm_ptr, offs, m, goffs, gm_mask,
    FMAX: tl.constexpr, LOG2_FMAX: tl.constexpr, LIBDEVICE: tl.constexpr, FP8_HW: tl.constexpr,
):  # fmt: skip
    a = tl.abs(x)
    mx = absmax(x, LIBDEVICE)
    bad = ~(mx < float("inf"))  # NaN or inf
    mn = tl.min(tl.where(a > 0, a, float("inf")), axis=1)
    empty = (mx == 0) | bad
    lmx = log2_approx(tl.where(empty, 1.0, mx), LIBDEVICE)
    lmn = log2_approx(tl.where(empty, 1.0, mn), LIBDEVICE)
    log_r = lmx - lmn
    # torch's float / tensor is reciprocal(tensor) * float: the same two roundings here
    inv_r = tl.math.div_rn(tl.full(log_r.shape, 1.0, tl.float32), tl.where(log_r > 0, log_r, 1.0))
    k = tl.floor(inv_r * (16 * (2 * LOG2_FMAX - 1))) * 0.0625  # / 16, exact
    k = tl.minimum(tl.maximum(tl.where(log_r > 0, k, 1.0), 1.0 / 16), 65536.0)
    gm = exp2_approx(0.5 * (lmx + lmn), LIBDEVICE)
    lgm = log2_approx(gm, LIBDEVICE)
    s = exp2_approx(k * (lmx - lgm) - LOG2_FMAX, LIBDEVICE)
    bias = tl.where(bad, float("nan"), -(k * lgm + log2_approx(s, LIBDEVICE)))
    mag = exp2_approx(log2_approx(a, LIBDEVICE) * k[:, None] + bias[:, None], LIBDEVICE)
    mag = tl.minimum(mag, FMAX, propagate_nan=tl.PropagateNan.ALL)  # a NaN group's codes stay NaN
    sign = x.to(tl.int32, bitcast=True) < 0  # copysign, as the reference (-0.0 keeps its sign)
    code = _encode_e4m3(tl.where(sign, -mag, mag), LIBDEVICE, FP8_HW)
    tl.store(codes_ptr + offs, code.to(tl.uint8), mask=m)
    tl.store(s_ptr + goffs, tl.where(bad, float("nan"), s), mask=gm_mask)
    tl.store(k_ptr + goffs, k, mask=gm_mask)
    tl.store(gm_ptr + goffs, gm, mask=gm_mask)


@triton.jit
def _div_by_scalar(a, b):
    """a / b correctly rounded (IEEE division, as torch) for a >= 0 and b in [2^-60, 1] (the bias
    correction sqrt(1 - b2^t): 1 / b stays far from overflow): one division per program, then
    Markstein's correction per element (see _tile.div_by_group). An infinite or NaN a passes
    through as a * (1 / b), the quotient's value."""
    y = tl.math.div_rn(1.0, b)
    q = a * y
    r = tl.fma(-q, tl.full(a.shape, b, tl.float32), a)
    return tl.where(r == r, tl.fma(r, tl.full(a.shape, y, tl.float32), q), q)


@triton.jit
def _adamw_kernel(
    w_ptr,
    lo_ptr,
    g_ptr,
    log2_ptr,
    mc_ptr,
    ms_ptr,
    mk_ptr,
    mg_ptr,
    vc_ptr,
    vs_ptr,
    vk_ptr,
    vg_ptr,
    n_cols,
    n_groups,
    tiles_per_row,
    one_minus_b1,
    b2,
    one_minus_b2,
    bc2_sqrt,
    eps,
    step_size,
    lr_wd,
    G: tl.constexpr,
    GPB: tl.constexpr,
    FMAX: tl.constexpr,
    LOG2_FMAX: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    FP8_HW: tl.constexpr,
):
    p = program_index()  # int64: row * n_cols may pass 2^31
    row = p // tiles_per_row
    grp = (p % tiles_per_row) * GPB + tl.arange(0, GPB)
    gmask = grp < n_groups
    col = grp[:, None] * G + tl.arange(0, G)[None, :]
    m = gmask[:, None] & (col < n_cols)
    offs = row * n_cols + col
    goffs = row * n_groups + grp
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    # First moment: decode, lerp (torch's formula for weights < 0.5), re-encode.
    ma = _decode_group(mc_ptr, ms_ptr, mk_ptr, mg_ptr, log2_ptr, offs, m, goffs, gmask, LIBDEVICE)
    ma = ma + one_minus_b1 * (g - ma)
    ma = tl.where(m, ma, 0.0)
    _encode_group(ma, mc_ptr, ms_ptr, mk_ptr, mg_ptr, offs, m, goffs, gmask, FMAX, LOG2_FMAX, LIBDEVICE, FP8_HW)
    # Second moment.
    va = _decode_group(vc_ptr, vs_ptr, vk_ptr, vg_ptr, log2_ptr, offs, m, goffs, gmask, LIBDEVICE)
    va = va * b2 + one_minus_b2 * g * g  # addcmul's order: (value * g) * g
    va = tl.where(m, va, 0.0)
    _encode_group(va, vc_ptr, vs_ptr, vk_ptr, vg_ptr, offs, m, goffs, gmask, FMAX, LOG2_FMAX, LIBDEVICE, FP8_HW)
    # MCF master: one Grow of (w, lo) by the decay and the Adam step together.
    # IEEE sqrt and division, as torch (tl.sqrt and / may compile to approximations)
    denom = _div_by_scalar(tl.sqrt_rn(va), bc2_sqrt) + eps
    h = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    lo = tl.load(lo_ptr + offs, mask=m, other=0.0).to(tl.float32)
    d = tl.math.div_rn(ma, denom) * (-step_size) + (h + lo) * (-lr_wd)
    s = to_bf16_rne(h + d, LIBDEVICE, TORCH_NAN=False).to(tl.float32)
    lo1 = to_bf16_rne(lo + (d - (s - h)), LIBDEVICE, TORCH_NAN=False).to(tl.float32)
    hi_new = to_bf16_rne(s + lo1, LIBDEVICE)
    lo_new = to_bf16_rne(lo1 - (hi_new.to(tl.float32) - s), LIBDEVICE)
    tl.store(w_ptr + offs, hi_new, mask=m)
    tl.store(lo_ptr + offs, lo_new, mask=m)


def adamw_fp8_mcf_step(
    w: torch.Tensor,
    lo: torch.Tensor,
    grad: torch.Tensor,
    m_state: tuple,
    v_state: tuple,
    *,
    lr: float,
    b1: float,
    b2: float,
    eps: float,
    wd: float,
    step: int,
    group_size: int,
) -> None:
    """In place. w, lo: bf16 [rows, cols]; grad [rows, cols] (any float); m_state/v_state: (codes
    uint8 [rows, cols], scale, k, gm fp32 [rows, groups]) of E4M3 expanded moments."""
    rows, cols = w.shape
    G = group_size
    n_groups = -(-cols // G)
    gpb = max(1, min(triton.next_power_of_2(n_groups), max(1, 2048 // G)))
    tiles_per_row = triton.cdiv(n_groups, gpb)
    launch(
        _adamw_kernel,
        (tiles_per_row * rows,),  # flat: rows on a second axis would be capped at 65535
        w,
        lo,
        grad,
        _log2_table(w.device),
        *m_state,
        *v_state,
        cols,
        n_groups,
        tiles_per_row,
        1.0 - b1,
        b2,
        1.0 - b2,
        (1.0 - b2**step) ** 0.5,
        eps,
        lr / (1.0 - b1**step),
        lr * wd,
        G=G,
        GPB=gpb,
        FMAX=_E4M3_MAX,
        LOG2_FMAX=_LOG2_FMAX,
        LIBDEVICE=libdevice_for(w),
        FP8_HW=fp8_hw_for(w),
        num_warps=num_warps(gpb * G, per_warp=256),
    )
