"""Node layout of the ranks and the process groups the collectives run on.

Rank r = node * L + local_rank (L = ranks per node), the order every launcher (torchrun,
deepspeed, mpirun --map-by node) uses. The intra-node group of a rank holds the L ranks of its
node; the inter-node group holds the `nodes` ranks with the same local index (one per node), so
a tensor crossing the inter-node group crosses the slow link exactly once.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..config import TopologyConfig
from .device import comm_device

__all__ = ["group_layout", "Topology", "TopologyError", "ranks_per_node_from_env", "LOCAL_SIZE_VARIABLES"]

# What launchers set for the number of ranks on this node, read in this order by
# ranks_per_node="auto": torchrun, the deepspeed launcher, Open MPI, MPICH, srun --ntasks-per-node.
LOCAL_SIZE_VARIABLES = (
    "LOCAL_WORLD_SIZE",
    "LOCAL_SIZE",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MPI_LOCALNRANKS",
    "SLURM_NTASKS_PER_NODE",
)


class TopologyError(ValueError):
    """A layout that cannot work (wrong divisibility, ranks that disagree, a partial group)."""


def ranks_per_node_from_env(env: Mapping[str, str] | None = None) -> int | None:
    """The ranks on this node as the launcher says (the first of LOCAL_SIZE_VARIABLES that is
    set), or None. A variable set to something other than a positive integer is an error."""
    env = os.environ if env is None else env
    for var in LOCAL_SIZE_VARIABLES:
        value = env.get(var)
        if value:
            if not value.isdigit() or int(value) < 1:
                raise TopologyError(f"{var}={value!r} is not a positive integer")
            return int(value)
    return None


def _resolve_ranks_per_node(spec: Any) -> int:
    if isinstance(spec, TopologyConfig):
        spec = spec.ranks_per_node
    if spec is None or spec == "auto":
        spec = ranks_per_node_from_env()
        if spec is None:
            raise TopologyError(
                "sdpq.topology.ranks_per_node='auto' found no launcher variable ("
                + ", ".join(LOCAL_SIZE_VARIABLES)
                + "); give ranks_per_node as an integer"
            )
    if isinstance(spec, bool) or not isinstance(spec, int) or spec < 1:
        raise TopologyError(f"ranks_per_node must be a positive integer or 'auto', got {spec!r}")
    return spec


def _check_layout(L: int, world_size: int, *, check_local_rank: bool) -> None:
    """Every rank must agree on L and (with L from the launcher) sit where rank = node * L +
    local_rank. Checked with one small all-gather, so that a bad launcher setting fails on all
    ranks alike instead of deadlocking in the first collective."""
    world = dist.group.WORLD
    local_env = os.environ.get("LOCAL_RANK")
    # Note: on the world's communication device (NCCL: this rank's current GPU, not device 0).
    mine = torch.tensor(
        [L, int(local_env) if local_env is not None else -1], dtype=torch.int64, device=comm_device(world)
    )
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine, group=world)
    everyone = [t.tolist() for t in gathered]
    if len({e[0] for e in everyone}) != 1:
        raise TopologyError(f"ranks disagree on ranks_per_node: {[e[0] for e in everyone]}")
    if world_size % L:
        raise TopologyError(
            f"world size {world_size} is not divisible by ranks_per_node {L} "
            "(every node must have the same number of ranks)"
        )
    bad = [r for r, e in enumerate(everyone) if e[1] != -1 and e[1] != r % L]
    if check_local_rank and bad:
        raise TopologyError(
            f"LOCAL_RANK of ranks {bad} does not match rank % {L}: sdpq assumes rank = node * "
            "ranks_per_node + local_rank (launch with contiguous ranks per node)"
        )


def group_layout(ranks: list[int], ranks_per_node: int) -> tuple[int, int]:
    """(nodes', L') of a group of global `ranks` (in group-rank order) on a world with
    `ranks_per_node` ranks per node; TopologyError if the group is not a regular grid of it."""
    per_node: dict[int, list[int]] = {}
    for r in ranks:
        per_node.setdefault(r // ranks_per_node, []).append(r)
    counts = {len(v) for v in per_node.values()}
    if len(counts) != 1 or any(v != sorted(v) for v in per_node.values()) or ranks != sorted(ranks):
        raise TopologyError(
            f"the process group {ranks} holds {[len(v) for v in per_node.values()]} ranks on the nodes it "
            f"touches (ranks_per_node={ranks_per_node}); sdpq needs the same number on each node, in rank "
            "order: build the device mesh so that a group is whole nodes, part of one node, or one rank per node"
        )
    return len(per_node), counts.pop()


@dataclass(eq=False)
class Topology:
    """This rank's place in the node layout, and its intra/inter-node process groups.

    `intra_group` is None when L == 1 and `inter_group` None when nodes == 1 (a group of one
    would only add a no-op collective).
    """

    world_size: int
    ranks_per_node: int
    rank: int
    intra_group: Any = field(repr=False, default=None)
    inter_group: Any = field(repr=False, default=None)
    world_group: Any = field(repr=False, default=None)

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def node(self) -> int:
        return self.rank // self.ranks_per_node

    @property
    def local_rank(self) -> int:
        return self.rank % self.ranks_per_node

    @property
    def layout(self) -> str:
        """The layout as "nodes x ranks_per_node", e.g. "2x4"."""
        return f"{self.nodes}x{self.ranks_per_node}"

    def intra_ranks(self, node: int | None = None) -> list[int]:
        n = self.node if node is None else node
        return [n * self.ranks_per_node + l for l in range(self.ranks_per_node)]

    def inter_ranks(self, local_rank: int | None = None) -> list[int]:
        l = self.local_rank if local_rank is None else local_rank
        return [n * self.ranks_per_node + l for n in range(self.nodes)]

    @classmethod
    def build(
        cls, ranks_per_node: TopologyConfig | int | str | None = "auto", *, group=None, timeout: timedelta | None = None
    ) -> Topology:
        """Create the groups. Collective: EVERY rank of the world must call it, in the same
        order relative to other group creations (torch.distributed.new_group's rule).

        `group` (default: the world) must contain every rank in rank order: the layout is a
        property of the whole job, and sub-groups would need every rank to take part anyway.
        `timeout` is passed to every new group (default: torch's default for the backend).
        """
        if not dist.is_initialized():
            raise TopologyError("torch.distributed is not initialised (call init_process_group first)")
        world = dist.group.WORLD
        world_size = dist.get_world_size()
        rank = dist.get_rank()
        if group is not None and group is not world:
            ranks = dist.get_process_group_ranks(group)
            if ranks != list(range(world_size)):
                raise TopologyError(
                    f"sdpq needs the topology built over the whole world ({world_size} ranks in order); "
                    f"got a group of ranks {ranks}: build it over dist.group.WORLD on every rank"
                )
        L = _resolve_ranks_per_node(ranks_per_node)
        explicit = not (
            ranks_per_node in (None, "auto")
            or isinstance(ranks_per_node, TopologyConfig)
            and ranks_per_node.ranks_per_node == "auto"
        )
        _check_layout(L, world_size, check_local_rank=not explicit)
        topo = cls(world_size=world_size, ranks_per_node=L, rank=rank, world_group=world)
        topo._create_groups(timeout)
        return topo

    def _create_groups(self, timeout: timedelta | None) -> None:
        # Note: new_group is collective over the world: every rank creates every group, in the
        # same order, and keeps only its own.
        if self.ranks_per_node > 1:
            for n in range(self.nodes):
                g = dist.new_group(self.intra_ranks(n), timeout=timeout)
                if n == self.node:
                    self.intra_group = g
        if self.nodes > 1:
            for l in range(self.ranks_per_node):
                g = dist.new_group(self.inter_ranks(l), timeout=timeout)
                if l == self.local_rank:
                    self.inter_group = g

    @classmethod
    def for_group(cls, group, world: Topology, *, timeout: timedelta | None = None) -> Topology:
        """The Topology of `group`, a sub-group of `world` (one dimension of a device mesh: the
        shard group of HSDP or FSDP x TP, a replicate group), seen as its own nodes' x L' grid
        of the physical layout: group rank i = node' * L' + local'. Its members on each node they
        touch must be equally many (TopologyError otherwise): a group of whole nodes, part of one
        node, or one rank per node. `world` itself when the group is the whole world.

        Collective over the world: every rank calls it, in the same order, each with its own
        group of the same kind (e.g. each rank its shard group); the groups of all ranks are
        gathered so that every rank creates every intra/inter sub-group in the same order.
        """
        own = dist.get_process_group_ranks(group)
        if own == list(range(world.world_size)):
            return world
        everyone: list[Any] = [None] * world.world_size
        dist.all_gather_object(everyone, own, group=world.world_group)
        kinds = sorted({tuple(g) for g in everyone})
        if sum(len(g) for g in kinds) != world.world_size or len({r for g in kinds for r in g}) != world.world_size:
            raise TopologyError(
                f"sdpq: the ranks' groups {kinds} do not partition the world: pass each rank's own group"
            )
        layouts = [group_layout(list(g), world.ranks_per_node) for g in kinds]  # raises on every rank alike
        me, intra, inter = dist.get_rank(), None, None
        for g, (nodes_g, L_g) in zip(kinds, layouts):
            # Rows: node' (group ranks n'*L' .. n'*L'+L'-1); columns: local index l'.
            grid = [list(g[n * L_g : (n + 1) * L_g]) for n in range(nodes_g)]
            for row in grid if L_g > 1 else []:
                pg = dist.new_group(row, timeout=timeout)
                intra = pg if me in row else intra
            for col in zip(*grid) if nodes_g > 1 else []:
                pg = dist.new_group(list(col), timeout=timeout)
                inter = pg if me in col else inter
        _, L_own = group_layout(own, world.ranks_per_node)
        return cls(len(own), L_own, own.index(me), intra_group=intra, inter_group=inter, world_group=group)

    def check_group(self, group) -> None:
        """Raise unless `group` is the world this topology was built over (integrations call it
        with the group a framework hands them)."""
        if group is None or group is self.world_group:
            return
        ranks = dist.get_process_group_ranks(group)
        if ranks != list(range(self.world_size)):
            raise TopologyError(
                f"collective called on a group of ranks {ranks}, but the sdpq topology spans all "
                f"{self.world_size} ranks ({self.layout}); sdpq does not support sub-group sharding yet"
            )
