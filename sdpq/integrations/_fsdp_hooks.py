"""The state sdpq.fsdp installs on an FSDP2 model and the comm hooks FSDP calls (see fsdp.py).

`ModuleComms` is sdpq's state for one FSDP module (its WeightGather, GradReduceScatter and, with
HSDP, GradAllReduce, all built by `apply` before training); `SdpqAllGather` / `SdpqReduceScatter`
implement FSDP2's custom-comm interfaces on top of it; `Applied` is what `apply` records on the
root model, found again with `applied(model)`.

Note (hot path): every hook runs inside `sdpq.comm.hotpath.hot_path` and never builds a collective
(a constructor's agreement check reads the device); see docs/fsdp.md for the CUDA stream each
hook runs and allocates on.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._memprobe import hook_span
from ..comm import CommStats, GradAllReduce, GradReduceScatter, Topology, TopologyError, WeightGather
from ..comm.hotpath import hot_path
from ..comm.segments import sharded_segments
from ..comm.stats import register_holder
from ..config import Config
from . import _fsdp_internals as fsdp_internals
from ._fsdp_internals import AllGather, ReduceScatter

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
    stats: CommStats = field(repr=False)  # this module's counters (their parent: the model's)
    gradients: dict = field(default_factory=dict, repr=False)  # {grad_numel: its GradReduceScatter}
    gather_input_numel: int = 0
    grad_numel: int = 0  # reduce-scatter numel when every trainable parameter has a gradient
    replicate: Topology | None = field(default=None, repr=False)  # HSDP: the replicate group
    replicas: dict = field(default_factory=dict, repr=False)  # HSDP: {all-reduce numel: GradAllReduce}
    _saved: tuple = field(default=(), repr=False)  # FSDP's own comms, restored by remove()
    _partial_residuals: dict = field(default_factory=dict, repr=False)  # see _residual_of
    _deferred: torch.Tensor | None = field(default=None, repr=False)  # HSDP: see defer_all_reduce
    _versions: tuple | None = field(default=None, repr=False)
    _warned: bool = field(default=False, repr=False)

    def build(self) -> None:
        """Build the gradient collectives (collective: every rank, in the same module order; apply
        calls it before training). Note: the hooks never build one: a constructor checks that
        every rank agrees on its settings, which reads a device value on the host."""
        if not self.grad_numel:
            return
        device = fsdp_internals.device(self.param_group)
        kw: dict[str, Any] = {"device": device, "stats": self.config.stats, "record_to": self.stats}
        # Where each trainable parameter's shard lies in a rank's chunk: groups and Hadamard
        # blocks are kept inside one parameter (and one row of it).
        shards = [
            (n, width)
            for (n, trainable), width in zip(
                fsdp_internals.shard_numels(self.param_group), fsdp_internals.shard_row_widths(self.param_group)
            )
            if trainable
        ]
        segments = sharded_segments(shards, self.topology.world_size)
        grads = self.config.gradients
        rs = GradReduceScatter(self.grad_numel, self.topology, grads, segments=segments, **kw)
        self.gradients[self.grad_numel] = rs
        if self.replicate is not None:  # the reduce-scatter output this rank all-reduces
            self.replicas[rs.chunk_numel] = GradAllReduce(
                rs.chunk_numel, self.replicate, grads, segments=segments[0], **kw
            )  # fmt: skip

    def reduce_scatter(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """FSDP's reduce-scatter input (N rows of this module's padded gradient shards) -> out."""
        rs = self.gradients.get(self.grad_numel)
        n = x.numel()
        if rs is None or n > rs.numel or n % self.topology.world_size:
            raise RuntimeError(
                f"sdpq ({self.fqn or '<root>'}): FSDP reduce-scatter of {n} elements; sdpq was set up for "
                f"{self.grad_numel} (parameters made trainable after sdpq.fsdp.apply? call remove() and "
                "apply() again)"
            )
        if n == rs.numel:
            rs.reduce_scatter(x, out=out)
            return
        # Some parameters got no gradient this step (FSDP leaves them out): each rank's row is
        # shorter. Zero-padded to the rows built in apply, the sums of the first columns are the
        # same (exact mode: bitwise); statistics then count the padding as elements.
        N, c = self.topology.world_size, n // self.topology.world_size
        rows = x.new_zeros((N, rs.chunk_numel))
        rows[:, :c] = x.view(N, c)
        chunk = out.new_empty(rs.chunk_numel)
        with self._residual_of(rs, n):
            rs.reduce_scatter(rows.view(-1), out=chunk)
        out.view(-1).copy_(chunk[:c])

    def defer_all_reduce(self, x: torch.Tensor) -> None:
        """HSDP, a micro-step the user does not all-reduce (`set_requires_all_reduce(False)`):
        keep the reduce-scatter output x for the micro-step that does, and hand FSDP zeros (it
        adds x to the sharded gradients after the hook: the sum must arrive once, all-reduced)."""
        if self._deferred is None:
            self._deferred = x.detach().float().clone()
        else:
            self._deferred.add_(x.detach().float())
        x.zero_()

    def all_reduce(self, x: torch.Tensor) -> None:
        """HSDP: the reduce-scatter output x (plus what deferred micro-steps kept), summed in
        place across the replicate group."""
        if self._deferred is not None:
            if self._deferred.numel() != x.numel():
                raise RuntimeError(
                    f"sdpq ({self.fqn or '<root>'}): a deferred all-reduce of {self._deferred.numel()} elements "
                    f"meets one of {x.numel()} (parameters without gradients in some micro-steps)"
                )
            x.copy_(self._deferred.add_(x.float()))  # Note: fp32 accumulation, one rounding to x's dtype
            self._deferred = None
        ar = next(iter(self.replicas.values()), None)
        n = x.numel()
        if ar is None or n > ar.numel:
            raise RuntimeError(f"sdpq ({self.fqn or '<root>'}): no replicate all-reduce of {n} elements was set up")
        if n == ar.numel:
            ar.all_reduce(x)
            return
        padded = x.new_zeros(ar.numel)  # fewer gradients this step, as in reduce_scatter
        padded[:n] = x.view(-1)
        with self._residual_of(ar.reduce_scatter, n):
            ar.all_reduce(padded)
        x.view(-1).copy_(padded[:n])

    @contextlib.contextmanager
    def _residual_of(self, rs: GradReduceScatter, numel: int) -> Iterator[None]:
        """Error feedback of a smaller bucket (see reduce_scatter): its own residual, whose
        positions mean other parameters than the full bucket's. Not saved in checkpoints."""
        if not rs.config.error_feedback:
            yield
            return
        key = (id(rs), numel)
        full, rs.residual = rs.residual, self._partial_residuals.get(key)
        try:
            yield
        finally:
            self._partial_residuals[key], rs.residual = rs.residual, full

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

    def held_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(kind, tensor) of everything sdpq keeps for this module between steps (sdpq.memory)."""
        yield from self.weights.held_tensors()
        for rs in self.gradients.values():
            yield from rs.held_tensors()
        for ar in self.replicas.values():
            yield from ar.held_tensors()
        for residual in self._partial_residuals.values():
            if residual is not None:
                yield "error_feedback", residual
        if self._deferred is not None:
            yield "sdpq_buffers", self._deferred

    def shard_versions(self) -> tuple:
        # Note: in-place updates of a sharded DTensor parameter (optimizer step, DCP
        # set_model_state_dict, mul_/copy_ by hand) bump the DTensor's own version counter (not its
        # local tensor's); edits through .data or the local tensor are not seen.
        return tuple(p._version for p in fsdp_internals.sharded_params(self.param_group))


# ----------------------------------------------------------------------------- FSDP's comm hooks


class SdpqAllGather(AllGather):
    """FSDP's all-gather of one module's flat buffer, done by the module's WeightGather."""

    def __init__(self, comms: ModuleComms):
        self.comms = comms

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        with hot_path("FSDP2 all-gather hook"), hook_span("fsdp2.all_gather", output_tensor.device):
            return self._gather(output_tensor, input_tensor, group)

    def _gather(self, output_tensor, input_tensor, group):
        c = self.comms
        c.check_group(group)
        if input_tensor.numel() != c.gather_input_numel or output_tensor.dtype == torch.uint8:
            raise RuntimeError(
                f"sdpq ({c.fqn or '<root>'}): FSDP all-gather input of {input_tensor.numel()} "
                f"{input_tensor.dtype} elements, expected {c.gather_input_numel} floats (tensor "
                "subclasses with fsdp_pre_all_gather, e.g. fp8 all-gather, are not supported)"
            )
        wg = c.weights
        if wg.holds_reference:
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
    """FSDP's gradient reduce-scatter of one module, done by its GradReduceScatter."""

    def __init__(self, comms: ModuleComms):
        self.comms = comms

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        with hot_path("FSDP2 reduce-scatter hook"), hook_span("fsdp2.reduce_scatter", output_tensor.device):
            return self._reduce_scatter(output_tensor, input_tensor, group, op)

    def _reduce_scatter(self, output_tensor, input_tensor, group, op):
        c = self.comms
        c.check_group(group)
        c.reduce_scatter(input_tensor, output_tensor)
        if op == dist.ReduceOp.AVG:  # only if someone turned force-sum off again
            output_tensor.div_(group.size())
        elif op != dist.ReduceOp.SUM:
            raise RuntimeError(f"sdpq ({c.fqn or '<root>'}): reduce op {op} is not supported (SUM/AVG only)")
        return None


class SdpqAllReduceHook:
    """FSDP's all-reduce hook of one module (1-D FSDP on the shard group of an HSDP layout): the
    reduce-scatter output, summed across the replicate group by the module's GradAllReduce. FSDP
    divides by the gradient divide factor afterwards (apply sets it to shard x replicate size)."""

    def __init__(self, comms: ModuleComms):
        self.comms = comms

    def __call__(self, reduce_output: torch.Tensor) -> None:
        with hot_path("FSDP2 all-reduce hook"), hook_span("fsdp2.all_reduce", reduce_output.device):
            self._all_reduce(reduce_output)

    def _all_reduce(self, reduce_output: torch.Tensor) -> None:
        if reduce_output.is_cuda:
            # Note: with 1-D FSDP, FSDP2 does not keep the reduce-scatter output alive for the
            # all-reduce stream this hook runs on (it does for FSDP2's mesh HSDP); the caching
            # allocator must not hand its block to the next reduce-scatter before we are done.
            reduce_output.record_stream(torch.cuda.current_stream())
        # Note: 1-D FSDP2 calls this hook after every reduce-scatter, whatever
        # set_requires_all_reduce says; sdpq reads it and all-reduces once per step.
        if fsdp_internals.all_reduce_wanted(self.comms.param_group):
            self.comms.all_reduce(reduce_output)
        else:
            self.comms.defer_all_reduce(reduce_output)


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


def _model_stats(model: object) -> CommStats | None:
    """sdpq.stats.of(model) for an FSDP2 model after sdpq.fsdp.apply (registered below)."""
    state = getattr(model, ROOT_ATTR, None)
    return state.stats if isinstance(state, Applied) else None


register_holder(_model_stats)


def applied(model: nn.Module) -> Applied:
    state = getattr(model, ROOT_ATTR, None)
    if state is None:
        raise RuntimeError("sdpq.fsdp: sdpq is not applied to this model (call sdpq.fsdp.apply first)")
    return state
