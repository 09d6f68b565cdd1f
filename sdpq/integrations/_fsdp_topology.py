"""Node layout of the process groups FSDP2 shards over (1-D FSDP: the world; HSDP: a mesh dim).

sdpq's collectives run on a `Topology`: a group of S ranks seen as `nodes' x L'` (group rank
i = node' * L' + local'), with an intra-node and an inter-node subgroup. For 1-D FSDP over all
ranks that is `Topology.build` itself. For a shard group that is a sub-group of the world (HSDP
on a 2-D mesh, or a mesh over part of the world) it is derived here from the world layout: the
members of the group on each node they touch must be equally many, so that the group is a
regular `nodes' x L'` grid of the physical layout. The usual HSDP layout (shard inside a node,
replicate across nodes) gives nodes' = 1; a shard dim across nodes gives L' = 1.
"""

from __future__ import annotations

import torch.distributed as dist

from ..comm import Topology, TopologyError

__all__ = ["group_layout", "topology_for_mesh_dim"]


def group_layout(ranks: list[int], ranks_per_node: int) -> tuple[int, int]:
    """(nodes', L') of a group of global `ranks` (sorted, i.e. in group-rank order) on a world
    with `ranks_per_node` ranks per node; TopologyError if the group is not a regular grid."""
    per_node: dict[int, list[int]] = {}
    for r in ranks:
        per_node.setdefault(r // ranks_per_node, []).append(r)
    counts = {len(v) for v in per_node.values()}
    if len(counts) != 1:
        raise TopologyError(
            f"the FSDP shard group {ranks} holds {sorted(len(v) for v in per_node.values())} ranks on "
            f"the nodes it touches (ranks_per_node={ranks_per_node}); sdpq needs the same number on "
            "each node: build the device mesh so that a shard group is whole nodes, part of one node, "
            "or one rank per node"
        )
    return len(per_node), counts.pop()


def topology_for_mesh_dim(world: Topology, mesh, mesh_dim: int, group, *, timeout=None) -> Topology:
    """The Topology of this rank's process group along `mesh_dim` of DeviceMesh `mesh`.

    Collective over the world: every rank must call it with the same mesh and dim, in the same
    order (it creates the intra/inter subgroups of EVERY group along that dim with new_group).
    """
    own = dist.get_process_group_ranks(group)
    if own == list(range(world.world_size)):
        return world  # the shard group is the world: the world topology's groups fit as they are
    L = world.ranks_per_node
    S = mesh.mesh.size(mesh_dim)
    all_groups = [sorted(g) for g in mesh.mesh.transpose(mesh_dim, -1).reshape(-1, S).tolist()]
    if sorted(own) not in all_groups:
        raise TopologyError(f"this rank's shard group {own} is not a group of mesh dim {mesh_dim}")
    layouts = [group_layout(g, L) for g in all_groups]  # raises on every rank alike
    kwargs = {} if timeout is None else {"timeout": timeout}
    me = dist.get_rank()
    intra = inter = None
    for g, (nodes_g, L_g) in zip(all_groups, layouts):
        # Rows: node' (group ranks n'*L' .. n'*L'+L'-1); columns: local index l'.
        grid = [g[n * L_g : (n + 1) * L_g] for n in range(nodes_g)]
        if L_g > 1:
            for row in grid:
                pg = dist.new_group(row, **kwargs)
                if me in row:
                    intra = pg
        if nodes_g > 1:
            for col in zip(*grid):
                pg = dist.new_group(list(col), **kwargs)
                if me in col:
                    inter = pg
    nodes_own, L_own = group_layout(sorted(own), L)
    return Topology(
        world_size=len(own),
        ranks_per_node=L_own,
        rank=sorted(own).index(me),
        intra_group=intra,
        inter_group=inter,
        world_group=group,
    )
