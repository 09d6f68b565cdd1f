"""sdpq for `DistributedDataParallel`: one call registers a comm hook that all-reduces every
gradient bucket with sdpq's quantized all-reduce.

    model = DistributedDataParallel(model)
    sdpq.ddp.apply(model, sdpq.Config())          # after wrapping, before the first backward

Per bucket, a `sdpq.comm.GradAllReduce` over the DDP group: a two-level reduce-scatter (8-bit
inside the node, `gradients.inter_bits` across nodes, Hadamard-smoothed, groups and blocks
inside one parameter, optional error feedback), then an all-gather of the reduced chunks that
every rank decodes alike. The sum is divided by the group size in fp32 and rounded once to the
bucket's dtype.

Note (invariants):
- DDP never re-broadcasts parameters, so the replicas stay equal only if their gradients are:
  every rank decodes the same bytes with the same arithmetic (bitwise the same average).
- DDP rebuilds its buckets after the first iteration (in the order gradients became ready);
  buckets are all-reduced exactly until then, and each bucket's collective is built at its first
  quantized use (a collective that checks every rank agrees on the bucket), keyed by the
  bucket's index, size and parameter layout, so a bucket that changes gets a new one.
- `no_sync()` skips the hook: gradients accumulate locally and the next synchronising
  backward all-reduces the sum, once.
- CUDA: the all-reduce runs on a side stream that waits for the gradients, and the returned
  future is completed there. The host waits only once per bucket, when its collective is built
  (the agreement check reads its result), at the bucket's first quantized use.

Checkpoints (_ddp_checkpoint.py): `save_checkpoint(model, directory)` / `load_checkpoint(model,
directory)` write and read one file per rank, every rank's or none, and agree across ranks before
acting on what a rank read; `state_dict` / `load_state_dict` carry the same state as a dict. Each
bucket's residual and rounding stream and the iteration count are saved. DDP's first buckets
after a restart are laid out in its initial order; a bucket that holds the parameters of a saved
one is all-reduced in the saved order, so a resumed run continues bitwise where DDP buckets the
same parameters as before (the usual case); a bucket of other parameters is all-reduced exactly
in that first iteration, until DDP has rebuilt its buckets.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from .._memprobe import hook_span
from ..comm import CommStats, GradAllReduce, Topology, TopologyError
from ..comm.allreduce import exact_all_reduce
from ..comm.hotpath import host_read, hot_path
from ..comm.segments import Segment
from ..comm.stats import Recorder, process_stats, register_holder
from ..config import Config
from ._config_arg import as_config
from ._ddp_checkpoint import (  # re-exported as sdpq.ddp.*
    CheckpointLoadError,
    CheckpointSaveError,
    load_checkpoint,
    load_state_dict,
    save_checkpoint,
    state_dict,
)

__all__ = [
    "apply",
    "remove",
    "is_applied",
    "save_checkpoint",
    "load_checkpoint",
    "state_dict",
    "load_state_dict",
    "CheckpointLoadError",
    "CheckpointSaveError",
    "DDPState",
    "EXACT_ITERATIONS",
]

ATTR = "_sdpq_ddp"
# Iterations all-reduced exactly: DDP's first buckets are rebuilt after the first iteration.
EXACT_ITERATIONS = 1


@dataclasses.dataclass(eq=False)
class DDPState:
    """The hook's state on one DDP model (`model._sdpq_ddp`)."""

    config: Config
    topology: Topology
    stats: CommStats
    iteration: int = 0  # synchronising backward passes done (the last bucket closes one)
    param_index: dict = dataclasses.field(default_factory=dict)  # id(parameter) -> its position in the module
    reducers: dict = dataclasses.field(default_factory=dict)  # bucket key -> GradAllReduce
    layouts: dict = dataclasses.field(default_factory=dict)  # bucket key -> its _Layout
    stream: Any = None  # CUDA: the side stream the all-reduces run on
    recorder: Any = None  # the exact iterations' byte counts (into `stats`)
    exact_until: int = EXACT_ITERATIONS  # unknown buckets are all-reduced exactly before this iteration
    removed: bool = False  # remove() was called: the hook (DDP keeps it) all-reduces exactly

    def reducer(self, layout: _Layout, device) -> GradAllReduce:
        ar = self.reducers.get(layout.key)
        if ar is None:
            # Note: a collective whose agreement check reads its result on the host: once per
            # bucket, at its first quantized use (every rank agrees on the bucket or all fail).
            with host_read():
                ar = GradAllReduce(
                    layout.key[1], self.topology, self.config.gradients, device=device, stats=self.config.stats,
                    record_to=self.stats, segments=layout.segments,
                )  # fmt: skip
            self.reducers[layout.key], self.layouts[layout.key] = ar, layout
        return ar

    def same_parameters(self, layout: _Layout) -> _Layout | None:
        """A known bucket of the same parameters laid out otherwise (DDP's first buckets after a
        resume, before it rebuilds them in the saved order)."""
        if layout.segments is None:
            return None
        want = sorted(zip(layout.params, (s.length for s in layout.segments)))
        for known in self.layouts.values():
            if known.segments is not None and known.key[1:3] == layout.key[1:3]:
                if sorted(zip(known.params, (s.length for s in known.segments))) == want:
                    return known
        return None

    def held_tensors(self):
        """(kind, tensor) of everything sdpq keeps between steps (sdpq.memory)."""
        for ar in self.reducers.values():
            yield from ar.held_tensors()


class _Layout(NamedTuple):
    key: tuple  # (bucket index, numel, dtype, digest of the segments)
    segments: list[Segment] | None  # where each gradient lies in the flat buffer (None: not views of it)
    params: tuple[int, ...]  # the parameters, by position in the module, in segment order


def _bucket_layout(state: DDPState, bucket) -> _Layout:
    buf = bucket.buffer()
    base, item = buf.data_ptr(), buf.element_size()
    segments: list[Segment] | None = []
    for g, p in zip(bucket.gradients(), bucket.parameters()):
        start = (g.data_ptr() - base) // item
        if segments is None or not (0 <= start and start + g.numel() <= buf.numel()):
            segments = None
            continue
        segments.append(Segment(start, g.numel(), p.shape[-1] if p.dim() >= 2 else 0))
    params = tuple(state.param_index.get(id(p), -1) for p in bucket.parameters())
    digest = hashlib.sha256(repr((segments, params)).encode()).hexdigest()[:16]
    return _Layout((bucket.index(), buf.numel(), str(buf.dtype), digest), segments, params)


def _hook(state: DDPState, bucket) -> torch.futures.Future:
    buf = bucket.buffer()
    with hot_path("DDP comm hook"), hook_span("ddp.all_reduce", buf.device):
        if buf.is_cuda:
            fut = _on_side_stream(state, bucket, buf)
        else:
            _all_reduce(state, bucket, buf)
            fut = torch.futures.Future()
            fut.set_result(buf)
    if bucket.is_last():
        state.iteration += 1
    return fut


# Note: DDP checks the hook's return annotation against the real type; with postponed annotations
# it would read a string.
_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]


def _all_reduce(state: DDPState, bucket, buf: torch.Tensor) -> None:
    N = state.topology.world_size
    if state.removed:
        _exact(state, buf)
        return
    layout = _bucket_layout(state, bucket)
    known = None if layout.key in state.reducers else state.same_parameters(layout)
    if known is None:
        if layout.key in state.reducers or state.iteration >= state.exact_until:
            state.reducer(layout, buf.device).all_reduce(buf, divide_by=N)
        else:
            _exact(state, buf)
        return
    # The parameters of a known bucket in another order: all-reduced in the known order.
    assert known.segments is not None and layout.segments is not None  # same_parameters checks both
    moved = torch.zeros_like(buf)
    theirs = dict(zip(known.params, known.segments))
    for p, s in zip(layout.params, layout.segments):
        moved[theirs[p].start : theirs[p].start + s.length] = buf[s.start : s.start + s.length]
    state.reducers[known.key].all_reduce(moved, divide_by=N)
    for p, s in zip(layout.params, layout.segments):
        buf[s.start : s.start + s.length] = moved[theirs[p].start : theirs[p].start + s.length]


def _exact(state: DDPState, buf: torch.Tensor) -> None:
    """The first buckets (DDP rebuilds them): a plain SUM all-reduce, divided in fp32."""
    exact_all_reduce(buf, state.topology, state.recorder, divide_by=state.topology.world_size)


def _on_side_stream(state: DDPState, bucket, buf: torch.Tensor) -> torch.futures.Future:
    if state.stream is None:
        state.stream = torch.cuda.Stream(device=buf.device)
    side = state.stream
    side.wait_stream(torch.cuda.current_stream(buf.device))
    with torch.cuda.stream(side):
        buf.record_stream(side)  # the bucket must outlive the work queued on this stream
        _all_reduce(state, bucket, buf)
        fut: torch.futures.Future = torch.futures.Future(devices=[buf.device])
        fut.set_result(buf)  # completes on `side`: DDP's consumers wait for it on the device
    return fut


# ----------------------------------------------------------------------------- public API


def apply(model: nn.Module, config: Config | Mapping[str, Any] | None = None) -> DDPState:
    """Register sdpq's quantized all-reduce as `model`'s comm hook (a DistributedDataParallel
    module; collective: call it on every rank alike, before the first backward). The weights
    path and the optimizer are not involved (DDP gathers no weights): use `sdpq.optim.AdamW`
    on the module's parameters for compressed optimizer states. Returns the hook's state.

    Errors: TypeError for anything but a DDP module; RuntimeError if sdpq is already applied or
    torch.distributed is not initialised; sdpq.comm.TopologyError if config.topology does not fit
    the DDP group."""
    from torch.nn.parallel import DistributedDataParallel

    cfg = as_config(config, "sdpq.ddp.apply")
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(
            f"sdpq.ddp.apply: expected a torch.nn.parallel.DistributedDataParallel, got {type(model).__name__} "
            "(wrap the model first: DistributedDataParallel(model))"
        )
    if hasattr(model, ATTR):
        raise RuntimeError(
            "sdpq.ddp.apply: sdpq was applied to this DDP module already (remove() cannot unregister DDP's "
            "comm hook); wrap the model in a new DistributedDataParallel to apply it again"
        )
    if not dist.is_initialized():
        raise RuntimeError("sdpq.ddp.apply: torch.distributed is not initialised")
    world = Topology.build(cfg.topology)
    group = model.process_group
    if dist.get_process_group_ranks(group) != dist.get_process_group_ranks(world.world_group):
        topo = Topology.for_group(group, world)
    else:
        topo = world
    if topo.world_size != dist.get_world_size(group):
        raise TopologyError(f"sdpq.ddp.apply: the DDP group has {dist.get_world_size(group)} ranks")
    stats = CommStats(config=cfg.stats, parent=process_stats())
    state = DDPState(cfg, topo, stats, recorder=Recorder(cfg.stats, stats))
    state.param_index = {id(p): i for i, p in enumerate(model.module.parameters())}
    model.register_comm_hook(state, _hook)
    setattr(model, ATTR, state)
    return state


def is_applied(model: nn.Module) -> bool:
    """Whether sdpq.ddp.apply installed sdpq's hook on `model` (and remove() has not stopped it)."""
    state = getattr(model, ATTR, None)
    return isinstance(state, DDPState) and not state.removed


def remove(model: nn.Module) -> None:
    """Stop quantizing: DDP cannot unregister a comm hook, so sdpq's stays and all-reduces
    exactly (SUM, divided in fp32) from now on. Build a new DDP module for DDP's own all-reduce
    or to apply sdpq again."""
    _state_of(model).removed = True


def held_tensors(model: nn.Module):
    """(kind, tensor) of everything sdpq keeps for `model` between steps (sdpq.memory)."""
    return _state_of(model).held_tensors()


def _state_of(model: nn.Module) -> DDPState:
    state = getattr(model, ATTR, None)
    if not isinstance(state, DDPState):
        raise RuntimeError("sdpq.ddp: sdpq is not applied to this model (call sdpq.ddp.apply first)")
    return state


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _model_stats(model: object) -> CommStats | None:
    state = getattr(model, ATTR, None)
    return state.stats if isinstance(state, DDPState) else None


register_holder(_model_stats)
