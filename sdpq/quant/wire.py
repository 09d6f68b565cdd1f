"""One uint8 wire buffer per row: packed codes followed by the scales.

Layout of a row of ``numel`` values (``spec.wire_bytes(numel)`` bytes):

    [ codes: groups*G*bits/8 bytes | scales: groups * itemsize(scale_dtype) bytes ]

Codes below 8 bits are a little-endian bit stream of two's-complement fields: element e in bits
[e * bits, (e + 1) * bits) of the code region. 4-bit: element 2i in the low nibble of byte i;
2-bit: four per byte; 3-bit: each 8 elements are one 24-bit little-endian word in 3 bytes. Sending codes
and scales in ONE buffer halves the number of collectives (SDP4Bit sends two). Rows of a 2-D
buffer are independent, so ``all_to_all_single`` can split the buffer by rows. The buffer is
plain uint8, which every backend (gloo included) can move.
"""

from __future__ import annotations

import math

import torch

from .groupwise import Quantized, QuantSpec, dequantize, quantize

__all__ = ["pack", "unpack", "encode", "decode"]


def pack(q: Quantized, spec: QuantSpec) -> torch.Tensor:
    """``Quantized`` -> uint8 [..., spec.wire_bytes(q.numel)]."""
    codes = q.codes.view(torch.uint8)  # two's complement bytes
    if spec.bits < 8:
        codes = _pack_fields(codes, spec.bits)
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
    codes = _unpack_fields(codes, spec.bits) if spec.bits < 8 else codes.contiguous().view(torch.int8)
    # Copy into a fresh buffer: a row's scales may start at an odd byte offset and stride,
    # and view() as a wider dtype needs both aligned. Scales are ~1/32 of the bytes.
    raw = buf[..., cb:]
    scales = torch.empty(raw.shape, dtype=torch.uint8, device=buf.device).copy_(raw)
    scales = scales.view(spec.scale_dtype).float()
    return Quantized(codes=codes, scales=scales, numel=numel)


def _word(bits: int) -> tuple[int, int]:
    """(codes, bytes) of the smallest whole-byte word: 4 bits (2, 1), 2 bits (4, 1), 3 bits (8, 3)."""
    n = 8 // math.gcd(8, bits)
    return n, n * bits // 8


def _pack_fields(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 two's-complement codes [..., k] -> the bit stream [..., k * bits / 8]."""
    k, (n, nb) = codes.shape[-1], _word(bits)
    fields = (codes.view(*codes.shape[:-1], k // n, n) & ((1 << bits) - 1)).to(torch.int32)
    shifts = torch.arange(n, device=codes.device, dtype=torch.int32) * bits
    word = (fields << shifts).sum(-1)  # the fields do not overlap: the sum is their OR
    out = torch.stack([(word >> (8 * b)) & 0xFF for b in range(nb)], dim=-1).to(torch.uint8)
    return out.reshape(*codes.shape[:-1], k * bits // 8)


def _unpack_fields(stream: torch.Tensor, bits: int) -> torch.Tensor:
    """The bit stream [..., m] -> int8 codes [..., m * 8 / bits], sign-extended."""
    m, (n, nb) = stream.shape[-1], _word(bits)
    chunks = stream.reshape(*stream.shape[:-1], m // nb, nb).to(torch.int32)
    word = chunks[..., 0]
    for b in range(1, nb):
        word = word | (chunks[..., b] << (8 * b))
    shifts = torch.arange(n, device=stream.device, dtype=torch.int32) * bits
    fields = (word.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    sign = 1 << (bits - 1)
    codes = (fields ^ sign) - sign  # (f ^ s) - s maps [0, 2^bits) to [-s, s)
    return codes.to(torch.int8).reshape(*stream.shape[:-1], m * 8 // bits)


def encode(x: torch.Tensor, spec: QuantSpec, generator: torch.Generator | None = None) -> torch.Tensor:
    """Quantize and pack the last dimension of ``x``."""
    return pack(quantize(x, spec, generator), spec)


def decode(buf: torch.Tensor, spec: QuantSpec, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Unpack and dequantize wire rows back to ``numel`` values each."""
    return dequantize(unpack(buf, spec, numel), dtype)
