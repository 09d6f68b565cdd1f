"""Fused Triton kernels of the wire codec: each reads its inputs once and writes its outputs once.

    encode_rows   [difference against a reference] [randomized Hadamard] group quantize + pack
    decode_rows   unpack + dequantize [+ add into a reference, in place]
    reduce_rows   (``codec_reduce``) unpack + dequantize every received row, sum them, then
                  [inverse Hadamard] -> fp32, or re-quantize + pack for the next stage

One program handles a tile of ``TILE`` contiguous elements of one row; TILE is a multiple of
every group size and Hadamard block involved, so groups and blocks never straddle programs.
The layouts are those of ``sdpq.quant.wire`` (codes, then little-endian scales); the math is
that of ``sdpq.quant`` step for step (see ``_tile``), so results are bitwise equal to the
PyTorch reference with nearest rounding. Stochastic rounding draws from Triton's Philox stream
(``tl.randint4x``, eight 16-bit draws per call), not torch's generator: unbiased as the
reference to within 2^-16 of a step (``_tile.uniform_tile``), not the same draws.

Note: "segmented" rows. The gradient reduce-scatter quantizes rows that are concatenations of
``segments`` input rows (row l of the wire buffer = input rows l, l + P, l + 2P, ...); the
kernels address input row r as segment r // P of output row r % P, so no gather copy is made.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._launch import launch, libdevice_for, num_warps, program_index, spec_constexprs, tile_elements
from ._tile import SHUFFLE_MAX_BLOCK, fwht, load_groups, opaque_copy, run_counters, store_groups, to_bf16_rne
from .codec_reduce import reduce_rows

__all__ = ["encode_rows", "decode_rows", "reduce_rows"]


@triton.jit
def _encode_kernel(
    x_ptr,
    x_stride,
    ref_ptr,
    ref_stride,
    out_ptr,
    out_stride,
    own_ptr,
    signs_ptr,
    flag_ptr,
    n,
    tiles_per_row,
    P,
    own_row,
    code_bytes,
    seed,
    TILE: tl.constexpr,
    G: tl.constexpr,
    BITS: tl.constexpr,
    QMAX: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    SCALE_BF16: tl.constexpr,
    HAS_REF: tl.constexpr,
    HB: tl.constexpr,
    LOG2HB: tl.constexpr,
    WRITE_OWN: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    p = program_index()  # int64: row offsets (r * stride) may pass 2^31
    r = p // tiles_per_row
    t = p % tiles_per_row
    col = t * TILE + tl.arange(0, TILE)
    m = col < n
    v = tl.load(x_ptr + r * x_stride + col, mask=m, other=0.0).to(tl.float32)
    if HAS_REF:
        v = v - tl.load(ref_ptr + r * ref_stride + col, mask=m, other=0.0).to(tl.float32)
    if HB > 1:  # H D v / HB per block of HB (as the reference)
        v = v * (tl.load(signs_ptr + (col % HB)) * (1.0 / HB))  # D / HB: exact, a power of two
        v = opaque_copy(tl.reshape(fwht(tl.reshape(v, [TILE // HB, HB]), HB, LOG2HB), [TILE]), LIBDEVICE)
    seg = r // P
    if WRITE_OWN:
        if r % P == own_row:
            tl.store(own_ptr + seg * n + col, v, mask=m)
    NG: tl.constexpr = TILE // G
    vg = tl.reshape(v, [NG, G])
    groups = t * NG + tl.arange(0, NG)
    gmask = groups * G < n
    c8 = run_counters(p, NG, G)
    og = seg * tl.cdiv(n, G) + groups  # group index inside the (segmented) output row
    row_ptr = out_ptr + (r % P) * out_stride
    store_groups(
        vg, row_ptr, code_bytes, og, gmask, c8, seed, flag_ptr, G, BITS, QMAX, STOCHASTIC, SCALE_BF16, LIBDEVICE
    )


@triton.jit
def _decode_kernel(
    buf_ptr,
    buf_stride,
    out_ptr,
    out_stride,
    n,
    tiles_per_row,
    code_bytes,
    TILE: tl.constexpr,
    G: tl.constexpr,
    BITS: tl.constexpr,
    SCALE_BF16: tl.constexpr,
    ADD: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    p = program_index()
    r = p // tiles_per_row
    t = p % tiles_per_row
    NG: tl.constexpr = TILE // G
    groups = t * NG + tl.arange(0, NG)
    gmask = groups * G < n
    vals = load_groups(buf_ptr + r * buf_stride, code_bytes, groups, gmask, G, BITS, SCALE_BF16)
    col = t * TILE + tl.arange(0, TILE)
    m = col < n
    v = tl.reshape(vals, [TILE])
    dst = out_ptr + r * out_stride + col
    if ADD:
        v = tl.load(dst, mask=m, other=0.0).to(tl.float32) + v
    if out_ptr.dtype.element_ty == tl.bfloat16:
        tl.store(dst, to_bf16_rne(v, LIBDEVICE), mask=m)
    else:
        tl.store(dst, v.to(out_ptr.dtype.element_ty), mask=m)


def encode_rows(
    x: torch.Tensor,
    spec,
    *,
    ref: torch.Tensor | None = None,
    segments: int = 1,
    hadamard: tuple[int, torch.Tensor] | None = None,
    own_row: int | None = None,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """x [R, n] (row stride free, unit column stride) -> (wire [R / segments, wire_bytes(segments * n)],
    own fp32 [segments, n] = the (transformed) values of rows r with r % P == own_row, or None,
    count of non-finite groups (int32 [1]))."""
    R, n = x.shape
    P = R // segments
    if segments > 1 and n % spec.group_size:
        raise ValueError(f"encode_rows: segmented rows need n ({n}) to be a multiple of the group size")
    hb, signs = hadamard if hadamard is not None else (1, x.new_ones(1, dtype=torch.float32))
    # Note: the encode with shuffled Hadamard butterflies takes 32 elements a thread (the others
    # 16): its per-program work (the flat index's division, the signs, the scales of four
    # groups a warp) then spreads over twice the elements; 2^20 elements of bf16 gradients:
    # 70 -> 62 instructions an element on sm_90, where 0.8 of an H100's bandwidth leaves 63.
    shuffled = 1 < hb <= SHUFFLE_MAX_BLOCK.value
    tile = tile_elements(n, spec.group_size, hb, target=4096 if shuffled else 2048)
    row_numel = segments * n
    out = torch.empty((P, spec.wire_bytes(row_numel)), dtype=torch.uint8, device=x.device)
    own = torch.empty((segments, n), dtype=torch.float32, device=x.device) if own_row is not None else None
    flag = torch.zeros(1, dtype=torch.int32, device=x.device)
    ref_t = ref if ref is not None else x
    tiles_per_row = triton.cdiv(n, tile)
    launch(
        _encode_kernel,
        (tiles_per_row * R,),
        x,
        x.stride(0),
        ref_t,
        ref_t.stride(0),
        out,
        out.stride(0),
        own if own is not None else flag,
        signs,
        flag,
        n,
        tiles_per_row,
        P,
        -1 if own_row is None else own_row,
        spec.code_bytes(row_numel),
        seed,
        TILE=tile,
        QMAX=spec.qmax,
        STOCHASTIC=spec.rounding == "stochastic",
        HAS_REF=ref is not None,
        HB=hb,
        LOG2HB=int(math.log2(hb)),
        WRITE_OWN=own is not None,
        LIBDEVICE=libdevice_for(x),
        num_warps=num_warps(tile, per_warp=1024 if shuffled else 512),
        **spec_constexprs(spec),
    )
    return out, own, flag


def decode_rows(buf: torch.Tensor, spec, numel: int, out: torch.Tensor, *, add: bool = False) -> torch.Tensor:
    """wire rows [R, wire_bytes(numel)] -> out [R, numel] (any float dtype; out += values if add)."""
    R = buf.shape[0]
    tile = tile_elements(numel, spec.group_size)
    tiles_per_row = triton.cdiv(numel, tile)
    launch(
        _decode_kernel,
        (tiles_per_row * R,),
        buf,
        buf.stride(0),
        out,
        out.stride(0),
        numel,
        tiles_per_row,
        spec.code_bytes(numel),
        TILE=tile,
        ADD=add,
        LIBDEVICE=libdevice_for(buf),
        num_warps=num_warps(tile),
        **spec_constexprs(spec),
    )
    return out
