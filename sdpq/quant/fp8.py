"""FP8 group quantization with COAT dynamic range expansion (docs/architecture.md).

Groups of ``group_size`` consecutive values along the LAST dim (leading dims are
independent rows, as in ``sdpq.quant.groupwise``). Per group, with mn = min |x| over the
non-zero x and mx = max |x|:

    R  = mx / mn,  gm = sqrt(mn * mx)
    k  = floor(16 * log2(F) / log2(R)) / 16      (R <= 1 -> k = 1; k < 1 allowed)
    x' = sign(x) (|x| / gm)^k,  s = (mx / gm)^k / fmax,  code = fp8(x' / s)
    x  = sign(c s) |c s|^(1/k) gm                (dequantize)

F = fmax^2 / 2: after expansion the group spans R^k <= F, so its smallest magnitude lands at
>= fmax / F = 2 / fmax, inside the format's subnormal range instead of flushing to zero
(E4M3: 448^2/2 ~ 2^16.6; E5M2 uses its own fmax 57344: 57344^2/2 ~ 2^30.6, the same relative
place in its range). ``expand=False`` is plain per-group absmax FP8 (k = 1, gm = 1), kept for
comparison; it stores only s.

Everything is computed in fp32 (log2 domain, so mn * mx and R never overflow) and is fully
vectorised: no loop over groups, no host synchronisation. Codes are uint8 views of the float8
bits (gloo cannot send float8). Metadata is fp32 whatever the input dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ._div import true_div

__all__ = ["FP8Quantized", "fp8_empty", "grouped", "quantize_fp8", "dequantize_fp8", "nonfinite_groups"]

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
# k is quantized to 1/16 (as in COAT). The floor of 1/16 only binds for groups spanning
# > 2^265 (fp32 subnormals with E4M3); the cap keeps k finite for groups with R -> 1.
_K_MIN, _K_MAX = 1.0 / 16, 2.0**16


def _fmt_dtype(fmt: str) -> torch.dtype:
    if fmt not in FORMATS:
        raise ValueError(f"fmt={fmt!r}: allowed FP8 formats are {sorted(FORMATS)}")
    return FORMATS[fmt]


def _num_groups(n: int, group_size: int) -> int:
    return -(-n // group_size)


@dataclass
class FP8Quantized:
    """FP8 codes of a tensor plus per-group fp32 metadata.

    codes: uint8, the shape of the quantized tensor (no padding visible).
    scale, k, gm: fp32, shape ``codes.shape[:-1] + (groups,)``; k and gm are None when
    ``expand`` is False (plain absmax FP8 needs only the scale).
    """

    codes: Tensor
    scale: Tensor
    k: Tensor | None
    gm: Tensor | None
    fmt: str = "e4m3"
    group_size: int = 128

    @property
    def expand(self) -> bool:
        return self.k is not None

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def tensors(self) -> list[Tensor]:
        return [t for t in (self.codes, self.scale, self.k, self.gm) if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def block(self, rows: slice, cols: slice) -> FP8Quantized:
        """Views of a 2-D quantized tensor restricted to rows x cols (cols group-aligned)."""
        G = self.group_size
        c0, c1 = cols.start or 0, cols.stop if cols.stop is not None else self.codes.shape[-1]
        if c0 % G or (c1 % G and c1 != self.codes.shape[-1]):
            raise ValueError(f"cols={cols}: block columns must start and end on a group boundary of {G}")
        g = slice(c0 // G, _num_groups(c1, G))
        k, gm = (None if t is None else t[rows, g] for t in (self.k, self.gm))
        return FP8Quantized(self.codes[rows, c0:c1], self.scale[rows, g], k, gm, fmt=self.fmt, group_size=G)


def fp8_empty(shape, fmt: str = "e4m3", group_size: int = 128, expand: bool = True, device=None) -> FP8Quantized:
    """Preallocated (all-zero, decodes to zeros) buffers for a tensor of ``shape``."""
    _fmt_dtype(fmt)
    if group_size < 1:
        raise ValueError(f"group_size={group_size}: must be a positive integer")
    shape = torch.Size(shape)
    meta_shape = (shape[:-1] + (_num_groups(shape[-1], group_size),)) if len(shape) else (1,)
    z = lambda: torch.zeros(meta_shape, dtype=torch.float32, device=device)  # noqa: E731
    return FP8Quantized(
        torch.zeros(shape, dtype=torch.uint8, device=device),
        z(),
        z() if expand else None,
        z() if expand else None,
        fmt,
        group_size,
    )


def grouped(x: Tensor, group_size: int) -> Tensor:
    """x in fp32 as [rows, groups, G] (a view when already fp32 and unpadded; never written),
    zero padded (zeros never change mn or mx)."""
    n = x.shape[-1] if x.dim() else 1
    x2 = x.reshape(-1, n).float()
    pad = _num_groups(n, group_size) * group_size - n
    if pad:
        x2 = torch.nn.functional.pad(x2, (0, pad))
    return x2.view(x2.shape[0], -1, group_size)


def quantize_fp8(
    x: Tensor, fmt: str = "e4m3", group_size: int = 128, expand: bool = True, out: FP8Quantized | None = None
) -> FP8Quantized:
    """Quantize x (fp32/bf16/fp16, any shape, any device) to FP8 groups along its last dim.

    ``out``: preallocated buffers (e.g. from ``fp8_empty`` or ``FP8Quantized.block``) written
    in place. A group holding inf/nan gets a NaN scale and decodes to NaN everywhere
    (``nonfinite_groups``): it is never turned into finite values.
    """
    dtype = _fmt_dtype(fmt)
    if not x.is_floating_point():
        raise TypeError(f"x has dtype {x.dtype}: quantize_fp8 takes a floating-point tensor")
    fmax = torch.finfo(dtype).max
    if out is None:
        out = fp8_empty(x.shape, fmt, group_size, expand, x.device)
    elif out.fmt != fmt or out.group_size != group_size or out.expand != expand or out.shape != x.shape:
        raise ValueError(
            f"out is ({out.fmt}, G={out.group_size}, expand={out.expand}, {tuple(out.shape)}) "
            f"but x needs ({fmt}, G={group_size}, expand={expand}, {tuple(x.shape)})"
        )
    if x.numel() == 0:
        return out
    g = grouped(x, group_size)
    a = g.abs()
    mx = a.amax(-1)  # NaN propagates through amax: a NaN anywhere makes the group non-finite
    bad = ~torch.isfinite(mx)
    if out.k is not None and out.gm is not None:  # expand (checked against `out` above)
        # Exact zeros (and padding) must not reach the minimum: they would make R infinite
        # and collapse k (the reference kernel's defect at some offsets).
        mn = torch.where(a > 0, a, math.inf).amin(-1)
        empty = (mx == 0) | bad
        lmx = torch.where(empty, 1.0, mx).log2()  # empty groups: R = 1, k = 1, gm = 1
        lmn = torch.where(empty, 1.0, mn).log2()
        log_r = lmx - lmn
        k = torch.floor(16 * (2 * math.log2(fmax) - 1) / log_r) / 16
        k = torch.where(log_r > 0, k, 1.0).clamp_(_K_MIN, _K_MAX)
        gm = torch.exp2(0.5 * (lmx + lmn))
        scale = torch.exp2(k * (lmx - gm.log2()) - math.log2(fmax))
        # code = x'/s = exp2(k log2|x| - k log2 gm - log2 s), with the STORED gm and s exactly
        # as dequantize uses them: one multiply-add per element in the log2 domain.
        bias = torch.where(bad, math.nan, -(k * gm.log2() + scale.log2()))
        mag = a.log2_().mul_(k.unsqueeze(-1)).add_(bias.unsqueeze(-1)).exp2_()
        out.k.copy_(k.view(out.k.shape))
        out.gm.copy_(gm.view(out.gm.shape))
    else:
        scale = true_div(mx, fmax)  # IEEE on every device (see true_div)
        inv = torch.where(bad, math.nan, torch.where(scale > 0, 1 / scale, 0.0))
        mag = a.mul_(inv.unsqueeze(-1))
    scale = torch.where(bad, math.nan, scale)
    # the clamp guards E5M2 (which overflows to inf) against a last-bit excess from exp2
    codes = mag.clamp_(max=fmax).copysign_(g)  # NaN groups stay NaN through clamp
    n = out.shape[-1] if out.codes.dim() else 1
    out.codes.view(dtype).view(-1, n).copy_(codes.flatten(1)[:, :n])  # converts in the copy
    out.scale.copy_(scale.view(out.scale.shape))
    return out


_TABLES: dict = {}


def _table(fmt: str, device: torch.device) -> Tensor:
    key = (fmt, device)
    if key not in _TABLES:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        _TABLES[key] = codes.view(FORMATS[fmt]).float().to(device)
    return _TABLES[key]


def dequantize_fp8(q: FP8Quantized, dtype: torch.dtype = torch.float32, out: Tensor | None = None) -> Tensor:
    """x = sign(c s) |c s|^(1/k) gm per group; zeros decode to exact zeros."""
    shape = q.codes.shape
    n = shape[-1] if len(shape) else 1
    if q.codes.numel() == 0:
        return torch.empty(shape, dtype=dtype, device=q.codes.device) if out is None else out
    # fp8 -> fp32 through a 256-entry table: CPU casts from float8 are scalar and ~10x slower
    codes = q.codes.reshape(-1).int()
    c = grouped(_table(q.fmt, codes.device).index_select(0, codes).view(-1, n), q.group_size)
    s = q.scale.reshape(c.shape[0], -1)
    if q.k is not None and q.gm is not None:  # q.expand
        # |c s|^(1/k) gm = exp2(log2|c| / k + (log2 s / k + log2 gm)); a non-finite group gets
        # a NaN offset so all its elements, zeros included, decode to NaN.
        inv_k = 1 / q.k.reshape(s.shape)
        bias = torch.where(torch.isfinite(s), s.log2() * inv_k + q.gm.reshape(s.shape).log2(), math.nan)
        y = c.abs().log2_().mul_(inv_k.unsqueeze(-1)).add_(bias.unsqueeze(-1)).exp2_().copysign_(c)
    else:
        y = c.mul_(torch.where(torch.isfinite(s), s, math.nan).unsqueeze(-1))
    y = y.flatten(1)[:, :n]
    if out is None:
        return y.reshape(shape).to(dtype)
    (out if out.dim() == 2 else out.view(-1, n)).copy_(y)
    return out


def nonfinite_groups(q: FP8Quantized) -> Tensor:
    """bool, shape of q.scale: groups whose input held inf or nan."""
    return ~torch.isfinite(q.scale)
