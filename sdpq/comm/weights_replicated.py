"""Weight differences for a distributed optimizer over full replicas (ZeRO-1/2).

Every rank holds all the weights W (a flat buffer in the compute dtype, cut into N equal
partitions) and steps the master copy of its own partition r. After the step, instead of
all-gathering the new partitions, each owner sends the quantized difference between its new
master M_r (fp32) and the weights W_r that every rank already holds, and every rank, the owner
included, applies the same decoded bytes to every partition:

    W_p <- W_p + deQ(Q(M_p - W_p))    (fp32 sum, rounded to W's dtype)

No reference copy is kept: the weights every rank holds are the reference. Bytes: `bits` per
element (+ one scale per group) instead of 16.

Note (invariants): the replicas stay bitwise identical because each applies the same bytes to
the same bits with the same arithmetic; the difference is taken against the weights as held,
so a step's quantization error is part of the next step's difference (the master feeds it back:
the weights never drift from the master by more than one step's error).
Note (memory): nothing persistent; per call one slice of the gathered codes (the caller's
`max_elements` per collective) and the owner's own partition as it was before the step (the
caller keeps it: the optimizer overwrites that partition before the gather).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..config import StatsConfig, WeightsConfig
from ..kernels import decode_rows, encode_rows
from ..quant import QuantSpec
from ..quant.groupwise import SCALE_DTYPES
from . import timing
from ._exchange import all_gather_flat, all_gather_rows
from ._rng import generator_state, per_rank_generator, restore_generator
from .reference_health import checksum
from .stats import CommStats, Recorder
from .topology import Topology

__all__ = ["ReplicaDiffGather", "replicas_agree"]


class ReplicaDiffGather:
    """Every rank builds it with the same arguments and calls `gather` collectively."""

    def __init__(
        self,
        partition_numel: int,
        topology: Topology,
        config: WeightsConfig | None = None,
        *,
        max_elements: int = 1 << 28,
        device: torch.device | str | None = None,
        stats: StatsConfig | None = None,
        record_to: CommStats | None = None,
    ):
        self.config = c = config or WeightsConfig()
        if c.mode not in ("diff", "exact"):
            raise ValueError(f"ReplicaDiffGather: weights.mode must be 'diff' or 'exact', got {c.mode!r}")
        self.P = partition_numel
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.topology = topology
        self.spec = QuantSpec(c.bits, c.group_size, c.rounding, SCALE_DTYPES[c.scale_dtype])
        # Columns per collective: whole groups, at most max_elements over all N partitions.
        per = max(c.group_size, max_elements // topology.world_size // c.group_size * c.group_size)
        self.slice = min(partition_numel, per)
        self._rec = Recorder(stats, record_to)
        self._gen: torch.Generator | None = None
        self.versions = 0

    def gather(
        self, flat: torch.Tensor, own_old: torch.Tensor, own_master: torch.Tensor, *, exact: bool = False
    ) -> None:
        """flat: [N * P] every rank's weights (own partition as it was before the step, or
        overwritten since: it is restored from own_old). own_master: this rank's new fp32 master
        partition. exact: send the new partitions themselves (in flat's dtype), as a plain
        all-gather would; every rank then holds master rounded to flat's dtype."""
        topo, P = self.topology, self.P
        if flat.numel() != topo.world_size * P or own_old.numel() != P or own_master.numel() != P:
            raise ValueError(
                f"ReplicaDiffGather.gather: flat {flat.numel()} / own_old {own_old.numel()} / own_master "
                f"{own_master.numel()} elements; expected {topo.world_size} x {P}, {P}, {P}"
            )
        rows = flat.view(topo.world_size, P)
        with timing.span("weights.gather"):
            if exact or self.config.mode == "exact":
                self._exact(rows, own_master)
            else:
                if own_old.data_ptr() != rows[topo.rank].data_ptr():  # overwritten since: restore it
                    rows[topo.rank].copy_(own_old.view(-1))
                for a in range(0, P, self.slice):
                    self._diff_slice(rows, own_master.view(-1), a, min(P, a + self.slice))
        self.versions += 1

    def state_dict(self) -> dict:
        """The rounding stream (stochastic rounding only) and the version count."""
        return {"generator": generator_state(self._gen), "versions": self.versions}

    def load_state_dict(self, state: dict) -> None:
        self._gen = restore_generator(self._gen, state["generator"], self.device)
        self.versions = int(state["versions"])

    def _diff_slice(self, rows: torch.Tensor, master: torch.Tensor, a: int, b: int) -> None:
        topo, n = self.topology, b - a
        with timing.span("weights.encode"):
            d = master[a:b].float() - rows[topo.rank, a:b].float()
            wire = encode_rows(d.view(1, n), self.spec, generator=self._generator(d.device))[0].view(-1)
        with timing.span("comm.weights"):
            got, work = all_gather_rows(wire, topo.world_group)
            if work is not None:
                work.wait()
        self._rec.record_all_gather("weights", topo, wire.numel(), n, rows.element_size())
        with timing.span("weights.decode"):
            decode_rows(got, self.spec, n, rows[:, a:b], add=True)

    def _exact(self, rows: torch.Tensor, master: torch.Tensor) -> None:
        topo = self.topology
        own = master.view(-1).to(rows.dtype)
        with timing.span("comm.weights"):
            if topo.world_size == 1:
                rows[0].copy_(own)
            else:
                all_gather_flat(rows.view(-1), own, topo.world_group)
        self._rec.record_all_gather("weights", topo, own.numel() * own.element_size(), own.numel(), rows.element_size())

    def _generator(self, device: torch.device) -> torch.Generator | None:
        if self.config.rounding != "stochastic":
            return None
        if self._gen is None:
            self._gen = per_rank_generator(0, self.topology.rank, device)
        return self._gen


def replicas_agree(flat: torch.Tensor, group) -> bool:
    """True if every rank of `group` holds the same `flat` (by checksum; one small all-reduce)."""
    f = checksum(flat)
    both = torch.cat((f, -f))  # MAX of both: the largest and (minus) the smallest checksum
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    return bool(torch.equal(both[:2], -both[2:]))
