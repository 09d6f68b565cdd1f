"""The collectives' hot paths as PyTorch compositions: the reference the compiled kernels match.

Each function is what a collective does to a buffer between two exchanges:

    encode_rows_ref   [x - ref] [randomized Hadamard] -> group quantize -> pack
    decode_rows_ref   unpack -> dequantize [-> add into a reference, in place]
    reduce_rows_ref   unpack -> dequantize every received row (one replaced by this rank's exact
                      values) -> sum -> [inverse Hadamard] | [re-quantize -> pack for the next stage]

``sdpq.kernels`` runs the same operations as one fused kernel per device (C++ on CPU, Triton on
CUDA) and falls back to these where no kernel can run; the kernels are tested against them,
bitwise with nearest rounding. ``wire_nonfinite`` and ``poison_scales_`` read or write only a
wire buffer's scale bytes and have no kernel.
"""

from __future__ import annotations

import torch

from .groupwise import QuantSpec, dequantize, nonfinite_groups, quantize
from .hadamard import hadamard as _hadamard
from .hadamard import inverse_hadamard
from .wire import pack, unpack

__all__ = ["encode_rows_ref", "decode_rows_ref", "reduce_rows_ref", "wire_nonfinite", "poison_scales_"]

Hadamard = tuple[int, int]  # (block, seed)


def encode_rows_ref(
    x: torch.Tensor,
    spec: QuantSpec,
    ref: torch.Tensor | None,
    segments: int,
    hadamard: Hadamard | None,
    own_row: int | None,
    generator: torch.Generator | None,
):
    """x [R, n] -> (wire, own, nonfinite); see ``sdpq.kernels.encode_rows``."""
    R, n = x.shape
    v = x.float() - ref.float() if ref is not None else x.float()
    if hadamard is not None:
        v = _hadamard(v, *hadamard)
    P = R // segments
    rows = v.view(segments, P, n)
    own = rows[:, own_row] if own_row is not None else None
    q = quantize(rows.transpose(0, 1).reshape(P, segments * n), spec, generator)
    return pack(q, spec), own, nonfinite_groups(q).any()


def decode_rows_ref(buf: torch.Tensor, spec: QuantSpec, numel: int, out: torch.Tensor, add: bool) -> torch.Tensor:
    """wire [R, wire_bytes(numel)] -> out [R, numel]; see ``sdpq.kernels.decode_rows``."""
    vals = dequantize(unpack(buf, spec, numel))
    out.copy_(out.float() + vals if add else vals)
    return out


def reduce_rows_ref(
    buf: torch.Tensor,
    spec: QuantSpec,
    numel: int,
    own: torch.Tensor,
    own_row: int,
    bad_f: torch.Tensor,
    hadamard: Hadamard | None,
    encode_spec: QuantSpec | None,
    encode_numel: int,
    own_seg: int,
    generator: torch.Generator | None,
):
    """The sum of buf's decoded rows (row `own_row` replaced by `own`) plus `bad_f` (fp32 [1]: NaN
    or 0); see ``sdpq.kernels.reduce_rows``."""
    parts = dequantize(unpack(buf, spec, numel))
    parts[own_row] = own.reshape(-1)
    # Note: rows are summed in row order, one add at a time (the kernels' order); torch's
    # sum(0) reorders its additions for more than 4 rows.
    y = parts[0].clone()
    for part in parts[1:]:
        y += part
    y += bad_f
    if encode_spec is None:
        return inverse_hadamard(y, *hadamard) if hadamard is not None else y
    rows = y.view(-1, encode_numel)
    q = quantize(rows, encode_spec, generator)
    return pack(q, encode_spec), rows[own_seg].clone(), nonfinite_groups(q).any()


def wire_nonfinite(wire: torch.Tensor, spec: QuantSpec, numel: int) -> torch.Tensor:
    """0-dim bool: any scale of the wire rows [R, wire_bytes(numel)] is inf/NaN (reads scales only)."""
    region = wire[:, spec.code_bytes(numel) :].contiguous()  # may start at an odd offset: copy to align
    return ~torch.isfinite(region.view(spec.scale_dtype)).all()


def poison_scales_(wire: torch.Tensor, spec: QuantSpec, numel: int, bad: torch.Tensor) -> torch.Tensor:
    """Every scale of every row NaN when `bad` (0-dim bool): a receiver then decodes NaN
    everywhere. Touches only the scale bytes (no host sync, no branch on data)."""
    cb = spec.code_bytes(numel)
    nan = torch.full((spec.groups(numel),), float("nan"), dtype=spec.scale_dtype, device=wire.device)
    region = wire[:, cb:]
    region.copy_(torch.where(bad, nan.view(torch.uint8).expand_as(region), region))
    return wire
