"""One uint8 wire buffer per row: packed codes followed by the scales.

Layout of a row of ``numel`` values (``spec.wire_bytes(numel)`` bytes):

    [ codes: groups*G*bits/8 bytes | scales: groups * itemsize(scale_dtype) bytes ]

4-bit codes are two's-complement nibbles, element 2i in the low nibble of byte i. Sending codes
and scales in ONE buffer halves the number of collectives (SDP4Bit sends two). Rows of a 2-D
buffer are independent, so ``all_to_all_single`` can split the buffer by rows. The buffer is
plain uint8, which every backend (gloo included) can move.
"""

from __future__ import annotations

import torch

from .groupwise import Quantized, QuantSpec, dequantize, quantize

__all__ = ["pack", "unpack", "encode", "decode"]


def pack(q: Quantized, spec: QuantSpec) -> torch.Tensor:
    """``Quantized`` -> uint8 [..., spec.wire_bytes(q.numel)]."""
    codes = q.codes.view(torch.uint8)  # two's complement bytes
    if spec.bits == 4:
        pairs = codes.view(*codes.shape[:-1], -1, 2) & 0x0F
        codes = pairs[..., 0] | (pairs[..., 1] << 4)
    # One NaN bit pattern on the wire, whatever NaN the input held (the kernels write the same).
    scales = torch.where(q.scales.isnan(), float("nan"), q.scales)
    if spec.scale_dtype == torch.bfloat16:
        # Scales are bf16 values already: keep the top half of the bits (torch's own conversion
        # may turn that NaN into another bit pattern).
        raw = (scales.view(torch.int32) >> 16).to(torch.int16)
    else:
        raw = scales.to(spec.scale_dtype)
    return torch.cat((codes, raw.contiguous().view(torch.uint8)), dim=-1)


def unpack(buf: torch.Tensor, spec: QuantSpec, numel: int) -> Quantized:
    """uint8 wire rows -> ``Quantized`` (exact inverse of ``pack``)."""
    if buf.dtype != torch.uint8 or buf.shape[-1] != spec.wire_bytes(numel):
        raise ValueError(
            f"unpack: expected uint8 rows of {spec.wire_bytes(numel)} bytes for numel={numel}, "
            f"got {buf.dtype} shape {tuple(buf.shape)}"
        )
    cb = spec.code_bytes(numel)
    codes = buf[..., :cb]
    if spec.bits == 4:
        # Sign-extend each nibble: (n ^ 8) - 8 maps 0..15 to 0..7, -8..-1.
        lo = ((codes & 0x0F).to(torch.int16) ^ 8) - 8
        hi = ((codes >> 4).to(torch.int16) ^ 8) - 8
        codes = torch.stack((lo, hi), dim=-1).flatten(-2).to(torch.int8)
    else:
        codes = codes.contiguous().view(torch.int8)
    # Copy into a fresh buffer: a row's scales may start at an odd byte offset and stride,
    # and view() as a wider dtype needs both aligned. Scales are ~1/32 of the bytes.
    raw = buf[..., cb:]
    scales = torch.empty(raw.shape, dtype=torch.uint8, device=buf.device).copy_(raw)
    scales = scales.view(spec.scale_dtype).float()
    return Quantized(codes=codes, scales=scales, numel=numel)


def encode(x: torch.Tensor, spec: QuantSpec, generator: torch.Generator | None = None) -> torch.Tensor:
    """Quantize and pack the last dimension of ``x``."""
    return pack(quantize(x, spec, generator), spec)


def decode(buf: torch.Tensor, spec: QuantSpec, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Unpack and dequantize wire rows back to ``numel`` values each."""
    return dequantize(unpack(buf, spec, numel), dtype)
