"""The reduce of the wire codec: sum the received rows of a two-level exchange in one pass.

    reduce_rows   unpack + dequantize every received row, sum them (one row replaced by this
                  rank's exact values) then either [inverse Hadamard] -> fp32, or re-quantize +
                  pack for the next stage

The layouts and the arithmetic are those of ``sdpq.kernels.codec`` (see its docstring): the
result is bitwise ``sdpq.quant.rows.reduce_rows_ref`` with nearest rounding.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._launch import launch, libdevice_for, num_warps, program_index, spec_constexprs, tile_elements
from ._tile import fwht, load_groups, run_counters, store_groups

__all__ = ["reduce_rows"]


# Rows of the reduce whose loads are issued together (8: the GPUs of a node).
ROWS_IN_FLIGHT = 8


@triton.jit
def _sum_rows(
    buf_ptr,
    buf_stride,
    own_ptr,
    own_row,
    code_bytes,
    col,
    m,
    groups,
    gmask,
    ROWS: tl.constexpr,
    CHUNK: tl.constexpr,
    TILE: tl.constexpr,
    G: tl.constexpr,
    BITS: tl.constexpr,
    SCALE_BF16: tl.constexpr,
):
    """The sum of the received rows' tile, row own_row replaced by this rank's exact values.
    Note: the row count is a compile-time constant (one compile per count) and the rows go in
    unrolled chunks of CHUNK = min(ROWS, ROWS_IN_FLIGHT), so no load waits for the previous
    row's sum: the wire rows are loaded without a branch (the own row's load is masked off, it
    reads no memory) and the own values are selected in the sum, in the reference's row order."""
    own = tl.load(own_ptr + col, mask=m, other=0.0)
    acc = tl.zeros([TILE], tl.float32)
    for k0 in range(0, ROWS, CHUNK):
        for i in tl.static_range(CHUNK):
            k = k0 + i
            k_vec = tl.full(gmask.shape, k, tl.int32)  # a tensor: the interpreter's k is a Python int
            wire_mask = gmask & (k_vec != own_row)
            if ROWS % CHUNK != 0:
                wire_mask = wire_mask & (k_vec < ROWS)
            vals = tl.reshape(
                load_groups(buf_ptr + k * buf_stride, code_bytes, groups, wire_mask, G, BITS, SCALE_BF16), [TILE]
            )
            # Past the last row (a partial chunk) the masked loads decode to +0.0, and adding it
            # changes nothing: acc starts at +0.0 and a sum of floats is never -0.0 after that.
            acc += tl.where(k == own_row, own, vals)
    return acc


@triton.jit
def _reduce_kernel(
    buf_ptr,
    buf_stride,
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
    ROWS: tl.constexpr,
    CHUNK: tl.constexpr,
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
        buf_ptr, buf_stride.to(tl.int64), own_ptr, own_row, code_bytes, col, m, groups, gmask,
        ROWS, CHUNK, TILE, G, BITS, SCALE_BF16,
    )  # fmt: skip
    acc = acc + tl.load(bad_ptr)  # 0.0, or NaN when the sender side saw a non-finite group
    if ENCODE:  # re-quantize: output row = col // enc_n (each enc_n a multiple of TILE)
        e_row = (t * TILE) // enc_n
        if e_row == own_seg:
            tl.store(own_out_ptr + (col - e_row * enc_n), acc, mask=m)
        NG2: tl.constexpr = TILE // G2
        vg = tl.reshape(acc, [NG2, G2])
        groups2 = (t * TILE - e_row * enc_n) // G2 + tl.arange(0, NG2)
        g2mask = groups2 * G2 < enc_n
        store_groups(
            vg, enc_ptr + e_row * enc_stride, enc_code_bytes, groups2, g2mask,
            run_counters(t, NG2, G2), seed,
            flag_ptr, G2, BITS2, QMAX2, STOCHASTIC, SCALE2_BF16, LIBDEVICE,
        )  # fmt: skip
    else:
        if HB > 1:  # D H y: butterflies, then the signs (as the reference)
            acc = tl.reshape(fwht(tl.reshape(acc, [TILE // HB, HB]), HB, LOG2HB), [TILE])
            acc = acc * tl.load(signs_ptr + (col % HB))
        tl.store(out_ptr + col, acc, mask=m)


def _reduce_outputs(buf, spec, numel: int, own, hb: int, encode_spec, encode_rows_n: int):
    """The tile and the output buffers of reduce_rows: (tile, out, enc, own_out, the encode
    stage's constexprs). Buffers a branch does not write are placeholders (compiled out)."""
    sizes = (spec.group_size, hb) + ((encode_spec.group_size,) if encode_spec else ())
    tile = tile_elements(numel, *sizes)
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
    if not 0 <= own_row < R:  # past the last row it would be summed as one more row
        raise ValueError(f"reduce_rows: own_row {own_row} is not one of the {R} received rows")
    hb, signs = hadamard if hadamard is not None else (1, own.new_ones(1))
    tile, out, enc, own_out, e_args = _reduce_outputs(buf, spec, numel, own, hb, encode_spec, encode_rows_n)
    flag = torch.zeros(1, dtype=torch.int32, device=buf.device)
    stochastic = (encode_spec or spec).rounding == "stochastic"
    launch(
        _reduce_kernel,
        (triton.cdiv(numel, tile),),
        buf,
        buf.stride(0),
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
        ROWS=R,
        CHUNK=min(R, ROWS_IN_FLIGHT),
        TILE=tile,
        HB=hb if encode_spec is None else 1,
        LOG2HB=int(math.log2(hb)) if encode_spec is None else 0,
        ENCODE=encode_spec is not None,
        STOCHASTIC=stochastic,
        LIBDEVICE=libdevice_for(buf),
        num_warps=num_warps(tile),
        **spec_constexprs(spec),
        **e_args,
    )
    if encode_spec is None:
        return out
    return enc, own_out, flag
