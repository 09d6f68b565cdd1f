"""Quantization math: pure tensor functions, no torch.distributed (layers above build on these)."""

from .groupwise import QuantSpec, Quantized, dequantize, nonfinite_groups, quantize
from .hadamard import hadamard, inverse_hadamard
from .wire import decode, encode, pack, unpack

__all__ = [
    "QuantSpec",
    "Quantized",
    "quantize",
    "dequantize",
    "nonfinite_groups",
    "pack",
    "unpack",
    "encode",
    "decode",
    "hadamard",
    "inverse_hadamard",
]
