"""One fused step of sdpq.optim.AdamW as a PyTorch operator: ``torch.ops.sdpq.adamw_step``
(and ``adamw_step_many``, the same for a list of parameters).

    CPU    C++ (``sdpq/csrc/adamw.cpp``, built at first use by ``native``): every state layout
    CUDA   Triton (``sdpq.kernels.adamw``): E4M3 m and v, MCF master, a power-of-two group size
    Meta   nothing to compute (the step is in place), so the operator traces under torch.compile

    adamw_step(Tensor(a!) param, Tensor(b!)? param_lo, Tensor grad, Tensor(c!)[] exp_avg,
               Tensor(d!)[] exp_avg_sq, str m_format, str v_format, float lr, float beta1,
               float beta2, float eps, float weight_decay, int step, int group_size) -> ()

All tensors are the 2-D row views (``sdpq.optim.layout.rows``) of one parameter's local
tensors, contiguous, [rows, cols]; FP8 groups run along each row and the last group of a row
may be partial. ``param``: float32 / bfloat16 / float16; ``param_lo``: the MCF compensation
(bfloat16; then ``param`` is bfloat16 and the master is the pair), None for a native master.
``grad``: float32 / bfloat16 / float16. A moment is given by its format and its storage
tensors (``sdpq.optim.states``):

    "e4m3" / "e5m2"   [codes uint8 [rows, cols], scale, k, gm float32 [rows, groups]]
    "bf16" / "fp32"   [state [rows, cols]]
    "pair"            [hi, lo] bfloat16 [rows, cols]  (second moment only)

``step`` is the step number after its increment (bias corrections use it).

``adamw_step_many`` takes the same arguments as lists, one entry per parameter (``exp_avg`` and
``exp_avg_sq`` concatenate each parameter's storage tensors, ``param_lo`` is empty or full,
``steps`` an int per parameter) and steps them all in one call on CPU: ``sdpq.optim.AdamW``
makes one call per parameter group, since a call through the dispatcher costs about as much as
the step of a parameter of a few thousand values. The arithmetic is
that of ``sdpq.optim.AdamW``'s PyTorch path, which stays the reference: bitwise without FP8
states, within the rounding of log2 / exp2 with them (see the header of ``sdpq/csrc/adamw.cpp``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..config import TILE_MAX
from . import native

__all__ = ["cpu_available"]

_LIB = torch.library.Library("sdpq", "FRAGMENT")  # noqa: TOR901 (the optimizer's share of the namespace)
_LIB.define(
    "adamw_step(Tensor(a!) param, Tensor(b!)? param_lo, Tensor grad, Tensor(c!)[] exp_avg, "
    "Tensor(d!)[] exp_avg_sq, str m_format, str v_format, float lr, float beta1, float beta2, "
    "float eps, float weight_decay, int step, int group_size) -> ()"
)
# adamw_step for every parameter of a list in one call (CPU): exp_avg / exp_avg_sq concatenate
# each parameter's storage tensors (as many as its format takes); param_lo is empty or one per
# parameter.
_LIB.define(
    "adamw_step_many(Tensor(a!)[] params, Tensor(b!)[] param_lo, Tensor[] grads, Tensor(c!)[] exp_avg, "
    "Tensor(d!)[] exp_avg_sq, str[] m_formats, str[] v_formats, float lr, float beta1, float beta2, "
    "float eps, float weight_decay, int[] steps, int group_size) -> ()"
)


@functools.lru_cache(maxsize=1)
def cpu_available() -> bool:
    """The C++ kernel is registered for CPU tensors (built now if needed)."""
    return native.load("adamw")


class StepArgs(NamedTuple):
    """The arguments of ``sdpq::adamw_step``, in schema order."""

    param: torch.Tensor
    param_lo: torch.Tensor | None
    grad: torch.Tensor
    exp_avg: list[torch.Tensor]
    exp_avg_sq: list[torch.Tensor]
    m_format: str
    v_format: str
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int
    group_size: int


@torch.library.register_fake("sdpq::adamw_step")
def _adamw_step_fake(*args):
    return None


@torch.library.register_fake("sdpq::adamw_step_many")
def _adamw_step_many_fake(*args):
    return None


def _adamw_step_cuda(*args):
    a = StepArgs(*args)
    pow2 = a.group_size & (a.group_size - 1) == 0 and 0 < a.group_size <= TILE_MAX
    if not (a.m_format == a.v_format == "e4m3" and a.param_lo is not None and pow2):
        raise NotImplementedError(
            f"sdpq::adamw_step on CUDA covers E4M3 m and v with an MCF master and a power-of-two group size "
            f"up to {TILE_MAX} (a group is one tile of the kernel) "
            f"(got m_format={a.m_format!r}, v_format={a.v_format!r}, MCF master: {a.param_lo is not None}, "
            f"group_size={a.group_size}); use sdpq.optim.AdamW, whose PyTorch path covers every layout"
        )
    from .adamw import adamw_fp8_mcf_step

    hyper = dict(lr=a.lr, b1=a.beta1, b2=a.beta2, eps=a.eps, wd=a.weight_decay, step=a.step, group_size=a.group_size)
    adamw_fp8_mcf_step(a.param, a.param_lo, a.grad, tuple(a.exp_avg), tuple(a.exp_avg_sq), **hyper)


_LIB.impl("adamw_step", _adamw_step_cuda, "CUDA")
