"""Symmetric absmax group quantization to 8, 4, 3 or 2-bit codes (pure tensor math).

Per group of G values: s = max|x| / qmax (qmax = 2^(bits-1) - 1: 127, 7, 3, 1),
q = round(x / s) clamped to [-qmax, qmax]; an all-zero group has s = 0 and q = 0.
Rounding is to nearest (|x - s q| <= s/2) or stochastic (floor(x/s + u), u ~ U[0, 1),
so E[s q] = x for every element whose group is not clipped).

The last dimension is quantized; leading dimensions are independent rows (a collective sends
one row per destination rank). Any length works: rows are zero-padded to whole groups inside,
and ``dequantize`` returns exactly ``numel`` values per row.

Scales go on the wire as fp32 or bf16 (``SCALE_DTYPES``). Both cover the whole fp32 range, so no
finite group's scale overflows or flushes to zero: a bf16 scale is s rounded *up* to 8 significant
bits, which keeps |x / s| <= qmax (no clipping, so the bounds above hold for every element) at a
cost of at most 2^-8 of resolution. fp16 scales are not offered: a 4-bit group with absmax below
about 4e-7 would decode as zeros and one above 4.6e5 as NaN, and gradients span both.

Note (invariant): a decoded value qmax * s stays finite. Rounded up, a bf16 scale of a group whose
absmax lies within 2^-8 of the fp32 maximum would decode its largest codes past it, to inf; such
a scale is capped at ``bf16_scale_cap(qmax)``, the largest bf16 value whose qmax multiple is
finite. Only those groups' largest elements are then clipped, by qmax (fp32 max / qmax - cap)
/ cap: at most 0.016 of a step for every offered width (tests/quant/test_groupwise.py), so the
nearest-rounding bound still holds for them; stochastic rounding stays within one step there but
is no longer unbiased. The C++ and Triton codecs cap alike (``fp32 max / qmax`` in fp32,
truncated to bf16). What the cap cannot prevent: a bf16 scale up to 2^-8 above max / qmax makes a
group of equal magnitudes decode that much larger together, so a sum or transform of such values
within 2^-8 of the fp32 maximum can still round past it; fp32 scales keep every finite value
finite up to the maximum itself (tests/comm/test_comm_grads.py).

Note: a non-finite input (inf/nan) makes its group's scale non-finite; the codes of that group
are zeroed and the group decodes to NaN. A gradient overflow therefore survives quantization as
a non-finite value instead of being encoded as finite garbage.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ._div import true_div

__all__ = [
    "BITS",
    "QuantSpec",
    "Quantized",
    "quantize",
    "dequantize",
    "nonfinite_groups",
    "relative_error",
    "SCALE_DTYPES",
]

# Code widths: symmetric integers in [-qmax, qmax], qmax = 2^(bits - 1) - 1 (2 bits: -1, 0, 1).
BITS = (2, 3, 4, 8)
_FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# The wire scale formats by their configuration names.
SCALE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class QuantSpec:
    """How a tensor is quantized and laid out on the wire."""

    bits: int = 8
    group_size: int = 128
    rounding: str = "nearest"
    scale_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"QuantSpec.bits: {self.bits!r} not allowed; allowed: {', '.join(map(str, BITS))}")
        G = self.group_size
        if not isinstance(G, int) or G < 2 or G % 2 or (self.bits < 4 and G % 8):
            raise ValueError(
                f"QuantSpec.group_size: {G!r}; allowed: an even integer >= 2 (a multiple of 8 at 2 or 3 bits: "
                "8 codes fill whole bytes)"
            )
        if self.rounding not in ("nearest", "stochastic"):
            raise ValueError(f"QuantSpec.rounding: {self.rounding!r}; allowed: 'nearest', 'stochastic'")
        if self.scale_dtype not in SCALE_DTYPES.values():
            raise ValueError(f"QuantSpec.scale_dtype: {self.scale_dtype}; allowed: torch.float32, torch.bfloat16")

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def groups(self, numel: int) -> int:
        return -(-numel // self.group_size)

    def code_bytes(self, numel: int) -> int:
        return self.groups(numel) * self.group_size * self.bits // 8

    def scale_bytes(self, numel: int) -> int:
        return self.groups(numel) * self.scale_dtype.itemsize

    def wire_bytes(self, numel: int) -> int:
        """Bytes of one packed row of ``numel`` values: codes (padding included) + scales."""
        return self.code_bytes(numel) + self.scale_bytes(numel)

    def wire_bits_per_element(self, numel: int) -> float:
        """Exact bits that cross the wire per input element, padding and scales included."""
        return 8.0 * self.wire_bytes(numel) / numel


@dataclass(frozen=True)
class Quantized:
    """Unpacked codes (int8, one per element, rows padded to whole groups) and fp32 scales."""

    codes: torch.Tensor  # int8 [..., groups * G]
    scales: torch.Tensor  # fp32 [..., groups] (already rounded to the wire scale dtype)
    numel: int  # valid values per row

    @property
    def group_size(self) -> int:
        return self.codes.shape[-1] // self.scales.shape[-1]


def _check_input(x: torch.Tensor) -> None:
    if x.dtype not in _FLOAT_INPUTS:
        raise TypeError(f"quantize: dtype {x.dtype} not supported; allowed: float32, bfloat16, float16, float64")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"quantize: need a non-empty last dimension, got shape {tuple(x.shape)}")


@functools.cache  # one value per code width; quantize runs per bucket and step
def bf16_scale_cap(qmax: int) -> float:
    """The largest bf16 value b with qmax * b finite in fp32: fp32(max) / qmax in fp32 arithmetic,
    truncated to bf16 (exact for qmax 1, 3, 7 and 127, tests/quant/test_groupwise.py)."""
    q = torch.tensor(torch.finfo(torch.float32).max) / qmax
    return float(q.view(torch.int32).bitwise_and(-65536).view(torch.float32))


def _wire_scales(s: torch.Tensor, dtype: torch.dtype, qmax: int) -> torch.Tensor:
    """fp32 scales (>= 0 or NaN) -> the nearest value of the wire dtype that is >= s, as fp32;
    bf16 scales of finite groups at most bf16_scale_cap(qmax) (see the module's Note)."""
    if dtype == torch.float32:
        return s
    # bf16 is the top half of an fp32: adding 0xFFFF carries into it unless the low half is zero.
    up = (s.view(torch.int32) + 0xFFFF).bitwise_and_(-65536).view(torch.float32)
    up = torch.where(s.isfinite(), up.clamp(max=bf16_scale_cap(qmax)), up)
    return torch.where(s.isnan(), s, up)  # a NaN with a full payload would carry into the sign


def quantize(x: torch.Tensor, spec: QuantSpec, generator: torch.Generator | None = None) -> Quantized:
    """Quantize the last dimension of ``x`` in groups of ``spec.group_size`` (fp32 math)."""
    _check_input(x)
    *lead, n = x.shape
    g, G = spec.groups(n), spec.group_size
    xp = torch.nn.functional.pad(x.float(), (0, g * G - n)).view(*lead, g, G)
    # Round the scale to its wire dtype *before* dividing, so encoder and decoder agree.
    amax = xp.abs().amax(dim=-1)
    scales = _wire_scales(true_div(amax, spec.qmax), spec.scale_dtype, spec.qmax)
    finite = torch.isfinite(scales)
    # Zero or non-finite scales divide by 1; their codes are forced to 0 below.
    safe = torch.where(finite & (scales > 0), scales, torch.ones_like(scales)).unsqueeze(-1)
    y = xp / safe
    if spec.rounding == "stochastic":
        noise = torch.rand(y.shape, device=y.device, generator=generator)
        y = torch.floor(y.add_(noise))
    else:
        y = torch.round(y)
    y = y.clamp_(-spec.qmax, spec.qmax).masked_fill_(~finite.unsqueeze(-1), 0)
    return Quantized(codes=y.to(torch.int8).view(*lead, g * G), scales=scales, numel=n)


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values ``s * q`` (fp32 math), ``q.numel`` per row; non-finite groups decode to NaN."""
    *lead, padded = q.codes.shape
    g = q.scales.shape[-1]
    vals = q.codes.view(*lead, g, padded // g).float() * q.scales.unsqueeze(-1)
    # 0 * inf is already NaN; make inf scales (no NaN from the product when codes are 0) explicit.
    vals = torch.where(torch.isfinite(q.scales).unsqueeze(-1), vals, torch.full_like(vals, float("nan")))
    return vals.view(*lead, padded)[..., : q.numel].to(dtype)


def nonfinite_groups(q: Quantized) -> torch.Tensor:
    """Bool mask [..., groups]: groups whose input held inf or NaN."""
    return ~torch.isfinite(q.scales)


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """||approx - exact|| / ||exact|| (an all-zero `exact` divides by 1e-30): the error figure
    that sdpq's statistics report for every quantized path, as a 0-d tensor on the inputs' device
    (`float()` it to read it).

    Note: a tensor, not a float: the collectives sample it inside the hot path, where reading it
    would wait for the device; `sdpq.comm.stats` accumulates it there and reads it in summary()."""
    return (approx - exact).norm() / exact.norm().clamp_min(1e-30)
