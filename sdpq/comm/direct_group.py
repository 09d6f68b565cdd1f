"""A process group sdpq drives through the group object's own collective methods.

torch.distributed's functions (`all_gather_into_tensor`, `all_to_all_single`, `get_world_size`,
`get_backend`, ...) look a group up in the registry that the default process group keeps. A group
built outside that registry has no entry there: a fault-tolerance library that rebuilds its group
among the current members at every membership change (the replica groups of a fault-tolerant
trainer) never registers it, and the job may have no default group at all. `DirectGroup(pg, rank, size)` runs sdpq's
collectives on such a group: `_exchange` issues them as `pg`'s own c10d methods (`allgather`,
`alltoall_base`, `allreduce`: the methods every `torch.distributed.ProcessGroup` has), and the
group's rank, size, device and member names come from here instead of the registry.

Note: `pg` is called with c10d's option objects and returns c10d `Work`; sdpq waits on it as on
any collective's handle (the group's own timeout applies). sdpq's statistics (`stats`) count
these collectives by the byte model, as every sdpq collective's.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, AllToAllOptions, ReduceOp

__all__ = ["DirectGroup"]


def _done(work: Any, async_op: bool) -> Any:
    """The handle (async_op) or None once the collective has completed."""
    if async_op:
        return work
    work.wait()
    return None


class DirectGroup:
    """`pg` (a c10d ProcessGroup object, registered or not) seen by sdpq's collectives as a group of
    `size` members in which this process is member `rank`.

    device_type: where the group's collectives take their tensors ("cpu" for gloo, "cuda" for
    NCCL: then this thread's current CUDA device, as for a registered NCCL group).
    ranks: a name per member for messages (e.g. the members' global ranks), default 0 .. size-1.
    """

    def __init__(self, pg: Any, rank: int, size: int, device_type: str = "cpu", ranks: Sequence[int] | None = None):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"DirectGroup: size must be a positive integer, got {size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
            raise ValueError(f"DirectGroup: rank must be an integer in [0, {size}), got {rank!r}")
        members = list(range(size)) if ranks is None else [int(r) for r in ranks]
        if len(members) != size:
            raise ValueError(f"DirectGroup: {len(members)} member names for a group of {size}")
        self.pg = pg
        self.rank = rank
        self.size = size
        self.device_type = torch.device(device_type).type
        self.ranks = members

    def device(self) -> torch.device:
        """Where this group's collectives take tensors now (an accelerator: this thread's current one)."""
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, torch.get_device_module(self.device_type).current_device())

    def __repr__(self) -> str:
        return f"DirectGroup(rank={self.rank}, size={self.size}, device_type={self.device_type!r})"

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False) -> Any:
        """Every member's flat `inp` into the flat `out` (size * inp.numel() elements), in member order."""
        pieces = list(out.view(self.size, -1).unbind(0))
        return _done(self.pg.allgather([pieces], [inp.reshape(-1)], AllgatherOptions()), async_op)

    def all_to_all(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        out_splits: Sequence[int] | None = None,
        in_splits: Sequence[int] | None = None,
        async_op: bool = False,
    ) -> Any:
        """all_to_all_single: piece j of `inp` (equal pieces, or `in_splits`) goes to member j."""
        work = self.pg.alltoall_base(out, inp, list(out_splits or []), list(in_splits or []), AllToAllOptions())
        return _done(work, async_op)

    def all_reduce_sum(self, t: torch.Tensor, async_op: bool = False) -> Any:
        """t <- the sum of every member's t (the plain collective), in place."""
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp(ReduceOp.SUM)
        return _done(self.pg.allreduce([t], opts), async_op)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every member's picklable `obj`, in member order (for messages: not on any hot path)."""
        device = self.device()
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
        sizes = torch.empty(self.size, dtype=torch.int64, device=device)
        self.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=device))
        longest = int(sizes.max())
        padded = torch.zeros(longest, dtype=torch.uint8, device=device)
        padded[: data.numel()] = data
        rows = torch.empty(self.size * longest, dtype=torch.uint8, device=device)
        self.all_gather(rows, padded)
        table = rows.view(self.size, longest).cpu()
        return [pickle.loads(table[i, : int(n)].numpy().tobytes()) for i, n in enumerate(sizes.tolist())]
