"""Storage formats of one optimizer state tensor inside a per-parameter state dict.

A state ``name`` (e.g. "exp_avg") is stored under self-describing keys, all plain tensors
with the parameter's local shape (metadata: last dim = number of groups):

    "fp32" / "bf16" / any float: name                           (the tensor itself)
    "fp8":  name_codes (uint8), name_scale, name_k, name_gm     (fp32, COAT expansion)
    "pair": name (bf16 hi), name_lo (bf16)                      (MCF, Collage)

Keeping only tensors (no strings) lets torch.save and torch.distributed.checkpoint store
them, and lets a checkpoint be read back in any format (``stored_format``).
Blocks (rows, cols) address the 2-D row view of the local tensor (see layout.rows).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..quant import mcf
from ..quant.fp8 import FP8Quantized, dequantize_fp8, fp8_empty, quantize_fp8
from .layout import rows

FORMATS = ("fp32", "bf16", "fp8", "pair")
METADATA_SUFFIXES = ("_scale", "_k", "_gm")
_FP8_SUFFIXES = ("_codes",) + METADATA_SUFFIXES
_ALL = slice(None)


def storage_keys(name: str, fmt: str) -> list[str]:
    if fmt == "fp8":
        return [name + s for s in _FP8_SUFFIXES]
    if fmt == "pair":
        return [name, name + "_lo"]
    return [name]


def is_metadata_key(key: str) -> bool:
    return key.endswith(METADATA_SUFFIXES)


def stored_format(st: dict, name: str) -> str | None:
    """Format of state ``name`` in st: "fp8", "pair", "fp32", "bf16", "plain" (other float
    dtypes, e.g. fp16 or fp64 from a foreign checkpoint) or None when absent."""
    if name + "_codes" in st:
        return "fp8"
    if name + "_lo" in st:
        return "pair"
    t = st.get(name)
    if not isinstance(t, Tensor) or not t.is_floating_point():
        return None
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(t.dtype, "plain")


def allocate(st: dict, name: str, fmt: str, shape, device, fp8_fmt: str = "e4m3", group_size: int = 128) -> None:
    """Zero state (decodes to exact zeros in every format)."""
    if fmt == "fp8":
        q = fp8_empty(shape, fp8_fmt, group_size, expand=True, device=device)
        for key, t in zip(storage_keys(name, fmt), q.tensors()):
            st[key] = t
    elif fmt == "pair":
        st[name] = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        st[name + "_lo"] = torch.zeros(shape, dtype=torch.bfloat16, device=device)
    elif fmt in ("fp32", "bf16"):
        st[name] = torch.zeros(shape, dtype=torch.float32 if fmt == "fp32" else torch.bfloat16, device=device)
    else:
        raise ValueError(f"fmt={fmt!r}: allowed state formats are {FORMATS}")


def fp8_of(st: dict, name: str, fp8_fmt: str, group_size: int) -> FP8Quantized:
    """The FP8 state as 2-D views (rows x cols codes, rows x groups metadata)."""
    codes = rows(st[name + "_codes"])
    scale, k, gm = (st[name + s].reshape(codes.shape[0], st[name + s].shape[-1]) for s in METADATA_SUFFIXES)
    return FP8Quantized(codes, scale, k, gm, fmt=fp8_fmt, group_size=group_size)


def read(
    st: dict, name: str, fmt: str, r: slice = _ALL, c: slice = _ALL, fp8_fmt: str = "e4m3", group_size: int = 128
) -> Tensor:
    """fp32 value of a block. For "fp32" this is a VIEW of the state (updates land in place);
    otherwise a fresh tensor that ``write`` encodes back."""
    if fmt == "fp8":
        return dequantize_fp8(fp8_of(st, name, fp8_fmt, group_size).block(r, c))
    if fmt == "pair":
        return mcf.value(rows(st[name])[r, c], rows(st[name + "_lo"])[r, c])
    block = rows(st[name])[r, c]
    return block if block.dtype == torch.float32 else block.float()


def write(
    st: dict,
    name: str,
    fmt: str,
    value: Tensor,
    r: slice = _ALL,
    c: slice = _ALL,
    fp8_fmt: str = "e4m3",
    group_size: int = 128,
) -> None:
    """Encode an fp32 block into the stored format, in place."""
    if fmt == "fp8":
        quantize_fp8(value, fp8_fmt, group_size, out=fp8_of(st, name, fp8_fmt, group_size).block(r, c))
    elif fmt == "pair":
        hi, lo = mcf.split(value)
        rows(st[name])[r, c].copy_(hi)
        rows(st[name + "_lo"])[r, c].copy_(lo)
    else:
        block = rows(st[name])[r, c]
        if block.data_ptr() != value.data_ptr():
            block.copy_(value)


def pair_views(st: dict, name: str, r: slice = _ALL, c: slice = _ALL) -> tuple[Tensor, Tensor]:
    return rows(st[name])[r, c], rows(st[name + "_lo"])[r, c]


def decode(st: dict, name: str, fp8_fmt: str = "e4m3", group_size: int = 128) -> Tensor:
    """The whole state as a new fp32 tensor of the stored (local) shape."""
    fmt = stored_format(st, name)
    if fmt is None:
        raise KeyError(f"state {name!r} is not stored (keys: {sorted(st)})")
    shape = st[name + "_codes"].shape if fmt == "fp8" else st[name].shape
    value = read(st, name, fmt, fp8_fmt=fp8_fmt, group_size=group_size)
    return value.clone().view(shape) if fmt == "fp32" else value.reshape(shape)


def encode(st: dict, name: str, fmt: str, value: Tensor, fp8_fmt: str = "e4m3", group_size: int = 128) -> None:
    """Store ``value`` (any float dtype) as state ``name`` in format fmt, replacing any
    previous storage of that state."""
    for f in ("fp8", "pair", "fp32"):
        for key in storage_keys(name, f):
            st.pop(key, None)
    allocate(st, name, fmt, value.shape, value.device, fp8_fmt, group_size)
    if value.numel():
        write(st, name, fmt, rows(value.contiguous()).float(), fp8_fmt=fp8_fmt, group_size=group_size)


def nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()
