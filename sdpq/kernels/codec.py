"""Fused Triton kernels of the wire codec: each reads its inputs once and writes its outputs once.

    encode_rows   [difference against a reference] [randomized Hadamard] group quantize + pack
    decode_rows   unpack + dequantize [+ add into a reference, in place]
    reduce_rows   unpack + dequantize every received row, sum them (one row replaced by this
                  rank's exact values) then either [inverse Hadamard] -> fp32, or re-quantize +
                  pack for the next stage

One program handles a tile of ``TILE`` contiguous elements of one row; TILE is a multiple of
every group size and Hadamard block involved, so groups and blocks never straddle programs.
The layouts are those of ``sdpq.quant.wire`` (codes, then little-endian scales); the math is
that of ``sdpq.quant`` step for step (see ``_tile``), so results are bitwise equal to the
PyTorch reference with nearest rounding. Stochastic rounding draws from Triton's Philox stream
(``tl.randint4x``, eight 16-bit draws per call), not torch's generator: unbiased as the reference, not the
same draws.

Note: "segmented" rows. The gradient reduce-scatter quantizes rows that are concatenations of
``segments`` input rows (row l of the wire buffer = input rows l, l + P, l + 2P, ...); the
kernels address input row r as segment r // P of output row r % P, so no gather copy is made.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._launch import launch, libdevice_for, num_warps, program_index
from ._tile import (
    SHUFFLE_MAX_BLOCK,
    anchor,
    dequantize_tile,
    fwht,
    group_scales,
    load_codes,
    load_scales,
    quantize_tile,
    store_codes,
    store_scales,
    to_bf16_rne,
)

__all__ = ["encode_rows", "decode_rows", "reduce_rows"]


@triton.jit
def _store_groups(vg, row_ptr, code_bytes, groups, gmask, c8, seed, flag_ptr,
                  G: tl.constexpr, BITS: tl.constexpr, QMAX: tl.constexpr, STOCHASTIC: tl.constexpr,
                  SCALE_BF16: tl.constexpr, LIBDEVICE: tl.constexpr):  # fmt: skip
    """Quantize the [groups, G] values vg into a wire row (codes, then scales) and count the
    groups that held inf/NaN into flag_ptr. c8: the random stream's counters (one per eight elements)."""
    s, finite = group_scales(vg, QMAX, SCALE_BF16, LIBDEVICE)
    codes = quantize_tile(vg, s, finite, c8, seed, QMAX, STOCHASTIC, LIBDEVICE)
    store_codes(row_ptr, codes, groups, G, BITS, gmask)
    store_scales(row_ptr + code_bytes, s, groups, SCALE_BF16, gmask)
    bad = tl.sum((gmask & ~finite).to(tl.int32))
    if bad > 0:  # Note: a relaxed atomic, and none at all (no fence) in the common all-finite tile
        tl.atomic_add(flag_ptr, bad, sem="relaxed")


@triton.jit
def _load_groups(row_ptr, code_bytes, groups, gmask, G: tl.constexpr, BITS: tl.constexpr, SCALE_BF16: tl.constexpr):
    """The dequantized [groups, G] values of a wire row."""
    return dequantize_tile(
        load_codes(row_ptr, groups, G, BITS, gmask), load_scales(row_ptr + code_bytes, groups, SCALE_BF16, gmask)
    )


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
        v = anchor(tl.reshape(fwht(tl.reshape(v, [TILE // HB, HB]), HB, LOG2HB), [TILE]), LIBDEVICE)
    seg = r // P
    if WRITE_OWN:
        if r % P == own_row:
            tl.store(own_ptr + seg * n + col, v, mask=m)
    NG: tl.constexpr = TILE // G
    vg = tl.reshape(v, [NG, G])
    groups = t * NG + tl.arange(0, NG)
    gmask = groups * G < n
    # Note: the random stream's counter is the position of the element's run of eight modulo
    # 2^32 (int32, as the fast 32-bit Philox takes it): draws repeat only 2^35 elements apart.
    c8 = (p * (TILE // 8) + tl.reshape(tl.arange(0, TILE // 8), [NG, G // 8])).to(tl.int32)
    og = seg * tl.cdiv(n, G) + groups  # group index inside the (segmented) output row
    row_ptr = out_ptr + (r % P) * out_stride
    _store_groups(
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
    vals = _load_groups(buf_ptr + r * buf_stride, code_bytes, groups, gmask, G, BITS, SCALE_BF16)
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


@triton.jit
def _sum_rows(
    buf_ptr,
    buf_stride,
    rows,
    own_ptr,
    own_row,
    code_bytes,
    col,
    m,
    groups,
    gmask,
    TILE: tl.constexpr,
    G: tl.constexpr,
    BITS: tl.constexpr,
    SCALE_BF16: tl.constexpr,
):
    """The sum of the received rows' tile, row own_row replaced by this rank's exact values."""
    acc = tl.zeros([TILE], tl.float32)
    row_ptr = buf_ptr  # advanced by one stride per row: 64-bit pointer arithmetic, never k * stride
    for k in range(rows):  # the same order as the reference's sum over dim 0
        if k == own_row:  # this rank's own contribution is exact, its wire row is never read
            part = tl.load(own_ptr + col, mask=m, other=0.0)
        else:
            vals = _load_groups(row_ptr, code_bytes, groups, gmask, G, BITS, SCALE_BF16)
            part = tl.reshape(vals, [TILE])
        acc += part
        row_ptr += buf_stride
    return acc


@triton.jit
def _reduce_kernel(
    buf_ptr,
    buf_stride,
    rows,
    own_ptr,
    own_row,
    bad_ptr,
    n,
    code_bytes,
    out_ptr,
    signs_ptr,
    enc_ptr,
    enc_stride,
    enc_n,
    enc_code_bytes,
    own_out_ptr,
    own_seg,
    flag_ptr,
    seed,
    TILE: tl.constexpr,
    G: tl.constexpr,
    BITS: tl.constexpr,
    SCALE_BF16: tl.constexpr,
    HB: tl.constexpr,
    LOG2HB: tl.constexpr,
    ENCODE: tl.constexpr,
    G2: tl.constexpr,
    BITS2: tl.constexpr,
    QMAX2: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    SCALE2_BF16: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    t = program_index()
    NG: tl.constexpr = TILE // G
    groups = t * NG + tl.arange(0, NG)
    gmask = groups * G < n
    col = t * TILE + tl.arange(0, TILE)
    m = col < n
    acc = _sum_rows(
        buf_ptr, buf_stride, rows, own_ptr, own_row, code_bytes, col, m, groups, gmask, TILE, G, BITS, SCALE_BF16
    )
    acc = acc + tl.load(bad_ptr)  # 0.0, or NaN when the sender side saw a non-finite group
    if ENCODE:  # re-quantize: output row = col // enc_n (each enc_n a multiple of TILE)
        e_row = (t * TILE) // enc_n
        if e_row == own_seg:
            tl.store(own_out_ptr + (col - e_row * enc_n), acc, mask=m)
        NG2: tl.constexpr = TILE // G2
        vg = tl.reshape(acc, [NG2, G2])
        groups2 = (t * TILE - e_row * enc_n) // G2 + tl.arange(0, NG2)
        g2mask = groups2 * G2 < enc_n
        _store_groups(
            vg, enc_ptr + e_row * enc_stride, enc_code_bytes, groups2, g2mask,
            tl.reshape(t * (TILE // 8) + tl.arange(0, TILE // 8), [NG2, G2 // 8]).to(tl.int32), seed,
            flag_ptr, G2, BITS2, QMAX2, STOCHASTIC, SCALE2_BF16, LIBDEVICE,
        )  # fmt: skip
    else:
        if HB > 1:  # D H y: butterflies, then the signs (as the reference)
            acc = tl.reshape(fwht(tl.reshape(acc, [TILE // HB, HB]), HB, LOG2HB), [TILE])
            acc = acc * tl.load(signs_ptr + (col % HB))
        tl.store(out_ptr + col, acc, mask=m)


def _tile(n: int, *sizes: int, target: int = 2048) -> int:
    """Elements per program: a power of two, a multiple of every group/block size, ~target."""
    lcm = max(sizes)  # all sizes are powers of two
    return max(lcm, min(target, triton.next_power_of_2(max(n, 1))))


def _spec_args(spec) -> dict:
    return dict(G=spec.group_size, BITS=spec.bits, SCALE_BF16=spec.scale_dtype == torch.bfloat16)


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
    wide = 1 < hb <= SHUFFLE_MAX_BLOCK.value
    tile = _tile(n, spec.group_size, hb, target=4096 if wide else 2048)
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
        num_warps=num_warps(tile, per_warp=1024 if wide else 512),
        **_spec_args(spec),
    )
    return out, own, flag


def decode_rows(buf: torch.Tensor, spec, numel: int, out: torch.Tensor, *, add: bool = False) -> torch.Tensor:
    """wire rows [R, wire_bytes(numel)] -> out [R, numel] (any float dtype; out += values if add)."""
    R = buf.shape[0]
    tile = _tile(numel, spec.group_size)
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
        **_spec_args(spec),
    )
    return out


def _reduce_outputs(buf, spec, numel: int, own, hb: int, encode_spec, encode_rows_n: int):
    """The tile and the output buffers of reduce_rows: (tile, out, enc, own_out, the encode
    stage's constexprs). Buffers a branch does not write are placeholders (compiled out)."""
    sizes = (spec.group_size, hb) + ((encode_spec.group_size,) if encode_spec else ())
    tile = _tile(numel, *sizes)
    if encode_spec is None:
        out = torch.empty(numel, dtype=torch.float32, device=buf.device)
        e_args = dict(G2=spec.group_size, BITS2=spec.bits, QMAX2=spec.qmax, SCALE2_BF16=False)
        return tile, out, out, out, e_args
    tile = min(tile, encode_rows_n & -encode_rows_n)  # a power of two dividing the row: never spans two
    if encode_rows_n % tile or numel % encode_rows_n:
        raise ValueError(f"reduce_rows: rows of {encode_rows_n} must tile {numel} in tiles of {tile}")
    rows_n = numel // encode_rows_n
    enc = torch.empty((rows_n, encode_spec.wire_bytes(encode_rows_n)), dtype=torch.uint8, device=buf.device)
    own_out = torch.empty(encode_rows_n, dtype=torch.float32, device=buf.device)
    e_args = dict(
        G2=encode_spec.group_size,
        BITS2=encode_spec.bits,
        QMAX2=encode_spec.qmax,
        SCALE2_BF16=encode_spec.scale_dtype == torch.bfloat16,
    )
    return tile, own, enc, own_out, e_args  # out = own: only the non-ENCODE branch writes out_ptr


def reduce_rows(
    buf: torch.Tensor,
    spec,
    numel: int,
    own: torch.Tensor,
    own_row: int,
    bad: torch.Tensor,
    *,
    hadamard: tuple[int, torch.Tensor] | None = None,
    encode_spec=None,
    encode_rows_n: int = 0,
    own_seg: int = -1,
    seed: int = 0,
):
    """Sum of the decoded rows of buf [R, wire_bytes(numel)], row own_row replaced by own (fp32
    [numel]), plus bad (fp32 [1]: 0 or NaN). Returns fp32 [numel] (inverse-Hadamard'd when
    `hadamard`), or with `encode_spec`: (wire [numel / encode_rows_n, wire_bytes(encode_rows_n)],
    the exact sum of row own_seg fp32 [encode_rows_n], non-finite group count)."""
    R = buf.shape[0]
    hb, signs = hadamard if hadamard is not None else (1, own.new_ones(1))
    tile, out, enc, own_out, e_args = _reduce_outputs(buf, spec, numel, own, hb, encode_spec, encode_rows_n)
    flag = torch.zeros(1, dtype=torch.int32, device=buf.device)
    stochastic = (encode_spec or spec).rounding == "stochastic"
    launch(
        _reduce_kernel,
        (triton.cdiv(numel, tile),),
        buf,
        buf.stride(0),
        R,
        own,
        own_row,
        bad,
        numel,
        spec.code_bytes(numel),
        out,
        signs,
        enc,
        enc.stride(0) if encode_spec else 0,
        encode_rows_n or numel,
        encode_spec.code_bytes(encode_rows_n) if encode_spec else 0,
        own_out,
        own_seg,
        flag,
        seed,
        TILE=tile,
        HB=hb if encode_spec is None else 1,
        LOG2HB=int(math.log2(hb)) if encode_spec is None else 0,
        ENCODE=encode_spec is not None,
        STOCHASTIC=stochastic,
        LIBDEVICE=libdevice_for(buf),
        num_warps=num_warps(tile),
        **_spec_args(spec),
        **e_args,
    )
    if encode_spec is None:
        return out
    return enc, own_out, flag
