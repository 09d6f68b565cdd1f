"""Every access sdpq makes to FSDP2's private internals, behind thin named functions.

FSDP2's public API (`fully_shard`, `FSDPModule.set_custom_all_gather`, `set_custom_reduce_scatter`,
`set_all_reduce_hook`, `set_gradient_divide_factor`, `set_force_sum_reduction_for_comms`) installs
sdpq's collectives, but sizing them needs what only the private objects say: a module's
parameter group (`FSDPModule._get_fsdp_state()._fsdp_param_groups`), its parameters' padded shard
sizes, its mesh and mixed-precision settings, and the comm objects `remove()` must put back. The
rest of sdpq calls only this module, so a torch release that renames something breaks here, in
one place, with the names listed below.

Checked against: torch 2.13.0 (torch/distributed/fsdp/_fully_shard/_fsdp_api.py,
_fsdp_common.py, _fsdp_param_group.py, _fsdp_param.py, _fully_shard.py), 2.11.0 (the same names
but one: a module's state holds `_fsdp_param_group`, one group or None, where 2.13 holds the
list `_fsdp_param_groups`), 2.14.1 and 2.15.0 (the mixed-precision policy is resolved per
parameter, `FSDPParam.mp_policy`, where earlier releases hold one per group); the FSDP2
integration tests pass on each (`./run compat VERSION`).

Names used (torch 2.13):
- `torch.distributed.fsdp._fully_shard._fsdp_api.AllGather`, `.ReduceScatter`: the base classes
  `set_custom_all_gather` / `set_custom_reduce_scatter` take (abstract `allocate`, `__call__`);
- `torch.distributed.fsdp._fully_shard._fsdp_common.FSDPMeshInfo`;
- `FSDPModule._get_fsdp_state()._fsdp_param_groups` -> list of FSDPParamGroup (2.11:
  `._fsdp_param_group`, one FSDPParamGroup or None);
- FSDPParamGroup: `fsdp_params`, `mesh_info` (`.shard_process_group`; with mesh HSDP
  `.replicate_process_group`, and replaced by a 1-D `FSDPMeshInfo` when sdpq takes that
  all-reduce over), `post_forward_mesh_info`, `_is_hsdp`, `mp_policy.param_dtype` (2.15: per
  parameter, `FSDPParam.mp_policy`), `device`, `gradient_divide_factor`,
  `force_sum_reduction_for_comms`, `_all_gather_comm`, `_reduce_scatter_comm`, `_all_reduce_hook`,
  `all_reduce_grads` (what `set_requires_all_reduce` sets; 1-D FSDP2 calls the all-reduce hook
  whatever it says);
- FSDPParam: `sharded_param` (the DTensor parameter), `_sharded_local_tensor`,
  `padded_sharded_param_size`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

try:
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo
except ImportError as e:  # pragma: no cover - torch without FSDP2 custom comms
    raise ImportError(f"sdpq.fsdp needs torch >= 2.8 with FSDP2 custom comm hooks ({e})") from e

# The torch releases the FSDP2 integration tests passed on (`./run compat VERSION`; 2.13.0 is
# what CI runs). pyproject.toml claims no older torch than the first; README.md lists them.
CHECKED_TORCH = ("2.11.0", "2.13.0", "2.14.1", "2.15.0")

__all__ = [
    "CHECKED_TORCH",
    "AllGather",
    "ReduceScatter",
    "param_groups",
    "unsupported_reason",
    "shard_group",
    "is_mesh_hsdp",
    "replicate_group",
    "shard_dim_only",
    "has_all_reduce_hook",
    "sharded_params",
    "shard_numels",
    "shard_row_widths",
    "param_dtype",
    "device",
    "gradient_divide_factor",
    "all_reduce_wanted",
    "comm_settings",
    "restore_comm_settings",
]

ParamGroup = Any  # FSDPParamGroup (private): only the functions below look inside it


def param_groups(module: Any) -> list[ParamGroup]:
    """The FSDP parameter groups of one module sharded with fully_shard (one unless per-parameter
    meshes were used; none if it holds no parameters of its own)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)  # torch 2.13+: a list
    if groups is None:  # torch 2.11: one group, or None
        one = state._fsdp_param_group
        return [] if one is None else [one]
    return list(groups)


def unsupported_reason(pg: ParamGroup) -> str | None:
    """Why sdpq cannot replace this group's collectives, or None."""
    if not isinstance(pg.mesh_info, FSDPMeshInfo):
        return "is not sharded (replicate-only mesh)"
    post = pg.post_forward_mesh_info
    if post is not None and post is not pg.mesh_info and post != pg.mesh_info:
        return (
            "uses reshard_after_forward=<int> (resharding to a smaller group after forward); sdpq "
            "supports True/False. sdpq's 'diff' weights already keep a node-resident copy (like "
            "hpZ): use reshard_after_forward=True"
        )
    if any(hasattr(fp._sharded_local_tensor, "fsdp_pre_all_gather") for fp in pg.fsdp_params):
        return (
            "holds tensor subclasses with fsdp_pre_all_gather (e.g. float8 all-gather); sdpq "
            "replaces the all-gather itself"
        )
    return None


def shard_group(pg: ParamGroup) -> dist.ProcessGroup:
    """The process group the parameters are sharded over (what the all-gather runs on)."""
    return pg.mesh_info.shard_process_group


def is_mesh_hsdp(pg: ParamGroup) -> bool:
    """Sharded on a 2-D (replicate, shard) mesh: FSDP2 all-reduces across replicas itself."""
    return bool(pg._is_hsdp)


def replicate_group(pg: ParamGroup) -> dist.ProcessGroup:
    """Mesh HSDP: the process group FSDP2 all-reduces the gradients across (the mesh's replicate dim)."""
    return pg.mesh_info.replicate_process_group


def shard_dim_only(pg: ParamGroup) -> None:
    """Make a mesh-HSDP group 1-D FSDP on its shard dim, for sdpq's all-reduce hook to replace
    FSDP2's replicate all-reduce: FSDP2 all-reduces only a group whose `mesh_info` has a replicate
    dim, and calls the all-reduce hook on the reduce-scatter output either way. Only the group's
    view changes: its parameters stay DTensors on the 2-D mesh (replicated across its replicate
    dim, which the hook keeps true), and the gathers and reduce-scatters run on the same shard
    group. comm_settings() saved the HSDP view; restore_comm_settings() puts it back."""
    hsdp = pg.mesh_info
    fields = {f.name: getattr(hsdp, f.name) for f in dataclasses.fields(FSDPMeshInfo) if f.init}
    one_d = FSDPMeshInfo(**{**fields, "replicate_mesh_dim": None})
    if hasattr(hsdp, "reduce_scatter_process_group"):  # torch 2.13+: set_separate_reduce_scatter_group
        one_d.reduce_scatter_process_group = hsdp.reduce_scatter_process_group
    if pg.post_forward_mesh_info is hsdp:  # reshard_after_forward=True: the same object
        pg.post_forward_mesh_info = one_d
    pg.mesh_info = one_d


def has_all_reduce_hook(pg: ParamGroup) -> bool:
    """Someone set an all-reduce hook on the group (set_all_reduce_hook), e.g. torchft's replica all-reduce."""
    return pg._all_reduce_hook is not None


def sharded_params(pg: ParamGroup) -> list[DTensor]:
    """The group's parameters as the optimizer sees them (sharded DTensors), in FSDP's order."""
    return [fp.sharded_param for fp in pg.fsdp_params]


def shard_numels(pg: ParamGroup) -> list[tuple[int, bool]]:
    """Per parameter, in FSDP's order: (elements of its padded shard on this rank, whether it
    requires a gradient). FSDP's flat all-gather input is their concatenation; its reduce-scatter
    input, per rank, that of the parameters that got a gradient."""
    return [(fp.padded_sharded_param_size.numel(), fp.sharded_param.requires_grad) for fp in pg.fsdp_params]


def shard_row_widths(pg: ParamGroup) -> list[int]:
    """Per parameter, in FSDP's order: the row width of its shard (the last dim of a parameter
    sharded on dim 0, whose shards then hold whole rows; 0 for 1-D parameters and for other
    shard placements, whose shards sdpq does not look into)."""
    out = []
    for fp in pg.fsdp_params:
        size, placement = fp.padded_sharded_param_size, getattr(fp, "fsdp_placement", None)
        dim = getattr(placement, "dim", 0)
        out.append(int(size[-1]) if len(size) > 1 and dim == 0 else 0)
    return out


def param_dtype(pg: ParamGroup) -> torch.dtype:
    """The dtype FSDP all-gathers in: the mixed-precision param dtype, else the parameters'."""
    if hasattr(pg, "mp_policy"):  # torch <= 2.14: one policy per group
        return pg.mp_policy.param_dtype or pg.fsdp_params[0].sharded_param.dtype
    # torch 2.15: the policy is resolved per parameter (FSDPParam.mp_policy)
    dtypes = {fp.mp_policy.param_dtype or fp.sharded_param.dtype for fp in pg.fsdp_params}
    if len(dtypes) != 1:
        raise ValueError(
            f"sdpq.fsdp: one FSDP module's parameters all-gather in several dtypes {sorted(map(str, dtypes))}; "
            "sdpq gathers a module's parameters as one bucket: give them one param_dtype"
        )
    return dtypes.pop()


def device(pg: ParamGroup) -> torch.device:
    return pg.device


def gradient_divide_factor(pg: ParamGroup) -> float | None:
    """The divide factor set with set_gradient_divide_factor, None if nobody set one."""
    return pg.gradient_divide_factor


def all_reduce_wanted(pg: ParamGroup) -> bool:
    """False while the user defers the replicate all-reduce (`set_requires_all_reduce(False)`)."""
    return bool(pg.all_reduce_grads)


def comm_settings(pg: ParamGroup) -> tuple:
    """What apply() changes on the group, as remove() must restore it: (all-gather comm,
    reduce-scatter comm, force-sum flag, all-reduce hook, gradient divide factor, mesh info,
    post-forward mesh info)."""
    return (
        pg._all_gather_comm,
        pg._reduce_scatter_comm,
        pg.force_sum_reduction_for_comms,
        pg._all_reduce_hook,
        pg.gradient_divide_factor,
        pg.mesh_info,
        pg.post_forward_mesh_info,
    )


def restore_comm_settings(module: Any, saved: tuple, *, all_reduce: bool) -> None:
    """Put back what comm_settings() returned, through FSDPModule's public setters (the mesh
    views, which shard_dim_only() may have replaced, directly)."""
    all_gather, reduce_scatter, force_sum, all_reduce_hook, divide_factor, mesh_info, post_forward = saved
    for pg in param_groups(module):
        pg.mesh_info, pg.post_forward_mesh_info = mesh_info, post_forward
    module.set_custom_all_gather(all_gather)
    module.set_custom_reduce_scatter(reduce_scatter)
    module.set_force_sum_reduction_for_comms(force_sum)
    if all_reduce:
        module.set_all_reduce_hook(all_reduce_hook)  # None (no hook) unless the user had one
        module.set_gradient_divide_factor(divide_factor)
