"""Thin wrappers over the two collectives the algorithms use, on 2-D row buffers.

Each collective moves ONE buffer (codes and scales packed together by sdpq.quant.wire), so a
quantized exchange costs the latency of one collective, like the unquantized one.

A group is a torch.distributed group (the registry's functions run it) or a `DirectGroup` (a
group object outside that registry, driven through its own methods: see direct_group.py); every
collective here takes either, so the algorithms above never ask which.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .device import comm_device
from .direct_group import DirectGroup

__all__ = [
    "all_gather_flat",
    "all_gather_rows",
    "all_to_all_rows",
    "all_to_all_split",
    "all_gather_objects",
    "all_reduce_sum",
    "group_device",
    "group_ranks",
    "group_size",
    "reduce_scatter_flat",
]

# torch >= 2.13 renamed the flat collectives (the old names warn); older releases lack the new.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gather_into(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False):
    if isinstance(group, DirectGroup):
        return group.all_gather(out, inp, async_op)
    return _all_gather_single(out, inp, group=group, async_op=async_op)


def _all_to_all(out: torch.Tensor, inp: torch.Tensor, group, out_splits=None, in_splits=None, async_op=False):
    if isinstance(group, DirectGroup):
        return group.all_to_all(out, inp, out_splits, in_splits, async_op)
    return dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=async_op)


def _through_host(t: torch.Tensor, group) -> bool:
    """True where gloo must carry an accelerator's tensor: gloo's all-gather, reduce-scatter and
    all-to-all take CPU tensors only, so sdpq stages its buffers through the host there.

    Note: only a gloo group with CUDA tensors takes this path (several ranks sharing one GPU,
    which NCCL refuses: the GPU check's training steps). It copies every buffer twice and waits
    for the collective; NCCL groups never stage, and a CPU tensor on an NCCL group stays an
    error, as it must (sdpq makes collective buffers on comm_device(group))."""
    return t.device.type != "cpu" and comm_device(group).type == "cpu"


def reduce_scatter_flat(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """SUM reduce-scatter of a flat buffer (the plain, unquantized collective)."""
    if isinstance(group, DirectGroup):
        # Note: only the exact reduce-scatter collective takes this path; sdpq's all-reduce (the
        # one a DirectGroup serves) sums with all_reduce_sum in its exact mode.
        raise TypeError("reduce_scatter_flat: a DirectGroup offers all-gather, all-to-all and all-reduce only")
    if _through_host(inp, group):
        host = torch.empty(out.shape, dtype=out.dtype)
        _reduce_scatter_single(host, inp.cpu(), group=group)
        out.copy_(host)
        return
    _reduce_scatter_single(out, inp, group=group)


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """Every member's flat `inp` into `out`, in group-rank order (the plain, unquantized collective)."""
    if _through_host(inp, group):
        host = torch.empty(out.shape, dtype=out.dtype)
        _gather_into(host, inp.cpu(), group)
        out.copy_(host)
        return
    _gather_into(out, inp, group)


def all_reduce_sum(t: torch.Tensor, group) -> None:
    """t <- the sum over the group (the plain, unquantized all-reduce), in place, completed."""
    if isinstance(group, DirectGroup):
        group.all_reduce_sum(t)
        return
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)


def group_size(group) -> int:
    if isinstance(group, DirectGroup):
        return group.size
    return 1 if group is None else dist.get_world_size(group)


def group_ranks(group) -> list[int]:
    """The members' names (global ranks) in group order."""
    if isinstance(group, DirectGroup):
        return list(group.ranks)
    return dist.get_process_group_ranks(group)


def all_gather_objects(obj, group) -> list:
    """Every member's picklable `obj` in group order (messages and set-up only: it reads the host)."""
    if isinstance(group, DirectGroup):
        return group.all_gather_object(obj)
    everyone: list = [None] * group_size(group)
    dist.all_gather_object(everyone, obj, group=group)
    return everyone


def group_device(group) -> torch.device:
    """Where a small bookkeeping tensor for a collective on `group` must live (NCCL: this rank's
    current GPU, see comm_device). None is no group here (a group of one: no collective runs)."""
    return torch.device("cpu") if group is None else comm_device(group)


def all_gather_rows(row: torch.Tensor, group, async_op: bool = False, out: torch.Tensor | None = None):
    """Every member's 1-D `row` stacked in group-rank order: ([k, len], work or None).

    out: a contiguous buffer of k * len elements of row's dtype to gather into (the caller's
    output bucket: no full-size buffer is allocated, and none copied afterwards)."""
    k = group_size(group)
    if out is not None and (out.numel() != k * row.numel() or out.dtype != row.dtype or not out.is_contiguous()):
        raise ValueError(f"all_gather_rows: out must be a contiguous {row.dtype} buffer of {k * row.numel()} elements")
    if k == 1:
        return (row.unsqueeze(0), None) if out is None else (out.view(1, -1).copy_(row.view(1, -1)), None)
    if _through_host(row, group):
        host = torch.empty(k * row.numel(), dtype=row.dtype)
        _gather_into(host, row.contiguous().view(-1).cpu(), group)
        full = host.to(row.device) if out is None else out.view(-1).copy_(host)
        return full.view(k, -1), None
    # gloo wants a flat output (k * len), not [k, len]
    out = torch.empty(k * row.numel(), dtype=row.dtype, device=row.device) if out is None else out.view(-1)
    work = _gather_into(out, row.contiguous().view(-1), group, async_op)
    return out.view(k, -1), work


def all_to_all_rows(rows: torch.Tensor, group, async_op: bool = False):
    """Row j of `rows` [k, len] goes to group rank j; row j of the result came from rank j.
    Returns (result, work): work is None where the exchange has completed (a group of one, or
    one staged through the host, which waits)."""
    k = group_size(group)
    if k == 1:
        return rows, None
    if rows.shape[0] != k:
        raise ValueError(f"all_to_all_rows: {rows.shape[0]} rows for a group of {k}")
    if _through_host(rows, group):
        host = torch.empty(rows.shape, dtype=rows.dtype)
        _all_to_all(host, rows.contiguous().cpu(), group)
        return host.to(rows.device), None
    out = torch.empty_like(rows)
    work = _all_to_all(out, rows.contiguous(), group, async_op=async_op)
    return out, work


def all_to_all_split(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> None:
    """all_to_all_single with split sizes (a flat `inp` cut in `in_splits`, one piece per group
    rank; `out` receives `out_splits`), completed on return."""
    if _through_host(inp, group):
        host = torch.empty(out.shape, dtype=out.dtype)
        _all_to_all(host, inp.cpu(), group, out_splits, in_splits)
        out.copy_(host)
        return
    _all_to_all(out, inp, group, out_splits, in_splits)
