"""Thin wrappers over the two collectives the algorithms use, on 2-D row buffers.

Each collective moves ONE buffer (codes and scales packed together by sdpq.quant.wire), so a
quantized exchange costs the latency of one collective, like the unquantized one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .device import comm_device

__all__ = [
    "all_gather_flat",
    "all_gather_rows",
    "all_to_all_rows",
    "all_to_all_split",
    "group_device",
    "group_size",
    "reduce_scatter_flat",
]

# torch >= 2.13 renamed the flat collectives (the old names warn); older releases lack the new.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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
        _all_gather_single(host, inp.cpu(), group=group)
        out.copy_(host)
        return
    _all_gather_single(out, inp, group=group)


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


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
        _all_gather_single(host, row.contiguous().view(-1).cpu(), group=group)
        full = host.to(row.device) if out is None else out.view(-1).copy_(host)
        return full.view(k, -1), None
    # gloo wants a flat output (k * len), not [k, len]
    out = torch.empty(k * row.numel(), dtype=row.dtype, device=row.device) if out is None else out.view(-1)
    work = _all_gather_single(out, row.contiguous().view(-1), group=group, async_op=async_op)
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
        dist.all_to_all_single(host, rows.contiguous().cpu(), group=group)
        return host.to(rows.device), None
    out = torch.empty_like(rows)
    work = dist.all_to_all_single(out, rows.contiguous(), group=group, async_op=async_op)
    return out, work


def all_to_all_split(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> None:
    """all_to_all_single with split sizes (a flat `inp` cut in `in_splits`, one piece per group
    rank; `out` receives `out_splits`), completed on return."""
    if _through_host(inp, group):
        host = torch.empty(out.shape, dtype=out.dtype)
        dist.all_to_all_single(host, inp.cpu(), out_splits, in_splits, group=group)
        out.copy_(host)
        return
    dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)
