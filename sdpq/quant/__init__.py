"""Quantization math: pure tensor functions, no torch.distributed (layers above build on these)."""

from . import mcf
from ._div import true_div
from .fp8 import FP8Quantized, dequantize_fp8, fp8_empty, quantize_fp8
from .groupwise import Quantized, QuantSpec, dequantize, nonfinite_groups, quantize, relative_error
from .hadamard import hadamard, inverse_hadamard
from .wire import decode, encode, pack, unpack

__all__ = [
    "QuantSpec",
    "Quantized",
    "quantize",
    "dequantize",
    "nonfinite_groups",
    "relative_error",
    "pack",
    "unpack",
    "encode",
    "decode",
    "hadamard",
    "inverse_hadamard",
    "FP8Quantized",
    "quantize_fp8",
    "dequantize_fp8",
    "fp8_empty",
    "mcf",
    "true_div",
]
