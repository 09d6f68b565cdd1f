"""The codec's hot paths as PyTorch operators: ``torch.ops.sdpq.encode_rows``, ``decode_rows``,
``reduce_rows``, one kernel per device.

    CPU    C++ (``sdpq/csrc/codec.cpp``, built at first use by ``native``)
    CUDA   Triton (``sdpq.kernels.codec``, imported at the first CUDA call)
    Meta   shape functions, so the operators trace under ``torch.compile``

The PyTorch composition in ``sdpq.quant.rows`` stays the reference and the path that
``sdpq.kernels.dispatch`` takes when neither kernel can run. Arguments are plain ints and bools
(a ``QuantSpec`` is unpacked by the caller) so the schemas are ordinary TorchScript types.
Stochastic rounding takes an int
``seed``; each kernel draws its noise from a counter-based stream (the element's position),
so results do not depend on the number of threads.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..quant.groupwise import QuantSpec
from . import native

__all__ = ["cpu_available"]

_LIB = torch.library.Library("sdpq", "FRAGMENT")  # noqa: TOR901 (the codec's share of the namespace)
_LIB.define(
    "encode_rows(Tensor x, Tensor? ref, int segments, int bits, int group_size, bool stochastic, "
    "bool scale_bf16, Tensor? signs, int own_row, int seed) -> (Tensor wire, Tensor own, Tensor nonfinite)"
)
_LIB.define(
    "decode_rows(Tensor buf, int numel, int bits, int group_size, bool scale_bf16, Tensor(a!) out, bool add) -> ()"
)
_LIB.define(
    "reduce_rows(Tensor buf, int numel, int bits, int group_size, bool scale_bf16, Tensor own, "
    "int own_row, Tensor bad, Tensor? signs, int enc_bits, int enc_group_size, bool enc_stochastic, "
    "bool enc_scale_bf16, int enc_numel, int own_seg, int seed) -> (Tensor out, Tensor own_out, "
    "Tensor nonfinite)"
)


@functools.lru_cache(maxsize=1)
def cpu_available() -> bool:
    """The C++ kernels are registered for CPU tensors (built now if needed)."""
    return native.load("codec")


# ---------------------------------------------------------------------------- arguments


class EncodeArgs(NamedTuple):
    """The arguments of ``sdpq::encode_rows``, in schema order."""

    x: torch.Tensor
    ref: torch.Tensor | None
    segments: int
    bits: int
    group_size: int
    stochastic: bool
    scale_bf16: bool
    signs: torch.Tensor | None
    own_row: int
    seed: int


class ReduceArgs(NamedTuple):
    """The arguments of ``sdpq::reduce_rows``, in schema order (``enc_bits`` 0: no re-encode)."""

    buf: torch.Tensor
    numel: int
    bits: int
    group_size: int
    scale_bf16: bool
    own: torch.Tensor
    own_row: int
    bad: torch.Tensor
    signs: torch.Tensor | None
    enc_bits: int
    enc_group_size: int
    enc_stochastic: bool
    enc_scale_bf16: bool
    enc_numel: int
    own_seg: int
    seed: int


def _spec(bits: int, group_size: int, stochastic: bool, scale_bf16: bool) -> QuantSpec:
    return QuantSpec(
        bits=bits,
        group_size=group_size,
        rounding="stochastic" if stochastic else "nearest",
        scale_dtype=torch.bfloat16 if scale_bf16 else torch.float32,
    )


# ---------------------------------------------------------------------------- fake (Meta)


@torch.library.register_fake("sdpq::encode_rows")
def _encode_fake(*args):
    a = EncodeArgs(*args)
    R, n = a.x.shape
    wire_row = _spec(a.bits, a.group_size, a.stochastic, a.scale_bf16).wire_bytes(a.segments * n)
    wire = a.x.new_empty((R // a.segments, wire_row), dtype=torch.uint8)
    own = a.x.new_empty((a.segments, n) if a.own_row >= 0 else (0,), dtype=torch.float32)
    return wire, own, a.x.new_empty((), dtype=torch.bool)


@torch.library.register_fake("sdpq::decode_rows")
def _decode_fake(buf, numel, bits, group_size, scale_bf16, out, add):
    return None


@torch.library.register_fake("sdpq::reduce_rows")
def _reduce_fake(*args):
    a = ReduceArgs(*args)
    flag = a.buf.new_empty((), dtype=torch.bool)
    if a.enc_bits == 0:
        return a.buf.new_empty((a.numel,), dtype=torch.float32), a.buf.new_empty((0,), dtype=torch.float32), flag
    rows = a.numel // a.enc_numel
    wire_row = _spec(a.enc_bits, a.enc_group_size, a.enc_stochastic, a.enc_scale_bf16).wire_bytes(a.enc_numel)
    wire = a.buf.new_empty((rows, wire_row), dtype=torch.uint8)
    return wire, a.buf.new_empty((a.enc_numel,), dtype=torch.float32), flag


# ---------------------------------------------------------------------------- Triton (CUDA)
# The operators' CUDA kernels; sdpq.kernels.dispatch also calls them on CPU tensors in the
# interpreter test mode (SDPQ_TRITON=interpret).


def _had(signs):
    return None if signs is None else (signs.numel(), signs)


def triton_encode_rows(*args):
    from . import codec

    a = EncodeArgs(*args)
    wire, own, flag = codec.encode_rows(
        a.x,
        _spec(a.bits, a.group_size, a.stochastic, a.scale_bf16),
        ref=a.ref,
        segments=a.segments,
        hadamard=_had(a.signs),
        own_row=a.own_row if a.own_row >= 0 else None,
        seed=a.seed,
    )
    own = own if own is not None else a.x.new_empty((0,), dtype=torch.float32)
    return wire, own, flag[0] > 0


def triton_decode_rows(buf, numel, bits, group_size, scale_bf16, out, add):
    from . import codec

    codec.decode_rows(buf, _spec(bits, group_size, False, scale_bf16), numel, out, add=add)


def triton_reduce_rows(*args):
    from . import codec

    a = ReduceArgs(*args)
    spec = _spec(a.bits, a.group_size, a.enc_stochastic, a.scale_bf16)
    bad_f = torch.where(a.bad, float("nan"), 0.0).to(torch.float32).reshape(1)
    common = (a.buf, spec, a.numel, a.own.reshape(-1), a.own_row, bad_f)
    if a.enc_bits == 0:
        out = codec.reduce_rows(*common, hadamard=_had(a.signs), seed=a.seed)
        return out, out.new_empty((0,)), torch.zeros((), dtype=torch.bool, device=a.buf.device)
    enc = _spec(a.enc_bits, a.enc_group_size, a.enc_stochastic, a.enc_scale_bf16)
    wire, own_out, flag = codec.reduce_rows(
        *common, encode_spec=enc, encode_rows_n=a.enc_numel, own_seg=a.own_seg, seed=a.seed
    )
    return wire, own_out, flag[0] > 0


for _name, _kernel in (
    ("encode_rows", triton_encode_rows),
    ("decode_rows", triton_decode_rows),
    ("reduce_rows", triton_reduce_rows),
):
    _LIB.impl(_name, _kernel, "CUDA")
