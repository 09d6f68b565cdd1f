"""FP8-expansion and MCF primitives for ``sdpq bench quant``.

Each factory gets the input tensor and returns the zero-argument call to time, with buffers
allocated outside the timing (the optimizer writes its states in place the same way).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..quant.fp8 import dequantize_fp8, fp8_empty, quantize_fp8
from ..quant.mcf import grow_, mul_, split, split_scalar


def _fp8_quantize(fmt: str, expand: bool):
    def factory(x: torch.Tensor):
        out = fp8_empty(x.shape, fmt, 128, expand, x.device)
        return lambda: quantize_fp8(x, fmt, 128, expand, out=out)

    return factory


def _fp8_dequantize(x: torch.Tensor):
    q = quantize_fp8(x, "e4m3", 128, True)
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    return lambda: dequantize_fp8(q, out=out)


def _mcf_grow(x: torch.Tensor):
    hi, lo = split(x.float())
    d = (x.float() * 1e-4).to(torch.bfloat16)
    return lambda: grow_(hi, lo, d)


def _mcf_mul(x: torch.Tensor):
    hi, lo = split(x.float().abs())
    b_hi, b_lo = split_scalar(0.95)
    return lambda: mul_(hi, lo, b_hi, b_lo)


def primitives() -> dict[str, Callable[[torch.Tensor], Callable[[], object]]]:
    return {
        "fp8_e4m3_expand_quantize": _fp8_quantize("e4m3", True),
        "fp8_e4m3_plain_quantize": _fp8_quantize("e4m3", False),
        "fp8_e5m2_expand_quantize": _fp8_quantize("e5m2", True),
        "fp8_e4m3_expand_dequantize": _fp8_dequantize,
        "mcf_grow": _mcf_grow,
        "mcf_mul_beta2": _mcf_mul,
    }
