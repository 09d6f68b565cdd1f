"""The checks sdpq.fsdp.load_state_dict runs before it restores anything (_fsdp_checkpoint.py).

Note (invariant): every rank takes the same decision from a checkpoint. What a rank loads decides
the collectives of its next steps (a weight version picks an exact or a quantized refresh and
the reference verification), and every holder of a weight reference must hold it bitwise alike
(it is what the node computes with). So no rank acts on what it read alone: each checks its own
part (`unfit`, never raising), the ranks agree on their problems (_files.every_rank_problem), then
on what every rank must hold alike (`facts`, `disagreements`), so that every rank has the same list
of problems. On any problem every
rank raises the same `CheckpointLoadError` (_files.py) and none has loaded anything.

Why an error and not a rebuild (ZeRO-1/2 rebuilds): DCP stores sdpq's state in the same file as
the rank's model and optimizer shards, so a rank whose sdpq state is from another save, another
rank or damaged has those from there too, which sdpq cannot repair. A whole checkpoint of another
layout or configuration is the other case: it is consistent, and _fsdp_checkpoint rebuilds.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from ..comm.reference_health import checksum
from ._files import ranks_by_value
from ._fsdp_hooks import ModuleComms

__all__ = ["disagreements", "facts", "unfit"]


def unfit(comms: list[ModuleComms], state: Mapping[str, torch.Tensor], prefix) -> str | None:
    """Why `state` cannot be this rank's sdpq state (None: it can). Checks everything the restore
    reads, so that nothing fails later on this rank alone. prefix(c): the keys' prefix of c."""
    for c in comms:
        p, name = prefix(c), c.fqn or "<root>"
        layout = state.get(p + "layout")
        mine = [c.topology.world_size, c.topology.ranks_per_node, c.weights.numel]
        if layout is None or layout.tolist() != mine:
            return (
                f"no sdpq state for {name} with layout (world, ranks_per_node, numel) = {mine} (saved: "
                f"{None if layout is None else layout.tolist()}); to resume on another layout, build the "
                "template with sdpq.fsdp.state_dict(model, checkpoint_id=<the checkpoint>)"
            )
        if c.replicate is not None:
            saved, rep = state.get(p + "replicate.layout"), [c.replicate.world_size, c.replicate.ranks_per_node]
            if saved is None or saved.tolist() != rep:
                return (
                    f"{name}: the checkpoint's replicate group is {None if saved is None else saved.tolist()} "
                    f"(ranks, per node), this run's {rep}"
                )
        wg = c.weights
        if wg.holds_reference:
            ref, version = state.get(p + "weights.reference"), state.get(p + "weights.version")
            want = wg.new_reference("meta").tensor
            fits = ref is not None and ref.shape == want.shape and ref.is_floating_point() == want.is_floating_point()
            if version is None or not fits:
                return f"{name}: the weight reference is missing or not {want.dtype} {tuple(want.shape)}"
            if int(version) < -1:
                return f"{name}: weight version {int(version)}"
        residuals = [(f"gradients.{n}.", rs) for n, rs in c.gradients.items()]
        residuals += [(f"replicate.{n}.", ar.reduce_scatter) for n, ar in c.replicas.items()]
        for key, rs in residuals:
            r = state.get(p + key + "residual")
            if r is not None and tuple(r.shape) != (rs.topology.nodes, rs.padded_chunk):
                return f"{name}: error-feedback residual {key}residual of shape {tuple(r.shape)}"
        streams = [(p + "weights.rng", wg.device)]
        streams += [(p + key + "rng", rs.device) for key, rs in residuals]
        for key, device in streams:
            if key in state:
                try:
                    torch.Generator(device=device).set_state(state[key])
                except Exception as e:
                    return f"{name}: rounding stream {key[len(p) :]} does not load ({type(e).__name__}: {e})"
    return None


def facts(comms: list[ModuleComms], state: Mapping[str, torch.Tensor], prefix) -> list[tuple]:
    """Per module, what the ranks must hold alike: (name, all-gathers done, weight version,
    (the reference's holders, its checksum) or None). Gathers and versions are the same on every
    rank (every gather is collective); a reference is the same on all its holders."""
    out = []
    for c in comms:
        p = prefix(c)
        gathers = state.get(p + "gathers")
        ref = None
        if c.weights.holds_reference:
            holders = tuple(dist.get_process_group_ranks(c.topology.inter_group))
            ref = (holders, tuple(checksum(state[p + "weights.reference"]).tolist()))
        version = int(state[p + "weights.version"]) if c.weights.holds_reference else None
        out.append((c.fqn or "<root>", None if gathers is None else int(gathers), version, ref))
    return out


def disagreements(mine: list[tuple]) -> list[str]:
    """What the ranks' `facts` disagree on, the same list on every rank (one all-gather over the
    world). Collective; call it only once no rank has a problem of its own (`every_rank_problem`)."""
    per_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, mine)
    out = []
    for i, (name, *_) in enumerate(per_rank[0]):
        for what, col in (("all-gather counts", 1), ("weight versions", 2)):
            values = [f[i][col] for f in per_rank]
            if len(set(values)) > 1:
                out.append(f"{name}: the ranks' {what} differ ({ranks_by_value(values)})")
        by_holders: dict[tuple, list[tuple[int, tuple]]] = {}
        for r, f in enumerate(per_rank):
            if f[i][3] is not None:
                holders, sums = f[i][3]
                by_holders.setdefault(holders, []).append((r, sums))
        for holders, sums in by_holders.items():
            if len({s for _, s in sums}) > 1:
                out.append(
                    f"{name}: the weight reference its holders (ranks {list(holders)}) must hold alike differs "
                    f"({ranks_by_value([s for _, s in sums], [r for r, _ in sums], 'checksum')})"
                )
        if out:  # the first module that disagrees says enough
            out.append("the checkpoint's files do not come from one save (or one of them is damaged)")
            break
    return out
