"""sdpq for torchft: a process group for `torchft.Manager(pg=...)` whose all-reduce is sdpq's
quantized all-reduce across the replica groups.

    from torchft.process_group import ProcessGroupGloo
    import sdpq.torchft

    manager = Manager(pg=sdpq.torchft.QuantizedProcessGroup(ProcessGroupGloo(timeout=timeout)), ...)

Every caller of the Manager's all-reduce reaches it: torchft's DDP (one all-reduce per bucket),
HSDP's replicate dimension (FSDP's all-reduce through torchft's managed mesh), LocalSGD, DiLoCo.

`allreduce` of one floating-point tensor with SUM (what `Manager.allreduce` passes; it divides by
the participants afterwards) runs `sdpq.comm.GradAllReduce` over the quorum's members, each
replica group one node of the layout: a `gradients.inter_bits` (4 by default), Hadamard-smoothed
reduce-scatter (each member's own contribution exact, optional error feedback), then an
all-gather of the reduced chunks that every member decodes from the same bytes. Every replica
therefore holds the bitwise same sum, and replicas that step alike stay bitwise equal. Inside a
replica group nothing changes (its own FSDP / DDP groups are not this one).

Every other collective (broadcast, allgather, alltoall, barrier, send / recv, the coalesced
forms) and every other all-reduce (MAX, MIN, PRODUCT, bitwise ops; integer tensors) goes to the
wrapped group unchanged: torchft's recovery and its own collectives see the group they were
given. AVG, PREMUL_SUM and a list of several tensors are refused with a ValueError.

Note (quorum changes): torchft calls `configure` on every member of a new quorum (a replica
joined or left, or a step failed to commit somewhere: its lighthouse then bumps the quorum id).
The wrapper drops every collective it built (their layout depends on the member count, their
error-feedback residuals and rounding streams on this member's place) and rebuilds each at its
next use, agreeing across the new members on the config and the bucket (one small collective
per bucket and quorum). sdpq's state thus restarts on every member at the points where torchft
may hand a replica a peer's state, so a recovering replica needs nothing of sdpq's: the
residual is this member's own quantization error, wrong for any other member, and a failed
member's is lost with it. The replicas' equality never depends on it (every member decodes the
same bytes); the reset makes sdpq's state a function of the quorum and the calls since.
Collectives are keyed by the tensor's size: with error feedback on, tensors of one size share a
residual (right for DDP's buckets; not for per-parameter all-reduces of equal shapes).

Note (failures): an all-reduce that fails (a member died, a timeout) leaves this member's
collective mid-way. Its work reports the error (`wait()` returns False, the future raises), as
does `errored()`, and every later quantized all-reduce fails the same way at once until the next
`configure` (torchft's Manager skips the step and reconfigures every member after a step that
did not commit). Members that disagree on the settings raise ConfigError from `allreduce`.

Note (threads): torchft runs `configure` on its quorum thread and the all-reduces on the
training thread; one lock per wrapper orders them (a reconfiguration waits for a running
all-reduce). Wrappers share no state, so replicas may run as threads of one process. It never
touches torch.distributed's default group: the collectives run on the wrapped group's own
methods (`sdpq.comm.direct_group.DirectGroup`).

Bytes: `sdpq.stats.summary(pg)` (this member's counts by sdpq's byte model, each replica group a
node: the "inter" link is the cross-replica traffic, next to what the plain all-reduce in the
tensor's dtype would move).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import ReduceOp
from torchft.process_group import ProcessGroup as TorchftProcessGroup
from torchft.process_group import ProcessGroupWrapper

from ..comm import CommStats, GradAllReduce, Topology
from ..comm.direct_group import DirectGroup
from ..comm.hotpath import host_read, hot_path
from ..comm.stats import process_stats, register_holder
from ..config import Config, ConfigError
from ._config_arg import as_config

__all__ = ["QuantizedProcessGroup", "Quorum"]

_REFUSED_OPS = ("AVG", "PREMUL_SUM")


def _op_name(op: Any) -> str:
    for name in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"):
        if op == getattr(ReduceOp, name):
            return name
    return str(op)


@dataclass
class Quorum:
    """The quorum this member was last configured for, and the collectives built in it."""

    quorum_id: int | None
    rank: int  # this replica group's place among the members
    size: int  # members (replica groups) in the quorum
    topology: Topology = field(repr=False)
    reducers: dict[int, GradAllReduce] = field(default_factory=dict, repr=False)  # numel -> its all-reduce


class _FinishedWork(dist.Work):
    """The handle of an all-reduce that finished before it was returned (sdpq's runs when called;
    on an accelerator its kernels are queued on the caller's current stream, where the future
    completes). A failed one: `wait()` returns False and the future holds the error.

    Note: the error travels in the future, not out of `wait()`: torchft's DDP hook asserts on the
    future of a work whose `wait()` raised (torchft 0.2.0), while its Manager reports an error
    that a future holds and skips the step, as torchft's own error-swallowing group does."""

    def __init__(self, tensors: list[torch.Tensor], error: Exception | None = None):
        super().__init__()
        self._ok = error is None
        devices: list[int | str | torch.device] = [t.device for t in tensors if t.device.type != "cpu"]
        self._future: torch.futures.Future = torch.futures.Future(devices=devices or None)
        if error is None:
            self._future.set_result(tensors)
        else:
            self._future.set_exception(error)

    def wait(self, timeout=None) -> bool:
        return self._ok

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return self._ok

    def get_future(self) -> torch.futures.Future:
        return self._future

    def block_current_stream(self) -> None:
        return None  # already ordered on the current stream

    def synchronize(self) -> None:
        return None


class QuantizedProcessGroup(ProcessGroupWrapper):
    """A torchft process group (`pg`, e.g. `torchft.process_group.ProcessGroupGloo(timeout=...)`)
    whose SUM all-reduce of floating-point tensors is sdpq's quantized all-reduce across the
    quorum; give it to `torchft.Manager(pg=...)` on every member alike.

    config: a sdpq.Config or dict (its `gradients` and `stats` sections apply; each replica group
    is one node, whatever `topology` says). device_type: where the wrapped group's collectives
    take tensors; default from its backend ("cuda" for NCCL, "xpu" for XCCL, else "cpu").
    """

    def __init__(self, pg: TorchftProcessGroup, config: Config | Mapping[str, Any] | None = None, *, device_type=None):
        if not isinstance(pg, TorchftProcessGroup):
            raise TypeError(
                "sdpq.torchft.QuantizedProcessGroup: pg must be a torchft.process_group.ProcessGroup "
                f"(e.g. ProcessGroupGloo(), ProcessGroupNCCL()), got {type(pg).__name__}"
            )
        cfg = as_config(config, "sdpq.torchft.QuantizedProcessGroup")
        super().__init__(pg=pg)
        self.config = cfg
        if device_type is None:
            backend = pg.getBackendName()
            device_type = "cuda" if "nccl" in backend else "xpu" if "xccl" in backend else "cpu"
        self.device_type = torch.device(device_type).type
        self.stats = CommStats(config=self.config.stats, parent=process_stats())
        self.quorum: Quorum | None = None
        self.reconfigurations = 0  # configure calls (one per quorum this member joined)
        self._failure: Exception | None = None  # a quantized all-reduce that failed, until configure
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"QuantizedProcessGroup(pg={self._pg!r}, quorum={self.quorum!r})"

    # ------------------------------------------------------------------ quorum changes

    def configure(
        self,
        store_addr: str,
        replica_id: str,
        rank: int,
        world_size: int,
        quorum_id: int | None = None,
        group_rank: int | None = None,
        group_world_size: int | None = None,
        global_ranks: list[int] | None = None,
    ) -> None:
        """Reconfigure the wrapped group for a new quorum (torchft calls it on every member) and
        drop sdpq's collectives: each is rebuilt for the new members at its next use."""
        with self._lock:
            self.quorum = None  # an error below leaves no collective of the old quorum usable
            super().configure(
                store_addr, replica_id, rank, world_size, quorum_id, group_rank, group_world_size, global_ranks
            )  # fmt: skip
            names = global_ranks if global_ranks is not None and len(global_ranks) == world_size else None
            group = DirectGroup(self.parent, rank, world_size, self.device_type, names)
            # Note: one replica group per node of the layout (ranks_per_node 1): the all-reduce
            # crosses between replica groups only, at the inter-node format.
            topology = Topology(
                world_size=world_size,
                ranks_per_node=1,
                rank=rank,
                inter_group=group if world_size > 1 else None,
                world_group=group,
            )
            self.quorum = Quorum(quorum_id, rank, world_size, topology)
            self._failure = None
            self.reconfigurations += 1

    # ------------------------------------------------------------------ the all-reduce

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        """SUM of one floating-point tensor: sdpq's quantized all-reduce, in place; any other
        reduce op or an integer tensor: the wrapped group's all-reduce, unchanged."""
        op = getattr(opts, "reduceOp", opts)
        name = _op_name(op)
        if name in _REFUSED_OPS:
            raise ValueError(
                f"sdpq.torchft: allreduce with reduce op {name} is not supported; the quantized all-reduce "
                "sums (pass SUM and divide, as torchft's Manager.allreduce does), and MAX, MIN, PRODUCT "
                "and the bitwise ops go to the wrapped group unchanged"
            )
        if len(tensors) != 1:
            raise ValueError(
                f"sdpq.torchft: allreduce takes a list of exactly one tensor, got {len(tensors)} (c10d's "
                "several-tensor form sums across devices of one process, which the quantized all-reduce does not do)"
            )
        t = tensors[0]
        if name != "SUM" or not t.is_floating_point():
            return super().allreduce(tensors, opts)
        if t.numel() == 0:
            return _FinishedWork(tensors)  # the sum of nothing: no collective (every member has none)
        with self._lock:
            quorum = self.quorum
            if quorum is None:
                raise RuntimeError(
                    "sdpq.torchft: allreduce before configure(); give the group to torchft.Manager(pg=...), "
                    "which configures it for every quorum"
                )
            try:
                if self._failure is not None:
                    raise RuntimeError(
                        "sdpq.torchft: an earlier quantized all-reduce in this quorum failed; the group "
                        "needs configure() for a new quorum (torchft does this after a step that did not commit)"
                    ) from self._failure
                reducer = self._reducer(quorum, t)
                flat = t.view(-1) if t.is_contiguous() else t.reshape(-1).clone()
                with hot_path("sdpq.torchft all-reduce"):
                    reducer.all_reduce(flat)
                if flat.data_ptr() != t.data_ptr():
                    t.copy_(flat.view_as(t))
            except ConfigError:
                raise  # the members disagree on the settings: no later step can do better
            except Exception as e:
                self._failure = self._failure or e
                return _FinishedWork(tensors, e)
        return _FinishedWork(tensors)

    def _reducer(self, quorum: Quorum, t: torch.Tensor) -> GradAllReduce:
        reducer = quorum.reducers.get(t.numel())
        if reducer is None:
            # Note: collective over the quorum (every member agrees on the bucket and the wire
            # settings, or all raise): built at the first all-reduce of this size in the quorum,
            # by every member alike since the replicas all-reduce the same buckets in order.
            with host_read():
                reducer = GradAllReduce(
                    t.numel(), quorum.topology, self.config.gradients, device=t.device,
                    stats=self.config.stats, record_to=self.stats,
                )  # fmt: skip
            quorum.reducers[t.numel()] = reducer
        return reducer

    # ------------------------------------------------------------------ the wrapped group's life

    def errored(self) -> Exception | None:
        """A failed quantized all-reduce of this quorum, or the wrapped group's own error."""
        return self._failure or self.parent.errored()

    def abort(self, errored: bool = True) -> None:
        # Note: torchft's wrapper forgets its group on abort; this one keeps the wrapped group,
        # which aborts its own connection and is reconfigured at the next quorum.
        self.parent.abort()

    def shutdown(self) -> None:
        self.parent.shutdown()

    def set_timeout(self, timeout) -> None:
        self.parent.set_timeout(timeout)  # the wrapped group's collectives are the ones that wait

    def held_tensors(self):
        """(kind, tensor) of what sdpq keeps between all-reduces (the error-feedback residuals)."""
        quorum = self.quorum
        for reducer in [] if quorum is None else quorum.reducers.values():
            yield from reducer.held_tensors()


def _group_stats(target: object) -> CommStats | None:
    return target.stats if isinstance(target, QuantizedProcessGroup) else None


register_holder(_group_stats)
