"""Skip the whole optimizer step on a non-finite gradient, the way loss-scaler overflow is
handled: states unchanged, a counter incremented, a warning logged (or an error raised).

Every rank must take the same decision, or shards of one model would diverge: the flag is
max-reduced over the meshes of DTensor parameters and over an optional process group (the
ZeRO-3 data-parallel group, whose flat partitions are plain tensors). One host sync per step.
The flag lives on each group's communication device (comm_device), not on the parameters':
with CPU offload (DeepSpeed's offload_optimizer, FSDP2's CPUOffloadPolicy) the parameters and
gradients are on the CPU while the group is NCCL.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from ..comm.device import comm_device
from ..kernels import finite_ops
from .layout import is_dtensor, local

logger = logging.getLogger("sdpq.optim")

ON_NONFINITE = ("skip", "raise")


def check_on_nonfinite(value: str) -> str:
    if value not in ON_NONFINITE:
        raise ValueError(f"on_nonfinite={value!r}: allowed values are {ON_NONFINITE}")
    return value


def _groups(params: list[Tensor], sync_group) -> list:
    groups, seen = [], set()
    for p in params:
        if is_dtensor(p):
            for g in p.device_mesh.get_all_groups():
                if id(g) not in seen:
                    seen.add(id(g))
                    groups.append(g)
    if sync_group is not None and id(sync_group) not in seen:
        groups.append(sync_group)
    return groups


def _first_nonfinite(grads: list[Tensor], device: torch.device) -> tuple[Tensor, Tensor | int | None]:
    """(flag: 1.0 when some local gradient has inf/nan, which one). Which one is an int from
    the C++ scan (one call, CPU), else a per-gradient finite mask computed on the device (no
    host sync before the all-reduce)."""
    if not grads:
        return torch.zeros(1, device=device), None
    if all(g.device.type == "cpu" for g in grads) and finite_ops.cpu_available():
        first = torch.ops.sdpq.first_nonfinite(grads)
        return torch.full((1,), float(first >= 0), device=device), first
    # min and max are finite iff every element is (NaN propagates); no temporaries, no
    # overflow; empty shards count as finite
    ends = torch.stack(
        [
            torch.stack(torch.aminmax(g.reshape(-1))).float().to(device) if g.numel() else torch.zeros(2, device=device)
            for g in grads
        ]
    )
    finite = torch.isfinite(ends).all(1)
    return (~finite).any().float().reshape(1), finite


def nonfinite_index(params: list[Tensor], all_params: list[Tensor], sync_group=None) -> int | None:
    """Index (into params, those with a gradient) of the first parameter whose local gradient
    has inf/nan, -1 when only another rank saw one, None when all are finite everywhere.
    all_params (every parameter of the optimizer, same on all ranks) picks the groups."""
    grads = [local(p.grad) for p in params if p.grad is not None]  # params: those with a gradient
    groups = _groups(all_params, sync_group)
    if groups:
        device = comm_device(groups[0])
    else:
        device = local(all_params[0]).device if all_params else torch.device("cpu")
    flag, which = _first_nonfinite(grads, device)
    if groups:
        import torch.distributed as dist

        for g in groups:
            target = comm_device(g)
            if flag.device != target:  # a mesh whose dimensions use different backends
                flag = flag.to(target)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=g)
    if not flag.item():
        return None
    if isinstance(which, int):
        return which
    if which is not None and not which.all():
        return int((~which).nonzero()[0, 0])
    return -1


def handle(index: int, names: list[str], on_nonfinite: str, skipped: int) -> None:
    where = names[index] if index >= 0 else "a gradient on another rank"
    if on_nonfinite == "raise":
        raise FloatingPointError(
            f"non-finite (inf/nan) gradient in {where}; pass on_nonfinite='skip' to skip such steps instead"
        )
    logger.warning(
        "sdpq.optim: non-finite gradient in %s: step skipped, states unchanged (%d step(s) skipped so far)",
        where,
        skipped,
    )
