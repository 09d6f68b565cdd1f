"""sdpq for PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`): one call after sharding.

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = sdpq.optim.AdamW(model.parameters(), lr=3e-4)   # or any torch optimizer
    sdpq.fsdp.apply(model, sdpq.Config(), optimizer=optimizer)

Per FSDP module (one FSDP param group each), `apply` installs through FSDP2's public hooks:
- `set_custom_all_gather`: a `sdpq.comm.WeightGather` whose bucket is the module's flat
  all-gather buffer. FSDP2 lays that buffer out as N equal rank slices (each the concatenation
  of the rank's padded parameter shards), which is exactly WeightGather's "N shards of
  shard_numel"; the input FSDP passes is a slice of the output, and WeightGather reads it first.
- `set_custom_reduce_scatter`: a `sdpq.comm.GradReduceScatter` per reduce-scatter buffer size.
  FSDP2's buffer is N equal chunks (chunk r -> rank r) of the padded gradients of the parameters
  that got one; frozen parameters are left out, so it may be smaller than the all-gather buffer.
- `set_force_sum_reduction_for_comms(True)`: FSDP hands the comm op=SUM and divides the result by
  the data-parallel size afterwards, in the reduce dtype - the same division plain FSDP2 does
  (on gloo AVG is SUM then divide), so with sdpq's exact modes the gradients are bitwise FSDP2's.

The weight path must know when the weights change: `apply(..., optimizer=opt)` marks them
after every `opt.step()`; `mark_weights_changed(model)` does it for edits by hand or a checkpoint
load without sdpq's state. A gather that finds the shards modified in place without either
warns (`StaleWeightsWarning`): the gathered weights are then the previous version.

HSDP: 1-D `fully_shard` on the shard dim and `apply(..., replicate=mesh["replicate"])`: sdpq sums
the reduce-scatter output across the replicate group itself (FSDP2's all-reduce hook, a
`sdpq.comm.GradAllReduce`, bitwise equal on every replica) and FSDP2 divides by shard x replicate
size. FSDP2's own 2-D mesh HSDP all-reduces in full precision before any hook (without `replicate`
it keeps working, unquantized); `apply(..., replicate="mesh")` takes that all-reduce over (the
modules' groups become 1-D FSDP on the shard dim, which remove() undoes); see docs/fsdp.md. Any
shard group (FSDP x TP sub-meshes too) gets its node layout from `Topology.for_group`.

Checkpoints (torch.distributed.checkpoint): put `state_dict(model)` next to the model and
optimizer state; to load, build the template with `state_dict(model, checkpoint_id=path)` and
after `dcp.load` pass the loaded dict to `load_state_dict(model, ...)`. The same layout resumes
bitwise; another layout (nodes, ranks per node or world size) rebuilds sdpq's state (see
_fsdp_checkpoint.py) and continues.

Files: this one sets up and tears down; `_fsdp_hooks.py` holds the per-module state and the comm
hooks FSDP calls, `_fsdp_checkpoint.py` the DCP state, `_fsdp_internals.py` every access to FSDP2's
private objects (and the torch versions it was checked against).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from ..comm import CommStats, Topology, WeightGather
from ..comm.agreement import check_agreement
from ..comm.segments import sharded_segments
from ..comm.stats import process_stats
from ..config import Config
from . import _fsdp_internals as fsdp_internals
from ._config_arg import as_config
from ._fsdp_checkpoint import (  # re-exported as sdpq.fsdp.*
    CheckpointLoadError,
    ResumeLayoutWarning,
    load_state_dict,
    state_dict,
)
from ._fsdp_hooks import (
    MODULE_ATTR,
    ROOT_ATTR,
    Applied,
    ModuleComms,
    SdpqAllGather,
    SdpqAllReduceHook,
    SdpqReduceScatter,
    StaleWeightsWarning,
    applied,
)

__all__ = [
    "apply",
    "remove",
    "mark_weights_changed",
    "state_dict",
    "load_state_dict",
    "CheckpointLoadError",
    "ResumeLayoutWarning",
    "is_applied",
    "module_comms",
    "ModuleComms",
    "StaleWeightsWarning",
]


# ----------------------------------------------------------------------------- helpers


def _fsdp_modules(model: nn.Module) -> list[tuple[str, Any]]:  # (name, an nn.Module that is an FSDPModule)
    return [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]


def _optimizers(optimizer) -> list[torch.optim.Optimizer]:
    if optimizer is None:
        return []
    opts = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    for o in opts:
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(f"sdpq.fsdp.apply: optimizer must be a torch.optim.Optimizer, got {type(o).__name__}")
    return [_unwrapped(o) for o in opts]


def _unwrapped(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose step changes the weights.

    Note: framework wrappers (Accelerate's AcceleratedOptimizer) subclass Optimizer without running
    its __init__ and call the wrapped optimizer's step, so step hooks belong on the wrapped one;
    a step the wrapper skips (while accumulating gradients) then marks nothing."""
    while not hasattr(opt, "_optimizer_step_post_hooks"):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            break
        opt = inner
    return opt


def _param_group_of(name: str, module: Any):
    groups = fsdp_internals.param_groups(module)
    if len(groups) > 1:
        raise ValueError(
            f"sdpq.fsdp: FSDP module {name or '<root>'} has {len(groups)} param groups "
            "(per-parameter meshes); sdpq supports one per FSDP module (FSDP2 refuses custom comm hooks "
            "on a module with several); shard each group's parameters as a module of their own, e.g. "
            "fully_shard(block.moe.experts, mesh=...) before fully_shard(block) (docs/fsdp.md)"
        )
    if not groups:
        return None
    problem = fsdp_internals.unsupported_reason(groups[0])
    if problem is not None:
        raise ValueError(f"sdpq.fsdp: FSDP module {name or '<root>'} {problem}")
    return groups[0]


# ----------------------------------------------------------------------------- public API


def _distinct_groups(groups: list) -> list:
    """(name, module, param group) once per parameter group. Note: fully_shard([a, b]) makes a
    and b one FSDP group (torchtitan shards [norm, lm_head] so): one ModuleComms serves both."""
    seen: set[int] = set()
    out = []
    for name, module, pg in groups:
        if pg is not None and id(pg) not in seen:
            seen.add(id(pg))
            out.append((name, module, pg))
    return out


def _checked_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    modules = _fsdp_modules(model)
    if not modules:
        raise TypeError(
            f"sdpq.fsdp.apply: {type(model).__name__} has no FSDP module: shard it first with "
            "torch.distributed.fsdp.fully_shard (per block, then the root), then call apply"
        )
    if hasattr(model, ROOT_ATTR) or any(hasattr(m, MODULE_ATTR) for _, m in modules):
        raise RuntimeError(
            "sdpq.fsdp.apply: sdpq is already applied to this model (or a part of it); "
            "call sdpq.fsdp.remove(model) before applying it again"
        )
    return modules


def _replicate_group(replicate, groups: list) -> tuple[Any, str | None]:
    """(the process group of `replicate` (a ProcessGroup, a 1-D DeviceMesh, or "mesh": the
    replicate dim of FSDP2's own 2-D mesh), why this rank cannot use it or None). Checked against
    the FSDP modules: FSDP on a group of at least two ranks that meets the replicate group in this
    rank only, 1-D unless "mesh" takes the 2-D mesh's all-reduce over. Note: the reason is
    returned, not raised, so that every rank first agrees on it (a rank raising alone would leave
    the others waiting in the next collective)."""
    if replicate is None:
        return None, None
    take_over = isinstance(replicate, str)
    if take_over:
        if replicate != "mesh":
            allowed = "a ProcessGroup, a 1-D DeviceMesh or 'mesh'"
            return None, f"sdpq.fsdp.apply: replicate must be {allowed}, not {replicate!r}"
        group, problem = _mesh_replicate_group(groups)
        if problem is not None:
            return group, problem
    else:
        group = replicate.get_group() if isinstance(replicate, DeviceMesh) else replicate
        if not isinstance(group, dist.ProcessGroup):
            return None, (
                f"sdpq.fsdp.apply: replicate must be a ProcessGroup, a 1-D DeviceMesh or 'mesh', got {type(replicate)}"
            )
    ranks = set(dist.get_process_group_ranks(group))
    for name, _, pg in groups:
        what = f"FSDP module {name or '<root>'}"
        shard = set(dist.get_process_group_ranks(fsdp_internals.shard_group(pg)))
        if fsdp_internals.is_mesh_hsdp(pg) and not take_over:
            return group, (
                f"sdpq.fsdp.apply: {what} is sharded on a 2-D mesh (FSDP2's mesh HSDP), whose replicate all-reduce "
                "FSDP2 does itself; for sdpq's quantized one shard on the shard dimension only, "
                "fully_shard(module, mesh=mesh['shard']), and pass replicate=mesh['replicate'], "
                "or pass replicate='mesh' to take FSDP2's replicate all-reduce over"
            )
        if len(shard) < 2:
            return group, f"sdpq.fsdp.apply: {what} is sharded over one rank; with replicate= use a shard group of 2+"
        if shard & ranks != {dist.get_rank()}:
            return group, (
                f"sdpq.fsdp.apply: the replicate group {sorted(ranks)} and the shard group {sorted(shard)} of "
                f"{what} must meet in this rank only (they are two dimensions of one mesh)"
            )
    return group, None


def _mesh_replicate_group(groups: list) -> tuple[Any, str | None]:
    """replicate="mesh": (the replicate group of the 2-D mesh every FSDP module is sharded on,
    why this rank cannot take it over or None)."""
    if not groups:
        return None, "sdpq.fsdp.apply: replicate='mesh' but no FSDP module holds parameters"
    flat = [name for name, _, pg in groups if not fsdp_internals.is_mesh_hsdp(pg)]
    if flat:
        return None, (
            f"sdpq.fsdp.apply: replicate='mesh' takes over FSDP2's mesh HSDP, but FSDP module {flat[0] or '<root>'} "
            "is not sharded on a 2-D (replicate, shard) mesh; with 1-D FSDP pass the replicate group itself"
        )
    rep = [fsdp_internals.replicate_group(pg) for _, _, pg in groups]
    if len({tuple(dist.get_process_group_ranks(g)) for g in rep}) > 1:
        return rep[0], "sdpq.fsdp.apply: replicate='mesh' needs one replicate group for every FSDP module"
    return rep[0], None


def _broadcast_replicas(comms_list: list[ModuleComms], group) -> None:
    """Start every replica from the first replica's parameter shards (as DDP does for
    parameters; buffers are left alone): the replicate all-reduce keeps them equal only if they
    start equal."""
    src = dist.get_process_group_ranks(group)[0]
    with torch.no_grad():
        for c in comms_list:
            for p in fsdp_internals.sharded_params(c.param_group):
                dist.broadcast(p.to_local(), src=src, group=group)


def _install(comms: ModuleComms) -> None:
    """Point one FSDP module's collectives at sdpq's (FSDP2's public setters)."""
    m = comms.module
    m.set_custom_all_gather(SdpqAllGather(comms))
    m.set_custom_reduce_scatter(SdpqReduceScatter(comms))
    m.set_force_sum_reduction_for_comms(True)
    if comms.replicate is not None:
        if fsdp_internals.is_mesh_hsdp(comms.param_group):  # replicate="mesh": FSDP2 stops all-reducing
            fsdp_internals.shard_dim_only(comms.param_group)
        m.set_all_reduce_hook(SdpqAllReduceHook(comms))
        if fsdp_internals.gradient_divide_factor(comms.param_group) is None:  # else the user's: the total divisor
            m.set_gradient_divide_factor(float(comms.topology.world_size * comms.replicate.world_size))
    setattr(m, MODULE_ATTR, comms)


def _module_comms(
    name: str, module: nn.Module, pg, topo: Topology, cfg: Config, stats: CommStats, replicate: Topology | None
) -> ModuleComms:
    """The weight gather and gradient reduce-scatter (and, with HSDP, the replicate all-reduce) of
    one FSDP module's parameter group, all built now (collective: every rank, in model order)."""
    numels = fsdp_internals.shard_numels(pg)
    gather_in = sum(n for n, _ in numels)
    grad_in = sum(n for n, trainable in numels if trainable)
    dtype = fsdp_internals.param_dtype(pg)
    device = fsdp_internals.device(pg)
    N = topo.world_size
    # Every quantization group inside one parameter's shard (the shards lie one after another).
    segments = sharded_segments([(n, 0) for n, _ in numels], 1)[0]
    stats = CommStats(config=cfg.stats, parent=stats)  # this module's counters; they add up into the model's
    kw: dict[str, Any] = {"dtype": dtype, "device": device, "stats": cfg.stats, "record_to": stats}
    wg = WeightGather(gather_in * N, topo, cfg.weights, segments=segments, **kw)
    comms = ModuleComms(
        fqn=name,
        module=module,
        param_group=pg,
        topology=topo,
        config=cfg,
        weights=wg,
        stats=stats,
        gather_input_numel=gather_in,
        grad_numel=grad_in * N,
        replicate=replicate,
    )
    comms.build()
    comms._saved = fsdp_internals.comm_settings(pg)
    return comms


def _marked_by(opts: list[torch.optim.Optimizer], comms_list: list[ModuleComms]) -> list[list[ModuleComms]]:
    """Per optimizer, the modules whose weights its step changes (at least one, or an error)."""
    out = []
    for opt in opts:
        owned = {id(p) for g in opt.param_groups for p in g["params"]}
        marked = [c for c in comms_list if any(id(p) in owned for p in fsdp_internals.sharded_params(c.param_group))]
        if not marked:
            raise ValueError(
                "sdpq.fsdp.apply: the optimizer holds none of this model's sharded parameters "
                "(build it from model.parameters() after fully_shard)"
            )
        out.append(marked)
    return out


def _hook_step(opt: torch.optim.Optimizer, marked: list[ModuleComms]):
    def _after_step(_opt, _args, _kwargs):
        for c in marked:
            c.weights.mark_weights_changed(exact=False)  # an optimizer step: a small update

    return opt.register_step_post_hook(_after_step)


def apply(
    model: nn.Module, config: Config | Mapping[str, Any] | None = None, optimizer=None, *, replicate=None
) -> nn.Module:
    """Install sdpq's weight all-gather and gradient reduce-scatter on every FSDP module of
    `model` (after `fully_shard`; collective: call it on every rank alike). `optimizer` (one or a
    list): its steps mark the weights changed. Returns `model`.

    HSDP: shard with `fully_shard(module, mesh=mesh["shard"])` and pass `replicate=mesh["replicate"]`
    (a 1-D DeviceMesh or a ProcessGroup): sdpq then sums the gradients across the replicate group
    with its quantized all-reduce (FSDP's all-reduce hook) and makes the replicas start equal.
    Modules already sharded on a 2-D (replicate, shard) mesh (FSDP2's mesh HSDP, e.g. torchtitan's):
    `replicate="mesh"` does the same on that mesh's replicate dim, in place of FSDP2's all-reduce.

    Errors: TypeError if no module of `model` is sharded with fully_shard; RuntimeError if sdpq is
    already applied (call remove() first); sdpq.comm.TopologyError if config.topology does not fit
    the world or the FSDP mesh; ValueError for FSDP setups sdpq does not support.
    """
    cfg = as_config(config, "sdpq.fsdp.apply")
    modules = _checked_modules(model)
    opts = _optimizers(optimizer)
    groups = _distinct_groups([(name, m, _param_group_of(name, m)) for name, m in modules])
    if not dist.is_initialized():
        raise RuntimeError("sdpq.fsdp.apply: torch.distributed is not initialised")
    world = Topology.build(cfg.topology)
    # Note: the whole resolved config, not only what shapes the wire: a rank with other optimizer
    # settings would update its shards differently without any error.
    rep_group, problem = _replicate_group(replicate, groups)
    replicas = None if rep_group is None else dist.get_world_size(rep_group)
    agree = {"config": cfg.to_dict(), "layout": world.layout, "replicate": replicas, "usable": problem is None}
    check_agreement("sdpq.fsdp.apply", agree, world.world_group)
    if problem is not None:
        raise ValueError(problem)
    rep_topo = None if rep_group is None else Topology.for_group(rep_group, world)
    stats = CommStats(config=cfg.stats, parent=process_stats())  # this model's own counters
    # One Topology per distinct shard group; built in model order, the same on every rank.
    topologies: dict[int, Topology] = {}
    comms_list: list[ModuleComms] = []
    for name, module, pg in groups:
        shard = fsdp_internals.shard_group(pg)
        if id(shard) not in topologies:
            topologies[id(shard)] = Topology.for_group(shard, world)
        comms_list.append(_module_comms(name, module, pg, topologies[id(shard)], cfg, stats, rep_topo))
    marked_by_opt = _marked_by(opts, comms_list)
    # Note: nothing is installed before every check has passed.
    for comms in comms_list:
        _install(comms)
    if rep_group is not None:
        _broadcast_replicas(comms_list, rep_group)
    hooks = [_hook_step(opt, marked) for opt, marked in zip(opts, marked_by_opt)]
    setattr(model, ROOT_ATTR, Applied(config=cfg, comms=comms_list, hooks=hooks, stats=stats))
    return model


def remove(model: nn.Module) -> None:
    """Restore FSDP's own all-gather / reduce-scatter (and force-sum setting) on every module
    and drop sdpq's state and optimizer hooks."""
    state = applied(model)
    for h in state.hooks:
        h.remove()
    for c in state.comms:
        c._deferred = None  # a deferred micro-step sum is dropped with sdpq's hook
        fsdp_internals.restore_comm_settings(c.module, c._saved, all_reduce=c.replicate is not None)
        delattr(c.module, MODULE_ATTR)
    delattr(model, ROOT_ATTR)


def is_applied(model: nn.Module) -> bool:
    """Whether sdpq.fsdp.apply has installed sdpq on `model` (and remove() has not undone it)."""
    return hasattr(model, ROOT_ATTR)


def module_comms(model: nn.Module) -> dict[str, ModuleComms]:
    """{FSDP module name: its ModuleComms} (weights: its WeightGather, gradients: {numel: its
    GradReduceScatter}, replicas: {numel: its GradAllReduce} with HSDP; stats: the module's own
    byte counters, e.g. an expert module's apart from the dense layers')."""
    return {c.fqn: c for c in applied(model).comms}


def mark_weights_changed(model: nn.Module, *, exact: bool = True) -> None:
    """The sharded weights changed outside a hooked optimizer step (by hand, or a checkpoint
    load without sdpq's state): the next gather of every module refreshes the weight reference.
    `exact=True` (default) makes that refresh an exact exchange (one unquantized gather), right for
    arbitrary jumps; `exact=False` sends a quantized difference, right for small updates.
    Call it on every rank alike."""
    for c in applied(model).comms:
        c.weights.mark_weights_changed(exact=exact)
