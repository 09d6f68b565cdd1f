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
  future is completed there; nothing waits on the host.

Checkpoints: `state_dict(model)` / `load_state_dict(model, state)` carry each bucket's residual
and rounding stream and the iteration count (per rank; save it next to the model's): a resumed
run quantizes from its first step where the bucket layout is the one saved, bitwise the run
that was not interrupted.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._memprobe import hook_span
from ..comm import CommStats, GradAllReduce, Topology, TopologyError
from ..comm.allreduce import exact_all_reduce
from ..comm.hotpath import hot_path
from ..comm.segments import Segment
from ..comm.stats import Recorder, process_stats, register_holder
from ..config import Config

__all__ = ["apply", "remove", "is_applied", "state_dict", "load_state_dict", "DDPState", "EXACT_ITERATIONS"]

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
    reducers: dict = dataclasses.field(default_factory=dict)  # bucket key -> GradAllReduce
    segments: dict = dataclasses.field(default_factory=dict)  # bucket key -> its parameters' segments
    stream: Any = None  # CUDA: the side stream the all-reduces run on
    recorder: Any = None  # the exact iterations' byte counts (into `stats`)

    def reducer(self, key: tuple, numel: int, segments, device) -> GradAllReduce:
        ar = self.reducers.get(key)
        if ar is None:  # Note: a collective (every rank agrees on the bucket); at the bucket's first use
            ar = GradAllReduce(
                numel, self.topology, self.config.gradients, device=device, stats=self.config.stats,
                record_to=self.stats, segments=segments,
            )  # fmt: skip
            self.reducers[key], self.segments[key] = ar, segments
        return ar

    def held_tensors(self):
        """(kind, tensor) of everything sdpq keeps between steps (sdpq.memory)."""
        for ar in self.reducers.values():
            yield from ar.held_tensors()


def _bucket_layout(bucket) -> tuple[tuple, list[Segment] | None]:
    """(key, segments): where each parameter's gradient lies in the bucket's flat buffer (None
    where the gradients are not views of it)."""
    buf = bucket.buffer()
    base, item = buf.data_ptr(), buf.element_size()
    segments = []
    for g, p in zip(bucket.gradients(), bucket.parameters()):
        start = (g.data_ptr() - base) // item
        if not (0 <= start and start + g.numel() <= buf.numel()):
            segments = None
            break
        segments.append(Segment(start, g.numel(), p.shape[-1] if p.dim() >= 2 else 0))
    digest = hashlib.sha256(repr(segments).encode()).hexdigest()[:16]
    return (bucket.index(), buf.numel(), str(buf.dtype), digest), segments


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
    key, segments = _bucket_layout(bucket)
    N = state.topology.world_size
    if state.iteration < EXACT_ITERATIONS and key not in state.reducers:
        _exact(state, buf)
        return
    state.reducer(key, buf.numel(), segments, buf.device).all_reduce(buf, divide_by=N)


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
        fut = torch.futures.Future(devices=[buf.device])
        fut.set_result(buf)  # completes on `side`: DDP's consumers wait for it on the device
    return fut


# ----------------------------------------------------------------------------- public API


def _as_config(config: Config | Mapping[str, Any] | None) -> Config:
    if config is None:
        return Config()
    if isinstance(config, Config):
        return config
    if isinstance(config, Mapping):
        return Config.from_dict(config)
    raise TypeError(f"sdpq.ddp.apply: config must be a sdpq.Config, a dict or None, got {type(config).__name__}")


def apply(model: nn.Module, config: Config | Mapping[str, Any] | None = None) -> DDPState:
    """Register sdpq's quantized all-reduce as `model`'s comm hook (a DistributedDataParallel
    module; collective: call it on every rank alike, before the first backward). The weights
    path and the optimizer are not involved (DDP gathers no weights): use `sdpq.optim.AdamW`
    on the module's parameters for compressed optimizer states. Returns the hook's state.

    Errors: TypeError for anything but a DDP module; RuntimeError if sdpq is already applied or
    torch.distributed is not initialised; sdpq.comm.TopologyError if config.topology does not fit
    the DDP group."""
    from torch.nn.parallel import DistributedDataParallel

    cfg = _as_config(config)
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(
            f"sdpq.ddp.apply: expected a torch.nn.parallel.DistributedDataParallel, got {type(model).__name__} "
            "(wrap the model first: DistributedDataParallel(model))"
        )
    if hasattr(model, ATTR):
        raise RuntimeError("sdpq.ddp.apply: sdpq is already applied to this model")
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
    model.register_comm_hook(state, _hook)
    setattr(model, ATTR, state)
    return state


def is_applied(model: nn.Module) -> bool:
    return isinstance(getattr(model, ATTR, None), DDPState)


def remove(model: nn.Module) -> None:
    """Forget sdpq's state. DDP cannot unregister a comm hook: build a new DDP module to train
    without sdpq."""
    delattr(model, ATTR)


def _state_of(model: nn.Module) -> DDPState:
    state = getattr(model, ATTR, None)
    if not isinstance(state, DDPState):
        raise RuntimeError("sdpq.ddp: sdpq is not applied to this model (call sdpq.ddp.apply first)")
    return state


def state_dict(model: nn.Module) -> dict:
    """This rank's sdpq state (per bucket: error-feedback residual, rounding stream, call count;
    the iteration count), for torch.save next to the model and optimizer."""
    state = _state_of(model)
    return {
        "iteration": state.iteration,
        "layout": state.topology.layout,
        "buckets": [
            (list(key), ar.numel, _segments_out(state.segments[key]), ar.state_dict())
            for key, ar in state.reducers.items()
        ],
    }


def load_state_dict(model: nn.Module, saved: Mapping[str, Any]) -> None:
    """Restore `state_dict`'s output (collective: builds each saved bucket's all-reduce)."""
    state = _state_of(model)
    if saved.get("layout") != state.topology.layout:
        raise ValueError(
            f"sdpq.ddp.load_state_dict: saved on layout {saved.get('layout')!r}, this run is {state.topology.layout!r}"
        )
    for key, numel, segments, s in saved["buckets"]:
        segs = None if segments is None else [Segment(*x) for x in segments]
        state.reducer(tuple(key), numel, segs, _device(model)).load_state_dict(s)
    state.iteration = int(saved["iteration"])


def _segments_out(segments: list[Segment] | None) -> list | None:
    return None if segments is None else [list(s) for s in segments]


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _model_stats(model: object) -> CommStats | None:
    state = getattr(model, ATTR, None)
    return state.stats if isinstance(state, DDPState) else None


register_holder(_model_stats)
