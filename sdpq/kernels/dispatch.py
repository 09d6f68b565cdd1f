"""The collectives' hot paths as whole operations: one fused kernel, or the PyTorch reference.

Each function is what a collective does to a buffer between two exchanges (the PyTorch
composition of each is ``sdpq.quant.rows``):

    encode_rows   [x - ref] [randomized Hadamard] -> group quantize -> pack
    decode_rows   unpack -> dequantize [-> add into a reference, in place]
    reduce_rows   unpack -> dequantize every received row (one replaced by this rank's exact
                  values) -> sum -> [inverse Hadamard] | [re-quantize -> pack for the next stage]

Each runs as one operator (``torch.ops.sdpq.*``, ``sdpq.kernels.codec_ops``) with one kernel
per device: C++ on CPU (built at first use), Triton on CUDA. Where neither can run (no C++
compiler, ``SDPQ_CPP=0`` for CPU, ``SDPQ_TRITON=0`` for CUDA) the reference in
``sdpq.quant.rows`` runs instead; kernels are tested against it, bitwise with nearest rounding.
The test mode ``SDPQ_TRITON=interpret TRITON_INTERPRET=1`` runs the Triton kernels on every
device, through Triton's interpreter.

Note: stochastic rounding in a kernel draws from the kernel's own counter-based stream, seeded
by one draw from the caller's torch generator per call; the reference draws from the generator
itself. Both are unbiased (the Triton kernels' 16-bit draws to within 2^-16 of a step) and
reproducible from the generator's state, but the draws differ.
"""

from __future__ import annotations

import functools
import os

import torch

from .._hotpath import host_read
from ..quant.groupwise import QuantSpec
from ..quant.hadamard import signs
from ..quant.rows import decode_rows_ref, encode_rows_ref, reduce_rows_ref
from . import codec_ops

__all__ = [
    "encode_rows",
    "decode_rows",
    "reduce_rows",
    "decode_rows_inverse_hadamard",
    "uses_triton",
    "uses_cpp",
]

Hadamard = tuple[int, int]  # (block, seed)


@functools.lru_cache(maxsize=1)
def _triton_mode() -> str:
    """'off', 'cuda' (kernels for CUDA tensors) or 'interpret' (kernels for every tensor)."""
    want = os.environ.get("SDPQ_TRITON", "auto")
    if want == "0":
        return "off"
    if want == "interpret" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "SDPQ_TRITON=interpret: also set TRITON_INTERPRET=1 in the environment "
            "(Triton reads it when it is imported, which may already have happened)"
        )
    try:
        import triton  # noqa: F401
    except ImportError:
        return "off"
    return "interpret" if want == "interpret" else "cuda"


def uses_triton(t: torch.Tensor) -> bool:
    """The Triton kernels run for t (CUDA, or every device in the interpreter test mode)."""
    mode = _triton_mode()
    return mode == "interpret" or (mode == "cuda" and t.is_cuda)


def uses_cpp(t: torch.Tensor) -> bool:
    """The C++ CPU kernels run for t."""
    return t.device.type == "cpu" and _triton_mode() != "interpret" and codec_ops.cpu_available()


def _use_op(t: torch.Tensor) -> bool:
    """Call the torch.ops.sdpq operator (its CPU or CUDA kernel) rather than the reference."""
    return (t.is_cuda and _triton_mode() == "cuda") or uses_cpp(t)


def _spec_args(spec: QuantSpec) -> tuple[int, int, bool, bool]:
    return spec.bits, spec.group_size, spec.rounding == "stochastic", spec.scale_dtype == torch.bfloat16


def _seed(generator: torch.Generator | None) -> int:
    """One Philox seed per call from the caller's generator (reproducible from its state)."""
    if generator is None:
        return 0
    if generator.device.type == "cuda":  # advance the offset instead of drawing: no host sync
        off = generator.get_offset()
        generator.set_offset(off + 4)
        return (generator.initial_seed() * 1_000_003 + off) % (2**31 - 1)
    with host_read():  # a CPU generator's draw is a host value (CUDA tensors take the branch above)
        return int(torch.randint(0, 2**31 - 1, (1,), generator=generator))


def encode_rows(
    x: torch.Tensor,
    spec: QuantSpec,
    *,
    ref: torch.Tensor | None = None,
    segments: int = 1,
    hadamard: Hadamard | None = None,
    own_row: int | None = None,
    generator: torch.Generator | None = None,
):
    """x [R, n] -> (wire uint8 [R / segments, spec.wire_bytes(segments * n)], own, nonfinite).

    Values are ``x - ref`` (fp32) when `ref` is given, then ``H D`` when `hadamard` = (block,
    seed). Wire row p holds input rows p, p + P, p + 2P, ... (P = R / segments) one after the
    other. own: fp32 [segments, n], the values of the rows r with r % P == own_row (None without
    own_row). nonfinite: 0-dim bool tensor, any group held inf/NaN.
    """
    R, n = x.shape
    if R % segments:
        raise ValueError(f"encode_rows: {R} rows do not split into {segments} segments")
    use_op = _use_op(x) and (segments == 1 or n % spec.group_size == 0)
    if use_op or uses_triton(x):
        signs_t = None if hadamard is None else signs(hadamard[0], hadamard[1], x.device)
        args = (x, ref, segments, *_spec_args(spec), signs_t, -1 if own_row is None else own_row, _seed(generator))
        op = torch.ops.sdpq.encode_rows if use_op else codec_ops.triton_encode_rows
        wire, own, flag = op(*args)
        return wire, (own if own_row is not None else None), flag
    return encode_rows_ref(x, spec, ref, segments, hadamard, own_row, generator)


def decode_rows(
    buf: torch.Tensor, spec: QuantSpec, numel: int, out: torch.Tensor, *, add: bool = False
) -> torch.Tensor:
    """wire [R, wire_bytes(numel)] -> out [R, numel] (its dtype); ``out += values`` (fp32 math) if add."""
    use_op = _use_op(buf) and out.dim() == 2 and out.stride(1) == 1
    if use_op or uses_triton(buf):
        op = torch.ops.sdpq.decode_rows if use_op else codec_ops.triton_decode_rows
        op(buf, numel, spec.bits, spec.group_size, spec.scale_dtype == torch.bfloat16, out, add)
        return out
    return decode_rows_ref(buf, spec, numel, out, add)


def reduce_rows(
    buf: torch.Tensor,
    spec: QuantSpec,
    numel: int,
    own: torch.Tensor,
    own_row: int,
    bad: torch.Tensor,
    *,
    hadamard: Hadamard | None = None,
    encode_spec: QuantSpec | None = None,
    encode_numel: int = 0,
    own_seg: int = -1,
    generator: torch.Generator | None = None,
):
    """Sum of the decoded rows of buf [R, wire_bytes(numel)], row `own_row` replaced by `own`
    (fp32 [numel]), plus NaN if `bad` (0-dim bool) -> fp32 [numel], inverse-Hadamard'd with
    `hadamard`. With `encode_spec` the sum is instead split into rows of `encode_numel` and
    re-encoded: returns (wire [numel / encode_numel, wire bytes], fp32 copy of row `own_seg`,
    nonfinite)."""
    use_op = _use_op(buf)
    if use_op or uses_triton(buf):
        signs_t = None if hadamard is None else signs(hadamard[0], hadamard[1], buf.device)
        enc = _spec_args(encode_spec) if encode_spec is not None else (0, 2, spec.rounding == "stochastic", False)
        spec_args = (spec.bits, spec.group_size, spec.scale_dtype == torch.bfloat16)
        args = (buf, numel, *spec_args, own.reshape(-1), own_row, bad, signs_t, *enc, encode_numel, own_seg)
        op = torch.ops.sdpq.reduce_rows if use_op else codec_ops.triton_reduce_rows
        out, own_out, flag = op(*args, _seed(generator))
        return out if encode_spec is None else (out, own_out, flag)
    bad_f = torch.where(bad, float("nan"), 0.0).to(torch.float32).reshape(1)
    return reduce_rows_ref(
        buf, spec, numel, own, own_row, bad_f, hadamard, encode_spec, encode_numel, own_seg, generator
    )


def decode_rows_inverse_hadamard(buf: torch.Tensor, spec: QuantSpec, numel: int, hadamard: Hadamard) -> torch.Tensor:
    """Every row of buf [R, wire_bytes(numel)] decoded and inverse-Hadamard'd -> fp32 [R, numel].

    Note: each row goes through reduce_rows as the sum of itself and a zero row (x + 0 = x, and
    the zero row is never read), the one kernel that fuses decoding with the inverse transform:
    ~10x the speed of decoding and transforming in two passes on CPU, the same bits."""
    zero = torch.zeros(numel, dtype=torch.float32, device=buf.device)
    ok = torch.zeros((), dtype=torch.bool, device=buf.device)
    rows = [reduce_rows(row.expand(2, -1), spec, numel, zero, 1, ok, hadamard=hadamard) for row in buf]
    return torch.stack(rows)
