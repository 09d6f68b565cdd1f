"""Multi-component floats (Collage, docs/architecture.md): a value is a pair (hi, lo) of bf16
tensors with hi = bf16(hi + lo), holding ~16 significant bits in 4 bytes.

The formulas are the published ones; intermediate values that the formulas do not store are
computed in fp32 (the registers of a fused kernel), and every named result is rounded to bf16.
bf16 + bf16 in fp32 is exact whenever the exponents differ by <= 16, and otherwise the smaller
operand is below half an ulp of the result, so Fast2Sum's error term stays exact.

The exact product ``mul_`` forms the product error explicitly (hi*b_hi is exact in fp32: 8 x 8
significant bits) and never writes into a tensor it still has to read: the published reference
aliased the product tensor and applied beta2 twice (effective beta2 0.85 instead of 0.95).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["split", "split_scalar", "fast2sum", "grow_", "mul_", "value"]

_BF16 = torch.bfloat16


def _check_pair(hi: Tensor, lo: Tensor) -> None:
    if hi.dtype != _BF16 or lo.dtype != _BF16:
        raise TypeError(f"hi/lo have dtypes {hi.dtype}/{lo.dtype}: an MCF pair is two bfloat16 tensors")
    if hi.shape != lo.shape:
        raise ValueError(f"hi has shape {tuple(hi.shape)} but lo has {tuple(lo.shape)}: they must match")


def split(x: Tensor) -> tuple[Tensor, Tensor]:
    """(hi, lo) = (bf16(x), bf16(x - hi)) for an fp32/fp64 tensor x."""
    hi = x.to(_BF16)
    return hi, (x - hi.to(x.dtype)).to(_BF16)


def split_scalar(beta: float) -> tuple[float, float]:
    """beta = hi + lo with hi = bf16(beta) and lo = beta - hi computed in fp32.

    E.g. beta2 = 0.999: hi = 1.0, lo = -0.001 (bf16 alone rounds beta2 to 1: v never decays);
    beta2 = 0.95: hi = 0.94921875, lo = 0.00078125.
    """
    b = torch.tensor(float(beta), dtype=torch.float32)
    hi = b.to(_BF16).float()
    return float(hi), float(b - hi)


def fast2sum(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """s = a + b, e = b - (s - a); a + b = s + e exactly when |a| >= |b| (bf16 in, bf16 out)."""
    s = (a.float() + b.float()).to(_BF16)
    e = (b.float() - (s.float() - a.float())).to(_BF16)
    return s, e


def grow_(hi: Tensor, lo: Tensor, d: Tensor | float) -> None:
    """(hi, lo) += d in place (Collage Grow).

    s = hi + d; lo = lo + (d - (s - hi)); hi = s + lo; lo = lo - (hi - s).
    d may be fp32 (or bf16 / a Python float); updates far below half an ulp of hi accumulate
    in lo instead of being rounded away.
    """
    _check_pair(hi, lo)
    h = hi.float()
    d = d.float() if isinstance(d, Tensor) else torch.tensor(float(d))
    s = (h + d).to(_BF16).float()
    lo1 = (lo.float() + (d - (s - h))).to(_BF16).float()
    h.copy_(s).add_(lo1)  # reuse the fp32 temporary: h = s + lo
    hi.copy_(h)  # rounds to bf16
    lo.copy_(lo1.sub_(hi.float().sub_(s)))


def mul_(hi: Tensor, lo: Tensor, b_hi: Tensor | float, b_lo: Tensor | float = 0.0) -> None:
    """(hi, lo) *= (b_hi + b_lo) in place, with the product error kept.

    b_hi must be bf16-representable (a bf16 tensor or a float from ``split_scalar``) so that
    hi * b_hi is exact in fp32; b_lo may be any fp32 value (beta2 - bf16(beta2)).
    p = hi*b_hi (exact), e = hi*b_lo + lo*(b_hi + b_lo); the result is p + e renormalised
    into a bf16 pair (hi = bf16(p + e), lo = bf16(p + e - hi)).
    """
    _check_pair(hi, lo)
    if isinstance(b_hi, Tensor):
        if b_hi.dtype != _BF16:
            raise TypeError(f"b_hi has dtype {b_hi.dtype}: it must be bfloat16 for an exact product")
        b_hi = b_hi.float()
    elif float(torch.tensor(float(b_hi)).to(_BF16)) != float(b_hi):
        raise ValueError(f"b_hi={b_hi!r} is not bf16-representable: split it with split_scalar first")
    b_lo = b_lo.float() if isinstance(b_lo, Tensor) else b_lo
    h, l = hi.float(), lo.float()
    p = h * b_hi  # exact: 8 x 8 significant bits fit in fp32's 24
    e = h.mul_(b_lo).add_(l.mul_(b_hi + b_lo))  # small terms; h, l are temporaries, not hi/lo
    s = p.add_(e)  # p + e in fp32: error <= 2^-24 relative, far below the pair's ~2^-16
    hi.copy_(s)
    lo.copy_(s.sub_(hi.float()))


def value(hi: Tensor, lo: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """hi + lo in a wider dtype (exact in fp32 for a normalised pair)."""
    return hi.to(dtype) + lo.to(dtype)
