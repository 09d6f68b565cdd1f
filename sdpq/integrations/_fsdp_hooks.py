"""The state sdpq.fsdp installs on an FSDP2 model and the comm hooks FSDP calls (see fsdp.py).

`ModuleComms` is sdpq's state for one FSDP module (its WeightGather and GradReduceScatters);
`SdpqAllGather` / `SdpqReduceScatter` implement FSDP2's custom-comm interfaces on top of it;
`Applied` is what `apply` records on the root model, found again with `applied(model)`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm import CommStats, GradAllReduce, GradReduceScatter, Topology, TopologyError, WeightGather
from ..config import Config

try:  # FSDP2's comm interfaces (private module; the public methods take instances of these)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError as e:  # pragma: no cover - torch without FSDP2 custom comms
    raise ImportError(f"sdpq.fsdp needs torch >= 2.8 with FSDP2 custom comm hooks ({e})") from e

__all__ = [
    "ROOT_ATTR",
    "MODULE_ATTR",
    "StaleWeightsWarning",
    "ModuleComms",
    "SdpqAllGather",
    "SdpqReduceScatter",
    "SdpqAllReduceHook",
    "Applied",
    "applied",
]

ROOT_ATTR = "_sdpq_fsdp"  # on the model: its Applied
MODULE_ATTR = "_sdpq_fsdp_comms"  # on every hooked FSDP module: its ModuleComms


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
    stats: CommStats = field(repr=False)  # the model's counters, shared by its modules
    gradients: dict = field(default_factory=dict, repr=False)  # reduce-scatter numel -> GradReduceScatter
    gather_input_numel: int = 0
    grad_numel: int = 0  # reduce-scatter numel when every trainable parameter has a gradient
    replicate: Topology | None = field(default=None, repr=False)  # HSDP: the replicate group
    replicas: dict = field(default_factory=dict, repr=False)  # all-reduce numel -> GradAllReduce
    _saved: tuple = field(default=(), repr=False)  # FSDP's own comms, restored by remove()
    _versions: tuple | None = field(default=None, repr=False)
    _warned: bool = field(default=False, repr=False)

    def gradient_comm(self, numel: int) -> GradReduceScatter:
        rs = self.gradients.get(numel)
        if rs is None:
            rs = GradReduceScatter(
                numel,
                self.topology,
                self.config.gradients,
                device=self.param_group.device,
                stats=self.config.stats,
                record_to=self.stats,
            )
            self.gradients[numel] = rs
        return rs

    def replicate_comm(self, numel: int) -> GradAllReduce:
        ar = self.replicas.get(numel)
        if ar is None:
            if self.replicate is None:
                raise RuntimeError(f"sdpq ({self.fqn or '<root>'}): no replicate group was given to apply()")
            ar = GradAllReduce(
                numel,
                self.replicate,
                self.config.gradients,
                device=self.param_group.device,
                stats=self.config.stats,
                record_to=self.stats,
            )
            self.replicas[numel] = ar
        return ar

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


# ----------------------------------------------------------------------------- FSDP's comm hooks


class SdpqAllGather(AllGather):
    """FSDP's all-gather of one module's flat buffer, done by the module's WeightGather."""

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
                "subclasses with fsdp_pre_all_gather, e.g. fp8 all-gather, are not supported)"
            )
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
                    StaleWeightsWarning,
                    stacklevel=2,
                )
        wg.gather(input_tensor, out=output_tensor)
        return None  # synchronous: FSDP accepts None for the work handle


class SdpqReduceScatter(ReduceScatter):
    """FSDP's gradient reduce-scatter of one module, done by a GradReduceScatter per buffer size."""

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


class SdpqAllReduceHook:
    """FSDP's all-reduce hook of one module (1-D FSDP on the shard group of an HSDP layout): the
    reduce-scatter output, summed across the replicate group by a GradAllReduce per size. FSDP
    divides by the gradient divide factor afterwards (apply sets it to shard x replicate size)."""

    def __init__(self, comms: ModuleComms):
        self.comms = comms

    def __call__(self, reduce_output: torch.Tensor) -> None:
        if reduce_output.is_cuda:
            # Note: with 1-D FSDP, FSDP2 does not keep the reduce-scatter output alive for the
            # all-reduce stream this hook runs on (it does for native HSDP); the caching
            # allocator must not hand its block to the next reduce-scatter before we are done.
            reduce_output.record_stream(torch.cuda.current_stream())
        self.comms.replicate_comm(reduce_output.numel()).all_reduce(reduce_output)


# ----------------------------------------------------------------------------- per-model state


@dataclass(eq=False)
class Applied:
    """What apply() installed on a model: undone by remove(), read by the checkpoint functions."""

    config: Config
    comms: list  # ModuleComms, in model.named_modules() order
    hooks: list  # optimizer hook handles
    stats: CommStats  # this model's counters (sdpq.stats.of(model)); parent: the process-wide ones
    # Set by state_dict(model, checkpoint_id=...) when that checkpoint holds sdpq state of another
    # layout: the next load_state_dict rebuilds it instead of reading it.
    relayout_from: str | None = None


def applied(model: nn.Module) -> Applied:
    state = getattr(model, ROOT_ATTR, None)
    if state is None:
        raise RuntimeError("sdpq.fsdp: sdpq is not applied to this model (call sdpq.fsdp.apply first)")
    return state
