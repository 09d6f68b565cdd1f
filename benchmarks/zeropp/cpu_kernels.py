"""Plain-PyTorch stand-ins for the CUDA quantizer op that DeepSpeed ZeRO++ loads.

DeepSpeed 0.19.8 reaches its quantization kernels through ONE op module,
``deepspeed.ops.op_builder.QuantizerBuilder().load()`` (sources in
``deepspeed/ops/csrc/quantization/*.cu``, binding in ``pt_binding.cpp``). On CPU that builder is
``NotImplementedBuilder`` and ZeRO++ fails. ``CPUQuantizerOps`` below has the same attribute names,
arguments, return types and arithmetic, so DeepSpeed's own Python (``CUDAQuantizer``'s group
choice, ``all_to_all_quant_reduce``'s two-hop flow, hpZ's secondary partitions) runs unchanged:

| CUDA op (pt_binding.cpp)  | caller in DeepSpeed                                   | here                   |
|---------------------------|-------------------------------------------------------|------------------------|
| quantize                  | CUDAQuantizer.quantize (qwZ: int8 weight all-gather)  | ``quantize``           |
| dequantize / _fp32        | CUDAQuantizer.dequantize, all_to_all_quant_reduce     | ``dequantize[_fp32]``  |
| swizzle_quant             | all_to_all_quant_reduce (qgZ, int4, hop 1)            | ``swizzle_quant``      |
| quantized_reduction       | all_to_all_quant_reduce (qgZ, int4, between the hops) | ``quantized_reduction``|

The math, read from ``ops/csrc/includes/quantization_utils.h`` (``quantize::Params``) and
``dequantization_utils.h``:

- Input is read as ``__half`` (the kernels take ``const __half*``). We convert any float input to
  fp16 first; the CUDA kernel would reinterpret the bits of a bf16/fp32 tensor instead (DeepSpeed's
  ``CUDAQuantizer.quantize`` converts weights itself; the qgZ gradient path does not, so on a GPU
  qgZ is only correct when the communication dtype is fp16).
- Symmetric, b bits: ``max`` = absmax of the group (fp16 values, NaN ignored like ``__hmax2``);
  ``scale = 2**b / (2 * max)`` in fp32 (1.0 when max == 0); ``q = rint(x * scale)`` (round half
  to even, ``__float2int_rn``; NaN -> 0) clamped to ``[-2**(b-1), 2**(b-1) - 1]``. Note the range:
  ``+max`` maps to ``2**(b-1)`` and is clipped to ``2**(b-1) - 1`` (int4: 7/8 of max), ``-max`` is
  representable. Stored parameter: ``1 / scale`` (fp32, one per group); dequantize is
  ``q * stored`` rounded to the output dtype.
- Asymmetric (supported by the op, unused by ZeRO++): ``scale = 2**b / (max - min)`` (1.0 when
  equal), ``offset = (max + min) / 2``, ``q = rint((x - offset) * scale)``; stored ``[1/scale,
  offset]``; dequantize ``q * stored + offset``.
- int4 codes are packed two per byte through ``struct PackedInt4 {int8_t high : 4; int8_t low : 4;}``
  with element 2i in ``low`` and 2i+1 in ``high``.
- ``quantized_reduction`` dequantizes each of the ``devices_per_node`` received tensors to fp16,
  sums them in fp16 (``__hadd2``, in rank order) and re-quantizes the sum with ``out_groups``.
- ``swizzle_quant`` permutes whole groups: input group ``(z, y, x)`` (partition z, pipeline slice
  y, group x within the slice) goes to output slot ``y * P + (z % devices_per_node) * nodes +
  z // devices_per_node``; scales follow their group.

Where we had to guess (documented in the benchmark report too):

- Nibble order in a byte: bit-field allocation is implementation-defined in C++; on the Itanium
  ABI that nvcc follows on Linux the FIRST declared field (``high``) takes the least significant
  bits, so element 2i sits in bits 4-7 and 2i+1 in bits 0-3. (DeepSpeed's NPU port of this op
  puts element 2i in the low nibble; only byte-level interoperability with a GPU peer depends on
  it, never the values or the byte counts.)
- NaN handling follows sm_80+ (``__hmax2`` ignores NaN; ``cvt.rni.s32.f32`` maps NaN to 0): a NaN
  is dropped from the group maximum and encodes as 0; an inf makes the scale 0, the stored value
  inf, and the whole group decodes to NaN. Older GPUs use a ``>`` comparison instead.
- fp16 accumulation in ``quantized_reduction``: PyTorch adds two fp16 tensors in fp32 and rounds
  to fp16, which equals ``__hadd2`` except in double-rounding corner cases.
- The NPU port (``deepspeed/ops/op_builder/npu/quantizer.py``) truncates toward zero; the CUDA
  source says ``__float2int_rn`` (round to nearest), which is what we follow.
"""

from __future__ import annotations

import enum

import torch

__all__ = [
    "QuantType",
    "quantize",
    "dequantize",
    "dequantize_fp32",
    "swizzle_quant",
    "quantized_reduction",
    "CPUQuantizerOps",
    "pack_int4",
    "unpack_int4",
]


class QuantType(enum.IntEnum):
    """``quantize::Type`` (the pybind enum ``QuantizationType`` exports these two names)."""

    Symmetric = 0
    Asymmetric = 1


def _check(num_bits: int, quant_type) -> QuantType:
    if num_bits not in (4, 8):
        raise ValueError(f"DeepSpeed's quantizer op supports num_bits 4 or 8, got {num_bits}")
    try:
        return QuantType(int(quant_type))
    except ValueError:
        raise ValueError(f"unknown quant_type {quant_type!r}; expected Symmetric (0) or Asymmetric (1)") from None


def _groups_view(t: torch.Tensor, groups: int, what: str) -> torch.Tensor:
    n = t.numel()
    if groups <= 0 or n % groups:
        raise ValueError(f"{what}: {n} elements do not split into {groups} equal groups")
    return t.reshape(groups, n // groups)


def _as_half(x: torch.Tensor) -> torch.Tensor:
    if not x.is_floating_point():
        raise TypeError(f"the quantizer reads fp16 input; got a {x.dtype} tensor")
    return x.to(torch.float16)


def _nan_ignoring(x: torch.Tensor, fill: float) -> torch.Tensor:
    # __hmax2/__hmin2 (sm_80+) return the other operand when one is NaN; reductions start at
    # -inf (max) / +inf (min), so an all-NaN group yields the start value.
    return torch.where(torch.isnan(x), torch.full_like(x, fill), x)


def _group_params(xg: torch.Tensor, num_bits: int, qt: QuantType):
    """Per-group (scale, offset, stored params) from fp32 copies of fp16 values [groups, n]."""
    levels = float(1 << num_bits)
    if qt is QuantType.Symmetric:
        mx = _nan_ignoring(xg.abs(), float("-inf")).amax(dim=1, keepdim=True)
        scale = torch.where(mx == 0, torch.ones_like(mx), levels / (2.0 * mx))
        offset = None
        stored = 1.0 / scale
    else:
        mx = _nan_ignoring(xg, float("-inf")).amax(dim=1, keepdim=True)
        mn = _nan_ignoring(xg, float("inf")).amin(dim=1, keepdim=True)
        scale = torch.where(mx == mn, torch.ones_like(mx), levels / (mx - mn))
        offset = (mx + mn) / 2.0
        stored = torch.cat([1.0 / scale, offset], dim=1)
    return scale, offset, stored.to(torch.float32).contiguous()


def _codes(xg: torch.Tensor, scale, offset, num_bits: int) -> torch.Tensor:
    """int8 codes of fp32 values: rint((x - offset) * scale), NaN -> 0, clamped to the b-bit range."""
    v = xg if offset is None else xg - offset
    v = v * scale
    v = torch.nan_to_num(v, nan=0.0)  # cvt.rni.s32.f32: NaN -> 0; +-inf saturate, then clamp below
    lo, hi = -(1 << (num_bits - 1)), (1 << (num_bits - 1)) - 1
    return torch.round(v).clamp_(lo, hi).to(torch.int8)  # torch.round: half to even, like _rn


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Flat int8 codes in [-8, 7] (even count) -> bytes: element 2i in bits 4-7, 2i+1 in bits 0-3."""
    c = codes.reshape(-1, 2).to(torch.int16)
    return (((c[:, 0] & 0xF) << 4) | (c[:, 1] & 0xF)).to(torch.uint8).view(torch.int8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: int8 bytes -> flat int8 codes (sign-extended nibbles)."""
    b = packed.reshape(-1).view(torch.int8).to(torch.int16)
    first = b >> 4  # arithmetic shift of the sign-extended byte: bits 4-7 as a signed nibble
    second = b & 0xF
    second = torch.where(second >= 8, second - 16, second)  # sign-extend bits 0-3
    return torch.stack([first, second], dim=1).reshape(-1).to(torch.int8)


def _encode(xg: torch.Tensor, num_bits: int, qt: QuantType):
    """fp32 groups [groups, n] -> (flat packed int8 bytes, stored params [groups, 1 or 2])."""
    if num_bits == 4 and xg.shape[1] % 2:
        raise ValueError(f"int4 packs two values per byte; a group of {xg.shape[1]} elements is odd")
    scale, offset, stored = _group_params(xg, num_bits, qt)
    q = _codes(xg, scale, offset, num_bits).reshape(-1)
    return (pack_int4(q) if num_bits == 4 else q), stored


def _decode(data: torch.Tensor, params: torch.Tensor, groups: int, num_bits: int, qt: QuantType) -> torch.Tensor:
    """Flat packed bytes -> fp32 values [groups, n]: q * stored (+ offset)."""
    q = unpack_int4(data) if num_bits == 4 else data.reshape(-1).view(torch.int8)
    qg = _groups_view(q, groups, "dequantize").to(torch.float32)
    p = _groups_view(params.to(torch.float32), groups, "dequantize params")
    width = 2 if qt is QuantType.Asymmetric else 1
    if p.shape[1] != width:
        raise ValueError(f"dequantize: {qt.name} needs {width} parameter(s) per group, got {p.shape[1]}")
    out = qg * p[:, :1]
    return out + p[:, 1:2] if qt is QuantType.Asymmetric else out


def _packed_shape(shape: torch.Size, num_bits: int, grow: bool) -> list[int]:
    s = list(shape) or [1]
    if num_bits == 4:
        if not grow and s[-1] % 2:
            raise ValueError(f"int4 output halves the last dimension; {s[-1]} is odd")
        s[-1] = s[-1] * 2 if grow else s[-1] // 2
    return s


# ----------------------------------------------------------------------------- the four ops


def quantize(input_vals: torch.Tensor, groups: int, num_bits: int, quant_type) -> list[torch.Tensor]:
    """``quantize_kernel``: [int8 codes (last dim halved for int4), fp32 params [groups, 1|2]]."""
    qt = _check(num_bits, quant_type)
    xg = _groups_view(_as_half(input_vals), groups, "quantize").to(torch.float32)
    data, stored = _encode(xg, num_bits, qt)
    return [data.reshape(_packed_shape(input_vals.shape, num_bits, grow=False)), stored]


def _dequantize(quantized_data, params, groups, num_bits, quant_type, dtype) -> torch.Tensor:
    qt = _check(num_bits, quant_type)
    out = _decode(quantized_data, params, groups, num_bits, qt).to(dtype)  # conversion::to<T>: rn
    return out.reshape(_packed_shape(quantized_data.shape, num_bits, grow=True))


def dequantize(
    quantized_data: torch.Tensor, params: torch.Tensor, groups: int, num_bits: int, quant_type
) -> torch.Tensor:
    """``dequantize<__half>``: fp16 values, last dim doubled for int4."""
    return _dequantize(quantized_data, params, groups, num_bits, quant_type, torch.float16)


def dequantize_fp32(
    quantized_data: torch.Tensor, params: torch.Tensor, groups: int, num_bits: int, quant_type
) -> torch.Tensor:
    """``dequantize<float>``: fp32 values, last dim doubled for int4."""
    return _dequantize(quantized_data, params, groups, num_bits, quant_type, torch.float32)


def swizzle_slots(groups: int, pipeline_size: int, nodes: int, devices_per_node: int) -> torch.Tensor:
    """Output group index of every input group (``swizzled_quant_kernel``'s block mapping)."""
    partitions = nodes * devices_per_node
    if groups % partitions or (groups // partitions) % pipeline_size:
        raise ValueError(
            f"swizzle_quant: {groups} groups do not split into {partitions} partitions x "
            f"{pipeline_size} pipeline slices"
        )
    contiguous = groups // partitions // pipeline_size
    g = torch.arange(groups)
    x = g % contiguous
    y = (g // contiguous) % pipeline_size
    z = g // (contiguous * pipeline_size)
    out_partition = y * partitions + (z % devices_per_node) * nodes + z // devices_per_node
    return out_partition * contiguous + x


def swizzle_quant(
    input_vals: torch.Tensor,
    groups: int,
    num_bits: int,
    quant_type,
    pipeline_size: int,
    nodes: int,
    devices_per_node: int,
) -> list[torch.Tensor]:
    """``ds_swizzle_quant``: [flat int8 (numel / (8 / num_bits)), fp32 params [groups, 1|2]], the
    groups reordered so that the data for each intra-node peer is one contiguous run."""
    qt = _check(num_bits, quant_type)
    slots = swizzle_slots(groups, pipeline_size, nodes, devices_per_node)
    xg = _groups_view(_as_half(input_vals), groups, "swizzle_quant").to(torch.float32)
    if num_bits == 4 and xg.shape[1] % 2:
        raise ValueError(f"int4 packs two values per byte; a group of {xg.shape[1]} elements is odd")
    scale, offset, stored = _group_params(xg, num_bits, qt)
    q = _codes(xg, scale, offset, num_bits)
    q_out = torch.empty_like(q).index_copy_(0, slots, q)  # group g is written to row slots[g]
    p_out = torch.empty_like(stored).index_copy_(0, slots, stored)
    flat = q_out.reshape(-1)
    return [pack_int4(flat) if num_bits == 4 else flat, p_out]


def quantized_reduction(
    input_vals: torch.Tensor,
    input_scales: torch.Tensor,
    in_groups: int,
    out_groups: int,
    num_bits: int,
    quant_type,
    devices_per_node: int,
) -> list[torch.Tensor]:
    """``quantized_reduction`` (``dequant_reduce``): the ``devices_per_node`` quantized tensors
    stored back to back in ``input_vals`` (each with ``in_groups / devices_per_node`` groups of
    ``input_scales``) are dequantized to fp16, summed in fp16 and re-quantized into
    ``out_groups`` groups: [int8 (last dim / devices_per_node), fp32 params [out_groups, 1|2]]."""
    qt = _check(num_bits, quant_type)
    if input_vals.numel() % devices_per_node or in_groups % devices_per_node:
        raise ValueError(
            f"quantized_reduction: {input_vals.numel()} bytes / {in_groups} groups do not split "
            f"over {devices_per_node} devices"
        )
    per_tensor_bytes = input_vals.numel() // devices_per_node
    per_tensor_groups = in_groups // devices_per_node
    data = input_vals.reshape(devices_per_node, per_tensor_bytes)
    width = 2 if qt is QuantType.Asymmetric else 1
    scales = input_scales.reshape(devices_per_node, per_tensor_groups, width)
    acc = None
    for j in range(devices_per_node):  # __hadd2 in rank order, starting from +0
        part = _decode(data[j], scales[j], per_tensor_groups, num_bits, qt).to(torch.float16).reshape(-1)
        acc = part if acc is None else acc + part
    xg = _groups_view(acc, out_groups, "quantized_reduction output").to(torch.float32)
    out, stored = _encode(xg, num_bits, qt)
    shape = list(input_vals.shape) or [1]
    shape[-1] //= devices_per_node
    return [out.reshape(shape), stored]


class CPUQuantizerOps:
    """Drop-in for the loaded CUDA op module (``QuantizerBuilder().load()``): the attributes
    ZeRO++ reads. Pure functions, no state; install with ``benchmarks.zeropp.install_cpu_kernels``."""

    Symmetric = QuantType.Symmetric
    Asymmetric = QuantType.Asymmetric
    quantize = staticmethod(quantize)
    dequantize = staticmethod(dequantize)
    dequantize_fp32 = staticmethod(dequantize_fp32)
    swizzle_quant = staticmethod(swizzle_quant)
    quantized_reduction = staticmethod(quantized_reduction)
