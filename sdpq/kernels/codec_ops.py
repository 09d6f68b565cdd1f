"""The codec's hot paths as PyTorch operators: ``torch.ops.sdpq.encode_rows``, ``decode_rows``,
``reduce_rows``, one kernel per device.

    CPU    C++ (``sdpq/csrc/codec.cpp``, built at first use by ``native``)
    CUDA   Triton (``sdpq.kernels.codec``, imported at the first CUDA call)
    Meta   shape functions, so the operators trace under ``torch.compile``

The PyTorch composition in ``sdpq.quant.fused`` stays the reference and the path taken when
neither kernel can run. Arguments are plain ints and bools (a ``QuantSpec`` is unpacked by the
caller) so the schemas are ordinary TorchScript types. Stochastic rounding takes an int
``seed``; each kernel draws its noise from a counter-based stream (the element's position),
so results do not depend on the number of threads.
"""

from __future__ import annotations

import functools

import torch

from . import native

__all__ = ["cpu_available", "wire_bytes"]

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


def wire_bytes(numel: int, bits: int, group_size: int, scale_bf16: bool) -> int:
    groups = -(-numel // group_size)
    return groups * group_size * bits // 8 + groups * (2 if scale_bf16 else 4)


@functools.lru_cache(maxsize=1)
def cpu_available() -> bool:
    """The C++ kernels are registered for CPU tensors (built now if needed)."""
    return native.load("codec")


# ---------------------------------------------------------------------------- fake (Meta)


@torch.library.register_fake("sdpq::encode_rows")
def _encode_fake(x, ref, segments, bits, group_size, stochastic, scale_bf16, signs, own_row, seed):
    R, n = x.shape
    P = R // segments
    wire = x.new_empty((P, wire_bytes(segments * n, bits, group_size, scale_bf16)), dtype=torch.uint8)
    own = x.new_empty((segments, n) if own_row >= 0 else (0,), dtype=torch.float32)
    return wire, own, x.new_empty((), dtype=torch.bool)


@torch.library.register_fake("sdpq::decode_rows")
def _decode_fake(buf, numel, bits, group_size, scale_bf16, out, add):
    return None


@torch.library.register_fake("sdpq::reduce_rows")
def _reduce_fake(
    buf,
    numel,
    bits,
    group_size,
    scale_bf16,
    own,
    own_row,
    bad,
    signs,
    enc_bits,
    enc_group_size,
    enc_stochastic,
    enc_scale_bf16,
    enc_numel,
    own_seg,
    seed,
):
    flag = buf.new_empty((), dtype=torch.bool)
    if enc_bits == 0:
        return buf.new_empty((numel,), dtype=torch.float32), buf.new_empty((0,), dtype=torch.float32), flag
    wire = buf.new_empty(
        (numel // enc_numel, wire_bytes(enc_numel, enc_bits, enc_group_size, enc_scale_bf16)), dtype=torch.uint8
    )
    return wire, buf.new_empty((enc_numel,), dtype=torch.float32), flag


# ---------------------------------------------------------------------------- CUDA (Triton)


class _Spec:
    """The attributes of a QuantSpec the Triton wrappers read."""

    def __init__(self, bits: int, group_size: int, stochastic: bool, scale_bf16: bool):
        from ..quant.groupwise import QuantSpec

        self.q = QuantSpec(
            bits=bits,
            group_size=group_size,
            rounding="stochastic" if stochastic else "nearest",
            scale_dtype=torch.bfloat16 if scale_bf16 else torch.float32,
        )


def _had(signs):
    return None if signs is None else (signs.numel(), signs)


@torch.library.impl("sdpq::encode_rows", "CUDA")
def _encode_cuda(x, ref, segments, bits, group_size, stochastic, scale_bf16, signs, own_row, seed):
    from . import codec

    spec = _Spec(bits, group_size, stochastic, scale_bf16).q
    wire, own, flag = codec.encode_rows(
        x, spec, ref=ref, segments=segments, hadamard=_had(signs), own_row=own_row if own_row >= 0 else None, seed=seed
    )
    own = own if own is not None else x.new_empty((0,), dtype=torch.float32)
    return wire, own, flag[0] > 0


@torch.library.impl("sdpq::decode_rows", "CUDA")
def _decode_cuda(buf, numel, bits, group_size, scale_bf16, out, add):
    from . import codec

    codec.decode_rows(buf, _Spec(bits, group_size, False, scale_bf16).q, numel, out, add=add)


@torch.library.impl("sdpq::reduce_rows", "CUDA")
def _reduce_cuda(
    buf,
    numel,
    bits,
    group_size,
    scale_bf16,
    own,
    own_row,
    bad,
    signs,
    enc_bits,
    enc_group_size,
    enc_stochastic,
    enc_scale_bf16,
    enc_numel,
    own_seg,
    seed,
):
    from . import codec

    spec = _Spec(bits, group_size, enc_stochastic, scale_bf16).q
    bad_f = torch.where(bad, float("nan"), 0.0).to(torch.float32).reshape(1)
    if enc_bits == 0:
        out = codec.reduce_rows(buf, spec, numel, own.reshape(-1), own_row, bad_f, hadamard=_had(signs), seed=seed)
        return out, out.new_empty((0,)), torch.zeros((), dtype=torch.bool, device=buf.device)
    enc = _Spec(enc_bits, enc_group_size, enc_stochastic, enc_scale_bf16).q
    wire, own_out, flag = codec.reduce_rows(
        buf,
        spec,
        numel,
        own.reshape(-1),
        own_row,
        bad_f,
        encode_spec=enc,
        encode_rows_n=enc_numel,
        own_seg=own_seg,
        seed=seed,
    )
    return wire, own_out, flag[0] > 0
