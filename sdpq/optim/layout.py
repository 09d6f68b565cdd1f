"""Shard layouts the optimizers work on: plain tensors, FSDP2 DTensor shards, ZeRO-3 flat
partitions. All optimizer math is elementwise on the LOCAL tensor seen as rows x cols; FP8
groups run along the last dim, so they only need the last dim to be unsharded."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypeGuard

import torch
from torch import Tensor

try:  # DTensor is optional at runtime (builds without torch.distributed)
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]

# Elements per chunk of one step: bounds the step's extra memory (a few fp32 temporaries of
# this size) whatever the parameter size. CPU: small enough to stay cache-resident; GPU: large
# enough that the ~60 kernel launches per chunk do not dominate.
CHUNK_NUMEL = {"cpu": 1 << 18, "cuda": 1 << 22}


def chunk_numel(device: torch.device) -> int:
    return CHUNK_NUMEL.get(device.type, 1 << 22)


def is_dtensor(t: Any) -> TypeGuard[DTensor]:
    return DTensor is not None and isinstance(t, DTensor)


def local(t: Tensor) -> Tensor:
    """The tensor this rank owns (a DTensor's local shard; anything else as is)."""
    return t.to_local() if is_dtensor(t) else t


def rows(t: Tensor) -> Tensor:
    """2-D view [rows, last dim] of a contiguous local tensor (0-d -> 1 x 1)."""
    if t.dim() == 0:
        return t.view(1, 1)
    return t.view(-1, t.shape[-1]) if t.shape[-1] else t.view(t.shape[:-1].numel(), 0)


def fp8_groups_ok(p: Tensor) -> bool:
    """Whether row-wise FP8 groups of the local shard are the same groups as those of the
    whole tensor, so the codes and metadata can be saved as DTensors and resharded.
    True for plain tensors; for DTensors, ndim >= 2 and the last dim not sharded."""
    if not is_dtensor(p):
        return True
    if p.dim() < 2:
        return False
    return all(not isinstance(pl, Shard) or pl.dim % p.dim() != p.dim() - 1 for pl in p.placements)


def chunks(
    n_rows: int, n_cols: int, group_size: int, max_numel: int = CHUNK_NUMEL["cpu"]
) -> Iterator[tuple[slice, slice]]:
    """Blocks of a rows x cols tensor of about max_numel elements; column blocks start and
    end on group boundaries (or the row end) so FP8 groups are never split."""
    if n_rows == 0 or n_cols == 0:
        return
    if n_cols <= max_numel:
        step = max(1, max_numel // n_cols)
        for r in range(0, n_rows, step):
            yield slice(r, min(r + step, n_rows)), slice(0, n_cols)
        return
    width = max(group_size, max_numel // group_size * group_size)
    for r in range(n_rows):
        for c in range(0, n_cols, width):
            yield slice(r, r + 1), slice(c, min(c + width, n_cols))


def to_global(t: Tensor, p: Tensor, metadata: bool = False) -> Tensor:
    """Wrap a local state tensor of DTensor parameter p as a DTensor with p's placements.

    Elementwise state has p's global shape; FP8 metadata (metadata=True) has p's global
    shape with the last dim replaced by the number of groups (only used when fp8_groups_ok)."""
    if not is_dtensor(p):
        return t
    shape = p.shape if not metadata else p.shape[:-1] + (t.shape[-1],)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=shape, stride=stride)


def from_saved(value: Tensor, p: Tensor) -> Tensor:
    """The local part, for parameter p, of a saved state tensor (DTensor or full tensor)."""
    device = local(p).device
    if is_dtensor(value):
        if is_dtensor(p) and tuple(value.placements) != tuple(p.placements):
            value = value.redistribute(p.device_mesh, p.placements)
        return value.to_local().to(device)
    if is_dtensor(p):  # a full (unsharded) tensor from a single-process checkpoint
        return distribute_tensor(value.to(device), p.device_mesh, p.placements).to_local()
    return value.to(device)
