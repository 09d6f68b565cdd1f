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

HSDP (2-D mesh (replicate, shard)): FSDP2 hands the custom comms the SHARD group only; the
replicate-dim gradient all-reduce is FSDP2's own `dist.all_reduce` with no hook to replace it (the
all-reduce hook runs after it), so it stays full precision. sdpq runs its collectives on the shard
group seen as its own nodes' x L' grid of the physical layout: with the usual layout (shard inside
a node) nodes' = 1, so the weight reference is the exact shard (no slow link to save: weights
travel exactly, or int8 in "direct" mode) and gradients take only the 8-bit intra-node stage;
with a shard dim across nodes L' = 1 and the 4-bit inter-node stages apply. The byte statistics
count what sdpq sends; the replicate all-reduce is not in them.

Checkpoints (torch.distributed.checkpoint): put `state_dict(model)` next to the model and
optimizer state; after `dcp.load`, pass the loaded dict to `load_state_dict(model, ...)`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from ..comm import GradReduceScatter, Topology, TopologyError, WeightGather
from ..config import Config

try:  # FSDP2's comm interfaces (private module; the public methods take instances of these)
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo
except ImportError as e:  # pragma: no cover - torch without FSDP2 custom comms
    raise ImportError(f"sdpq.fsdp needs torch >= 2.8 with FSDP2 custom comm hooks ({e})") from e

from ._fsdp_topology import topology_for_mesh_dim

__all__ = [
    "apply",
    "remove",
    "mark_weights_changed",
    "state_dict",
    "load_state_dict",
    "is_applied",
    "module_comms",
    "ModuleComms",
    "StaleWeightsWarning",
]

_ROOT_ATTR = "_sdpq_fsdp"
_MODULE_ATTR = "_sdpq_fsdp_comms"


class StaleWeightsWarning(RuntimeWarning):
    """A gather found the sharded weights modified in place since the weight path last read them,
    but nobody marked them (no hooked optimizer step, no mark_weights_changed)."""


# ----------------------------------------------------------------------------- per-module state


@dataclass(eq=False)
class ModuleComms:
    """sdpq's state for one FSDP module: its weight gather and its gradient reduce-scatter(s)."""

    fqn: str
    module: Any = field(repr=False)
    param_group: Any = field(repr=False)
    topology: Topology = field(repr=False)
    config: Config = field(repr=False)
    weights: WeightGather = field(repr=False)
    gradients: dict = field(default_factory=dict, repr=False)  # reduce-scatter numel -> GradReduceScatter
    gather_input_numel: int = 0
    grad_numel: int = 0  # reduce-scatter numel when every trainable parameter has a gradient
    _saved: tuple = field(default=(), repr=False)  # FSDP's own comms, restored by remove()
    _versions: tuple | None = field(default=None, repr=False)
    _warned: bool = field(default=False, repr=False)

    def gradient_comm(self, numel: int) -> GradReduceScatter:
        rs = self.gradients.get(numel)
        if rs is None:
            rs = GradReduceScatter(numel, self.topology, self.config.gradients, device=self.param_group.device,
                                   stats=self.config.stats)
            self.gradients[numel] = rs
        return rs

    def check_group(self, group) -> None:
        if group is self.topology.world_group:
            return
        ranks = dist.get_process_group_ranks(group)
        if ranks != dist.get_process_group_ranks(self.topology.world_group):
            raise TopologyError(
                f"sdpq ({self.fqn or '<root>'}): FSDP called the comm on ranks {ranks}, but sdpq was "
                f"set up for {dist.get_process_group_ranks(self.topology.world_group)} (changed the mesh "
                "or reshard_after_forward after sdpq.fsdp.apply? call remove() and apply() again)"
            )

    def shard_versions(self) -> tuple:
        # Note: in-place updates of a sharded DTensor parameter (optimizer step, DCP
        # set_model_state_dict, mul_/copy_ by hand) bump the DTensor's own version counter (not its
        # local tensor's); edits through .data or the local tensor are not seen.
        return tuple(fp.sharded_param._version for fp in self.param_group.fsdp_params)


class _SdpqAllGather(AllGather):
    def __init__(self, comms: ModuleComms):
        self.comms = comms

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        c = self.comms
        c.check_group(group)
        if input_tensor.numel() != c.gather_input_numel or output_tensor.dtype == torch.uint8:
            raise RuntimeError(
                f"sdpq ({c.fqn or '<root>'}): FSDP all-gather input of {input_tensor.numel()} "
                f"{input_tensor.dtype} elements, expected {c.gather_input_numel} floats (tensor "
                "subclasses with fsdp_pre_all_gather, e.g. fp8 all-gather, are not supported)")
        wg = c.weights
        if wg.config.mode == "diff":
            versions = c.shard_versions()
            if wg.dirty:
                c._versions = versions
            elif versions != c._versions and not c._warned:
                c._warned = True
                warnings.warn(
                    f"sdpq: the weights of FSDP module {c.fqn or '<root>'} were modified in place but "
                    "not marked: the gathered weights are the previous version. Pass the optimizer to "
                    "sdpq.fsdp.apply, or call sdpq.fsdp.mark_weights_changed(model) after changing "
                    "weights (or sdpq.fsdp.load_state_dict after a checkpoint load)",
                    StaleWeightsWarning, stacklevel=2)
        wg.gather(input_tensor, out=output_tensor)
        return None  # synchronous: FSDP accepts None for the work handle


class _SdpqReduceScatter(ReduceScatter):
    def __init__(self, comms: ModuleComms):
        self.comms = comms

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        c = self.comms
        c.check_group(group)
        c.gradient_comm(input_tensor.numel()).reduce_scatter(input_tensor, out=output_tensor)
        if op == dist.ReduceOp.AVG:  # only if someone turned force-sum off again
            output_tensor.div_(group.size())
        elif op != dist.ReduceOp.SUM:
            raise RuntimeError(f"sdpq ({c.fqn or '<root>'}): reduce op {op} is not supported (SUM/AVG only)")
        return None


@dataclass(eq=False)
class _Applied:
    config: Config
    comms: list  # ModuleComms, in model.named_modules() order
    hooks: list  # optimizer hook handles


# ----------------------------------------------------------------------------- helpers


def _as_config(config: Config | Mapping[str, Any] | None) -> Config:
    if config is None:
        return Config()
    if isinstance(config, Config):
        return config
    if isinstance(config, Mapping):
        return Config.from_dict(config)
    raise TypeError(f"sdpq.fsdp.apply: config must be a sdpq.Config, a dict or None, got {type(config).__name__}")


def _fsdp_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]


def _applied(model: nn.Module) -> _Applied:
    state = getattr(model, _ROOT_ATTR, None)
    if state is None:
        raise RuntimeError("sdpq.fsdp: sdpq is not applied to this model (call sdpq.fsdp.apply first)")
    return state


def _optimizers(optimizer) -> list[torch.optim.Optimizer]:
    if optimizer is None:
        return []
    opts = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    for o in opts:
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(f"sdpq.fsdp.apply: optimizer must be a torch.optim.Optimizer, got {type(o).__name__}")
    return opts


def _param_group_of(name: str, module: nn.Module):
    groups = module._get_fsdp_state()._fsdp_param_groups
    if len(groups) > 1:
        raise ValueError(f"sdpq.fsdp: FSDP module {name or '<root>'} has {len(groups)} param groups "
                         "(per-parameter meshes); sdpq supports one per FSDP module")
    if not groups:
        return None
    pg = groups[0]
    if not isinstance(pg.mesh_info, FSDPMeshInfo):
        raise ValueError(f"sdpq.fsdp: FSDP module {name or '<root>'} is not sharded (replicate-only mesh)")
    post = pg.post_forward_mesh_info
    if post is not None and post is not pg.mesh_info and post != pg.mesh_info:
        raise ValueError(
            f"sdpq.fsdp: FSDP module {name or '<root>'} uses reshard_after_forward=<int> (resharding to a "
            "smaller group after forward); sdpq supports True/False. sdpq's 'diff' weights already keep "
            "a node-resident copy (like hpZ): use reshard_after_forward=True")
    if any(hasattr(fp._sharded_local_tensor, "fsdp_pre_all_gather") for fp in pg.fsdp_params):
        raise ValueError(f"sdpq.fsdp: FSDP module {name or '<root>'} holds tensor subclasses with "
                         "fsdp_pre_all_gather (e.g. float8 all-gather); sdpq replaces the all-gather itself")
    return pg


# ----------------------------------------------------------------------------- public API


def apply(model: nn.Module, config: Config | Mapping[str, Any] | None = None, optimizer=None) -> nn.Module:
    """Install sdpq's weight all-gather and gradient reduce-scatter on every FSDP module of
    `model` (after `fully_shard`; collective: call it on every rank alike). `optimizer` (one or a
    list): its steps mark the weights changed. Returns `model`.

    Errors: TypeError if no module of `model` is sharded with fully_shard; RuntimeError if sdpq is
    already applied (call remove() first); sdpq.comm.TopologyError if config.topology does not fit
    the world or the FSDP mesh; ValueError for FSDP setups sdpq does not support.
    """
    cfg = _as_config(config)
    modules = _fsdp_modules(model)
    if not modules:
        raise TypeError(
            f"sdpq.fsdp.apply: {type(model).__name__} has no FSDP module: shard it first with "
            "torch.distributed.fsdp.fully_shard (per block, then the root), then call apply")
    if hasattr(model, _ROOT_ATTR) or any(hasattr(m, _MODULE_ATTR) for _, m in modules):
        raise RuntimeError("sdpq.fsdp.apply: sdpq is already applied to this model (or a part of it); "
                           "call sdpq.fsdp.remove(model) before applying it again")
    opts = _optimizers(optimizer)
    groups = [(name, m, _param_group_of(name, m)) for name, m in modules]
    groups = [g for g in groups if g[2] is not None]
    if not dist.is_initialized():
        raise RuntimeError("sdpq.fsdp.apply: torch.distributed is not initialised")
    world = Topology.build(cfg.topology)
    # One Topology per distinct shard group; built in model order, the same on every rank.
    topologies: dict[int, Topology] = {}
    comms_list: list[ModuleComms] = []
    for name, module, pg in groups:
        mi = pg.mesh_info
        key = id(mi.shard_process_group)
        if key not in topologies:
            topologies[key] = topology_for_mesh_dim(world, mi.mesh, mi.shard_mesh_dim, mi.shard_process_group)
        topo = topologies[key]
        params = pg.fsdp_params
        gather_in = sum(fp.padded_sharded_param_size.numel() for fp in params)
        grad_in = sum(fp.padded_sharded_param_size.numel() for fp in params if fp.sharded_param.requires_grad)
        dtype = pg.mp_policy.param_dtype or params[0].sharded_param.dtype
        N = topo.world_size
        wg = WeightGather(gather_in * N, topo, cfg.weights, dtype=dtype, device=pg.device, stats=cfg.stats)
        comms = ModuleComms(fqn=name, module=module, param_group=pg, topology=topo, config=cfg, weights=wg,
                            gather_input_numel=gather_in, grad_numel=grad_in * N)
        if grad_in:
            comms.gradient_comm(grad_in * N)
        comms._saved = (pg._all_gather_comm, pg._reduce_scatter_comm, pg.force_sum_reduction_for_comms)
        comms_list.append(comms)
    marked_by_opt = []
    for opt in opts:
        owned = {id(p) for g in opt.param_groups for p in g["params"]}
        marked = [c for c in comms_list if any(id(fp.sharded_param) in owned for fp in c.param_group.fsdp_params)]
        if not marked:
            raise ValueError("sdpq.fsdp.apply: the optimizer holds none of this model's sharded parameters "
                             "(build it from model.parameters() after fully_shard)")
        marked_by_opt.append(marked)
    # Nothing is installed before every check has passed.
    for comms in comms_list:
        m = comms.module
        m.set_custom_all_gather(_SdpqAllGather(comms))
        m.set_custom_reduce_scatter(_SdpqReduceScatter(comms))
        m.set_force_sum_reduction_for_comms(True)
        setattr(m, _MODULE_ATTR, comms)
    hooks = []
    for opt, marked in zip(opts, marked_by_opt):

        def _after_step(_opt, _args, _kwargs, marked=marked):
            for c in marked:
                c.weights.mark_dirty()

        hooks.append(opt.register_step_post_hook(_after_step))
    setattr(model, _ROOT_ATTR, _Applied(config=cfg, comms=comms_list, hooks=hooks))
    return model


def remove(model: nn.Module) -> None:
    """Restore FSDP's own all-gather / reduce-scatter (and force-sum setting) on every module
    and drop sdpq's state and optimizer hooks."""
    state = _applied(model)
    for h in state.hooks:
        h.remove()
    for c in state.comms:
        ag, rs, force_sum = c._saved
        c.param_group._all_gather_comm = ag  # the public setters only accept new custom comms
        c.param_group._reduce_scatter_comm = rs
        c.module.set_force_sum_reduction_for_comms(force_sum)
        delattr(c.module, _MODULE_ATTR)
    delattr(model, _ROOT_ATTR)


def is_applied(model: nn.Module) -> bool:
    return hasattr(model, _ROOT_ATTR)


def module_comms(model: nn.Module) -> dict[str, ModuleComms]:
    """{FSDP module name: its ModuleComms} (weights: WeightGather, gradients: {numel: GradReduceScatter})."""
    return {c.fqn: c for c in _applied(model).comms}


def mark_weights_changed(model: nn.Module, *, exact: bool = True) -> None:
    """The sharded weights changed outside a hooked optimizer step (by hand, or a checkpoint
    load without sdpq's state): the next gather of every module refreshes the weight reference.
    `exact=True` (default) makes that refresh an exact exchange (one unquantized gather), right for
    arbitrary jumps; `exact=False` sends a quantized difference, right for small updates.
    Call it on every rank alike."""
    for c in _applied(model).comms:
        c.weights.mark_dirty(resync=exact)


# ----------------------------------------------------------------------------- checkpoints


def _rng_state(obj) -> torch.Tensor | None:
    """The stochastic-rounding generator state of a WeightGather/GradReduceScatter (created now
    if it has not been used yet, so that the set of saved keys does not depend on history)."""
    sd = obj.state_dict()
    if "generator" in sd:
        return sd["generator"]
    if getattr(obj.config, "rounding", "nearest") != "stochastic":
        return None
    if isinstance(obj, WeightGather) and obj.config.mode == "exact":
        return None
    gen = getattr(obj, "_gen", None)
    if gen is None:  # Note: GradReduceScatter creates it lazily with its own seed formula
        if hasattr(obj, "_generator"):
            gen = obj._generator(obj.device)
        else:
            obj._gen = gen = torch.Generator(device=obj.device).manual_seed(0x5D9 + obj.topology.rank)
    return gen.get_state()


def _set_rng_state(obj, state: torch.Tensor) -> None:
    sd = obj.state_dict()
    if "generator" in sd:  # the collective saves its generator itself: restore it the same way
        sd["generator"] = state
        obj.load_state_dict(sd)
        return
    gen = getattr(obj, "_gen", None)
    if gen is None:
        gen = obj._generator(obj.device) if hasattr(obj, "_generator") else torch.Generator(device=obj.device)
        obj._gen = gen
    gen.set_state(state.clone())


def state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's sdpq state as a flat dict of tensors, for torch.distributed.checkpoint: weight
    references (+ version), gradient error-feedback residuals, stochastic-rounding RNG states.
    Keys start with "rank{r}." so that DCP keeps every rank's own copy. The same call on a freshly
    set-up model gives the template to load into (same shapes)."""
    rank = dist.get_rank()
    out: dict[str, torch.Tensor] = {}
    for c in _applied(model).comms:
        topo = c.topology
        p = f"rank{rank}.{c.fqn or '<root>'}."
        wg = c.weights
        out[p + "layout"] = torch.tensor([topo.world_size, topo.ranks_per_node, wg.numel], dtype=torch.int64)
        if wg.config.mode == "diff":
            ref = wg.reference
            out[p + "weights.version"] = torch.tensor(wg.version if ref is not None else -1, dtype=torch.int64)
            out[p + "weights.reference"] = (ref.detach().clone() if ref is not None else
                                           torch.zeros((topo.nodes, wg.shard_numel), dtype=wg.reference_dtype))
        rng = _rng_state(wg)
        if rng is not None:
            out[p + "weights.rng"] = rng
        for numel, rs in sorted(c.gradients.items()):
            q = p + f"gradients.{numel}."
            if rs.config.mode == "two_level" and rs.config.error_feedback and topo.nodes > 1:
                res = rs.residual
                out[q + "residual"] = (res.clone() if res is not None else
                                       torch.zeros((topo.nodes, rs.padded_chunk), dtype=torch.float32))
            rng = _rng_state(rs) if rs.config.mode == "two_level" else None
            if rng is not None:
                out[q + "rng"] = rng
    return out


def load_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Restore what state_dict saved (after dcp.load filled it). Marks the weights changed with a
    quantized difference against the restored reference, exactly as the uninterrupted run's next
    gather would: resuming reproduces the trajectory bitwise. Do not call mark_weights_changed
    on top of it (that would make the next refresh exact)."""
    rank = dist.get_rank()
    for c in _applied(model).comms:
        topo = c.topology
        p = f"rank{rank}.{c.fqn or '<root>'}."
        wg = c.weights
        layout = state.get(p + "layout")
        mine = [topo.world_size, topo.ranks_per_node, wg.numel]
        if layout is None or layout.tolist() != mine:
            raise ValueError(
                f"sdpq.fsdp.load_state_dict: no state for {c.fqn or '<root>'} with layout (world, ranks_per_node, "
                f"numel) = {mine} (saved: {None if layout is None else layout.tolist()}); to resume on another "
                "layout, skip sdpq's state and call sdpq.fsdp.mark_weights_changed(model)")
        if wg.config.mode == "diff":
            version = int(state[p + "weights.version"])
            if version < 0:  # saved before the first gather
                wg.reference, wg.version = None, 0
                wg.mark_dirty()
            else:
                wg.load_state_dict({"mode": wg.config.mode, "layout": topo.layout, "numel": wg.numel,
                                    "version": version, "reference": state[p + "weights.reference"]})
        else:
            wg.mark_dirty()
        if p + "weights.rng" in state:
            _set_rng_state(wg, state[p + "weights.rng"])
        for numel, rs in c.gradients.items():
            q = p + f"gradients.{numel}."
            if q + "residual" in state:
                rs.load_state_dict({"residual": state[q + "residual"]})
            if q + "rng" in state:
                _set_rng_state(rs, state[q + "rng"])
