"""DistributedDataParallel training backend: `train(spec) -> RunResult` on an initialised process
group.

Builds the spec's model (same init on every rank; bf16 if spec.bf16), wraps it in DDP, registers
sdpq's comm hook per `spec.sdpq` (None = plain DDP, or with `comm_hook` one of torch's hooks:
"allreduce" (DDP's own averaging through a Python-level all-reduce), "fp16" (fp16_compress_hook),
"powersgd" (rank 4)), and trains with the spec's schedule: bf16 autocast on fp32 parameters
with `mixed_precision="bf16"`, `no_sync()` on all but the last micro-step, gradient clipping,
torch's AdamW or sdpq's (the sdpq block's optimizer section). Checkpoints: one file per rank of
model and optimizer, saved all or none across ranks, and sdpq's state by `sdpq.ddp`'s own
checkpoint; a resumed run continues the uninterrupted one's trajectory.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..comm import stats as comm_stats
from ..comm import timing
from ..integrations import ddp as sdpq_ddp
from ..integrations import save_on_every_rank
from ..launch.env import compute_device
from .data import TokenData
from .fsdp_backend import build_optimizer, sdpq_config
from .model import model_from_config
from .run import (
    TORCH_COLLECTIVES,
    RunResult,
    RunSpec,
    digest,
    gather_comm,
    lr_at,
    median_step_seconds,
    memory_tracking,
    optimizer_bytes_per_param,
    step_timing,
    validation_loss,
)
from .settings import with_ranks_per_node

__all__ = ["train", "COMM_HOOKS"]

COMM_HOOKS = ("allreduce", "fp16", "powersgd")


def _one_bucket_at_a_time(state, bucket) -> torch.futures.Future:
    """torch's PowerSGD hook, each bucket finished before DDP hands over the next.

    Note: PowerSGD issues a bucket's second all-reduce (Q) from the first one's completion
    callback, on gloo's thread, while the autograd thread may already issue the next bucket's
    first (P): ranks can then issue them in different orders, and gloo fails with "Received data
    size doesn't match expected size" (seen with two buckets, after a few hundred steps)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    fut = powerSGD_hook.powerSGD_hook(state, bucket)
    fut.wait()
    return fut


_one_bucket_at_a_time.__annotations__["return"] = torch.futures.Future[torch.Tensor]


def _register_torch_hook(model: DistributedDataParallel, name: str) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "allreduce":
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    elif name == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2)
        model.register_comm_hook(state, _one_bucket_at_a_time)
    else:
        raise ValueError(f"comm_hook {name!r}; allowed: {', '.join(COMM_HOOKS)}")


def _autocast(spec: RunSpec, device: torch.device):
    if spec.mixed_precision == "bf16" and not spec.bf16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _step(model, opt, data: TokenData, spec: RunSpec, step: int, rank: int, device: torch.device) -> torch.Tensor:
    for g in opt.param_groups:
        g["lr"] = lr_at(spec, step)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for micro in range(spec.grad_accum):
        last = micro == spec.grad_accum - 1
        x, y = data.batch(
            step * spec.grad_accum + micro, rank, spec.micro_batch, spec.model.seq_len, seed=spec.seed, device=device
        )
        with timing.span("train.fwd_bwd"), contextlib.nullcontext() if last else model.no_sync():
            with _autocast(spec, device):
                loss = model(x, y) / spec.grad_accum
            loss.backward()
        total += loss.detach().float()
    with timing.span("train.optim"):
        if spec.grad_clip and spec.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    dist.all_reduce(total)
    return total


def _checkpoint_path(spec: RunSpec, rank: int) -> Path:
    if not spec.checkpoint_dir:
        raise ValueError("RunSpec.save_at / resume need checkpoint_dir")
    return Path(spec.checkpoint_dir) / f"ddp_rank{rank}.pt"


def save_checkpoint(spec: RunSpec, model, opt, step: int, rank: int) -> None:
    """Every rank's own file of model and optimizer (the replicas are equal, but sdpq AdamW's
    compressed states are per rank), then sdpq's state through `sdpq.ddp.save_checkpoint`. Both
    are saved all or none (`sdpq.integrations.save_on_every_rank`): a rank that cannot write leaves every rank's
    previous files as they were and raises the same CheckpointSaveError on every rank."""
    state: dict[str, Any] = {"model": model.module.state_dict(), "optim": opt.state_dict(), "step": step}
    path = _checkpoint_path(spec, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_on_every_rank(state, path, "ddp_backend.save_checkpoint")
    if sdpq_ddp.is_applied(model):
        sdpq_ddp.save_checkpoint(model, path.parent)


def _resume(spec: RunSpec, model, opt, rank: int) -> int:
    if not spec.resume:
        return 0
    path = _checkpoint_path(spec, rank)
    state = torch.load(path, weights_only=False)
    model.module.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    if sdpq_ddp.is_applied(model):
        sdpq_ddp.load_checkpoint(model, path.parent)  # agreed across ranks; rebuilds on a bad file
    return int(state["step"])


def _build(spec: RunSpec, device: torch.device, comm_hook: str | None):
    """(the DDP model, its optimizer, the optimizer's name, the sdpq Config or None): the spec's
    model on every rank alike, wrapped, with sdpq's hook or torch's `comm_hook` registered."""
    torch.manual_seed(spec.seed)
    module: nn.Module = model_from_config(spec.model).to(device)
    if spec.bf16:
        module = module.to(torch.bfloat16)
    model = DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)
    cfg = sdpq_config(spec)
    opt, opt_name = build_optimizer(spec, model, cfg)
    if cfg is not None:
        sdpq_ddp.apply(model, cfg)
    elif comm_hook is not None:
        _register_torch_hook(model, comm_hook)
    return model, opt, opt_name, cfg


def train(
    spec: RunSpec, *, checks: bool = False, data: TokenData | None = None, comm_hook: str | None = None
) -> RunResult:
    """Run `spec` with DDP on the initialised default process group (every rank calls it).
    checks: record in `extra` a digest of every parameter after every step (replicas compared
    bitwise in tests). comm_hook: one of torch's hooks for a run without an sdpq block."""
    if spec.backend != "ddp":
        raise ValueError(f"ddp_backend.train: spec.backend is {spec.backend!r}")
    if not dist.is_initialized():
        raise RuntimeError("ddp_backend.train needs an initialised torch.distributed process group")
    if comm_hook is not None and spec.sdpq is not None:
        raise ValueError("ddp_backend.train: comm_hook is for runs without an sdpq block")
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = with_ranks_per_node(spec, world)
    device = compute_device()
    data = data or (TokenData.from_path(spec.data) if spec.data else TokenData.stdlib())
    model, opt, opt_name, cfg = _build(spec, device, comm_hook)
    comm_stats.reset()
    start = _resume(spec, model, opt, rank)
    losses = torch.full((spec.steps,), float("nan"), dtype=torch.float32, device=device)
    times, digests = [], []
    with (
        step_timing(spec, [(dist, TORCH_COLLECTIVES, False)]),
        memory_tracking(spec, model, opt, spec.steps - start) as memory,
    ):
        for step in range(start, spec.steps):
            t0 = time.perf_counter()
            with timing.span("train.step"):
                losses[step] = _step(model, opt, data, spec, step, rank, device) / world
            times.append(time.perf_counter() - t0)
            if checks:
                digests.append(digest(torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])))
            if spec.log_every and rank == 0 and (step + 1) % spec.log_every == 0:
                print(f"step {step + 1:5d}  loss {float(losses[step]):.4f}  {times[-1]:.3f}s", flush=True)
            if spec.save_at is not None and step + 1 == spec.save_at:
                save_checkpoint(spec, model, opt, step + 1, rank)
    comm, inter = gather_comm(world)
    val = validation_loss(model.module, data, spec, rank, world, device)
    extra: dict[str, Any] = {
        "optimizer": opt_name,
        "comm_hook": "sdpq" if cfg is not None else (comm_hook or "DDP's own"),
        "first_step": start + 1,
        "step_times": times,
    }
    if checks:
        extra["param_digests"] = digests
    if memory is not None:
        extra["memory"] = memory
    counted = cfg is not None and cfg.stats.enabled
    return RunResult(
        losses=losses.tolist(),
        val_loss=val,
        step_seconds=median_step_seconds(times),
        comm=comm,
        cross_node_bytes_per_step=inter / max(1, spec.steps - start) if counted else "not counted",
        optimizer_bytes_per_param=optimizer_bytes_per_param(opt, model, device),
        extra=extra,
    )
