"""The tensor arguments of ``torch.ops.sdpq.adamw_step`` for one parameter, built once.

Note: building them (row views of the parameter and of every state tensor, the format names)
takes about a dozen reshape / view calls and as many lookups: ~40 us of Python per parameter
and step, more than the kernel itself for parameters under ~10K values (FSDP2 shards of norms
and biases). A NativeArgs is reused while it is ``current``: the same parameter storage, the
same v_format and the very same tensors in the state dict. A new storage (``p.data = ...``), a
re-encoded state (``states.encode``) or a loaded checkpoint gives new tensors and a rebuild.
Until then the cached views keep the tensors they were built from alive.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import Tensor

from ..kernels import adamw_ops
from . import states
from .layout import rows

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def op_format(st: dict, name: str, fp8_fmt: str) -> str | None:
    """The adamw_step format name of a stored state (None: a format the kernels do not take)."""
    return {"fp8": fp8_fmt, "bf16": "bf16", "fp32": "fp32", "pair": "pair"}.get(states.stored_format(st, name) or "")


def op_tensors(st: dict, name: str, n_rows: int) -> list[Tensor]:
    """The storage of a state as adamw_step takes it: 2-D row views, metadata [rows, groups]."""
    fmt = states.stored_format(st, name)
    assert fmt is not None, name
    return [
        st[k].reshape(n_rows, -1) if states.is_metadata_key(k) else rows(st[k]) for k in states.storage_keys(name, fmt)
    ]


def _key(pl: Tensor, st: dict, v_format: str) -> tuple[tuple, tuple]:
    """(what compares by value, the state dict's tensors, which compare by identity)."""
    return (pl.data_ptr(), pl.shape, pl.dtype, v_format), tuple(st.values())


@dataclass(frozen=True, eq=False)
class NativeArgs:
    key: tuple[tuple, tuple]  # what the views were built from (_key)
    param: Tensor
    param_lo: Tensor | None
    exp_avg: list[Tensor]
    exp_avg_sq: list[Tensor]
    m_format: str
    v_format: str

    @staticmethod
    def build(pl: Tensor, st: dict, v_format: str) -> NativeArgs | None:
        """The arguments for local parameter pl and its state, or None where the C++ step does
        not apply: not on CPU, a parameter dtype it does not take, foreign state dtypes (e.g.
        fp16 states loaded from a checkpoint), or no kernel (no compiler)."""
        fm, fv = op_format(st, "exp_avg", "e4m3"), op_format(st, "exp_avg_sq", v_format)
        if not (pl.device.type == "cpu" and pl.dtype in KERNEL_DTYPES and fm not in (None, "pair") and fv):
            return None
        if not adamw_ops.cpu_available():
            return None
        P = rows(pl)
        lo = rows(st["master_lo"]) if "master_lo" in st else None
        n = P.shape[0]
        return NativeArgs(
            _key(pl, st, v_format), P, lo, op_tensors(st, "exp_avg", n), op_tensors(st, "exp_avg_sq", n), fm, fv
        )

    def current(self, pl: Tensor, st: dict, v_format: str) -> bool:
        (value, tensors), (value0, tensors0) = _key(pl, st, v_format), self.key
        return value == value0 and len(tensors) == len(tensors0) and all(map(operator.is_, tensors, tensors0))
