"""FSDP2 training backend: `train(spec) -> RunResult` on an initialised process group.

Builds the spec's model (same init on every rank), `fully_shard`s every block and the root, applies
sdpq per `spec.sdpq` (None = plain FSDP2), trains with the spec's schedule (linear warm-up,
cosine decay, AdamW, gradient clipping, gradient accumulation with
`set_requires_gradient_sync(False)` on all but the last micro-step), saves / resumes a
torch.distributed.checkpoint (model, optimizer, sdpq state) and reports losses, communication
statistics and optimizer memory.

Batches are a pure function of (seed, micro-step, rank), so a resumed run sees exactly the
tokens of the uninterrupted one. They, the loss accumulators and every tensor the loop
all-reduces live on the compute device (the mesh's, else sdpq.launch.env.compute_device); the host
reads a loss only where one is printed, and the whole curve once at the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from ..comm import stats as comm_stats
from ..comm import timing
from ..config import Config
from ..integrations import fsdp as sdpq_fsdp
from ..launch.env import compute_device
from ..optim.layout import local
from .data import TokenData
from .model import GPT, Llama, model_from_config
from .run import (
    TORCH_COLLECTIVES,
    RunResult,
    RunSpec,
    digest,
    gather_comm,
    gather_step_timing,
    lr_at,
    median_step_seconds,
    memory_tracking,
    optimizer_bytes_per_param,
    step_timing,
    validation_loss,
)
from .settings import EXACT, layout, with_ranks_per_node

__all__ = ["train", "build_model", "build_optimizer", "save_checkpoint", "load_checkpoint", "mp_policy_for"]


def mp_policy_for(spec: RunSpec) -> MixedPrecisionPolicy | None:
    """FSDP2's policy for spec.mixed_precision: "bf16" = bf16 parameters in forward/backward and
    in the all-gather, fp32 gradient reduce-scatter (set explicitly: FSDP2's default reduce dtype
    with param_dtype=bf16 is bf16). On bf16 parameters (spec.bf16) only the fp32 reduce applies."""
    if spec.mixed_precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def sdpq_config(spec: RunSpec) -> Config | None:
    """The spec's sdpq block as a Config; spec.ranks_per_node fills topology.ranks_per_node
    when the block leaves it on "auto". Without a block: sdpq's exact collectives (bitwise plain
    FSDP2) when spec.count_bytes is "exact", so that the run counts its cross-node bytes."""
    block = spec.sdpq if spec.sdpq is not None else (EXACT if spec.count_bytes == "exact" else None)
    if block is None:
        return None
    cfg = Config.from_dict(block)
    if cfg.topology.ranks_per_node == "auto" and spec.ranks_per_node != "auto":
        cfg = cfg.replace(topology={"ranks_per_node": spec.ranks_per_node})
    return cfg


def build_model(
    spec: RunSpec,
    *,
    mesh=None,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    freeze: Iterable[str] = (),
    per_block: Callable[[nn.Module], nn.Module] | None = None,
) -> GPT | Llama:
    """spec.model's model, identical on every rank (seeded), bf16 if spec.bf16, parameters named
    with a prefix in `freeze` frozen, sharded per block and at the root. per_block(block) runs on
    each block before it is sharded and returns what replaces it (activation checkpointing, then
    torch.compile, in a torchtitan-style order)."""
    torch.manual_seed(spec.seed)
    model = model_from_config(spec.model)
    if spec.bf16:
        model = model.to(torch.bfloat16)
    freeze = tuple(freeze)
    for name, p in model.named_parameters():
        if freeze and name.startswith(freeze):
            p.requires_grad_(False)
    kw: dict[str, Any] = {"reshard_after_forward": reshard_after_forward}
    if mesh is not None:
        kw["mesh"] = mesh
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    if per_block is not None:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = per_block(block)
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def build_optimizer(spec: RunSpec, model, cfg: Config | None) -> tuple[torch.optim.Optimizer, str]:
    """sdpq.optim.AdamW when the sdpq block enables it, else torch.optim.AdamW; (optimizer, name)."""
    params = [p for p in model.parameters() if p.requires_grad]
    kw: dict[str, Any] = dict(lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)
    if cfg is not None and cfg.optimizer.enabled:
        from ..optim import AdamW  # the optimizer layer (fp8/bf16/fp32 states, MCF/native master)

        o = cfg.optimizer
        return AdamW.from_config(params, o, **kw), f"sdpq.optim.AdamW(states={o.states}, master={o.master})"
    return torch.optim.AdamW(params, **kw), "torch.optim.AdamW"


# ----------------------------------------------------------------------------- checkpoints


def _states(model, opt, checkpoint_id: str | None = None) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    sd: dict[str, Any] = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    if sdpq_fsdp.is_applied(model):
        sd["sdpq"] = sdpq_fsdp.state_dict(model, checkpoint_id=checkpoint_id)
    return sd


def save_checkpoint(path: str, model, opt, step: int) -> None:
    """DCP checkpoint of model, optimizer and sdpq state (weight references, residuals, RNG)."""
    import torch.distributed.checkpoint as dcp

    sd = _states(model, opt)
    sd["progress"] = {"step": torch.tensor(step, dtype=torch.int64)}
    dcp.save(sd, checkpoint_id=path)


def load_checkpoint(path: str, model, opt) -> int:
    """Load what save_checkpoint wrote; returns the step it was saved after."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    sd = _states(model, opt, checkpoint_id=path)  # templates (right shapes and placements)
    sd["progress"] = {"step": torch.tensor(-1, dtype=torch.int64)}
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    if "sdpq" in sd:
        sdpq_fsdp.load_state_dict(model, sd["sdpq"])  # marks the weights changed (quantized diff)
    return int(sd["progress"]["step"])


# ----------------------------------------------------------------------------- statistics


# ----------------------------------------------------------------------------- training


def _forward_digests(model, record: list) -> list:
    """Forward pre-hooks (run after FSDP's unshard) that record a digest of every FSDP module's
    unsharded parameters: what this rank's forward computes with."""
    handles = []
    for name, m in model.named_modules():
        if not isinstance(m, FSDPModule):
            continue

        @torch.compiler.disable  # a check, not part of the model: eager even in a compiled block
        def hook(mod, args, name=name):
            own = [p for p in mod.parameters() if not hasattr(p, "to_local")]  # unsharded = plain tensors
            record.append((name, digest(torch.cat([p.detach().reshape(-1).float() for p in own]))))

        handles.append(cast(nn.Module, m).register_forward_pre_hook(hook))  # every FSDPModule is a Module
    return handles


def _resume(spec: RunSpec, model, opt) -> int:
    """The first step to run: 0, or the step of spec.checkpoint_dir when spec.resume."""
    if not spec.resume:
        return 0
    if not spec.checkpoint_dir:
        raise ValueError("RunSpec.resume needs checkpoint_dir")
    return load_checkpoint(spec.checkpoint_dir, model, opt)


def _step(
    model, opt, data: TokenData, spec: RunSpec, step: int, lr: float, rank: int, device: torch.device
) -> torch.Tensor:
    """One optimizer step (all micro-batches, clipping, the step); the loss summed over ranks, a
    0-d tensor on `device` (read back only where it is printed: no host sync per step)."""
    for g in opt.param_groups:
        g["lr"] = lr
    total = torch.zeros((), dtype=torch.float32, device=device)
    for micro in range(spec.grad_accum):
        last = micro == spec.grad_accum - 1
        if spec.accumulation == "defer_all_reduce":
            model.set_requires_gradient_sync(True)
            model.set_requires_all_reduce(last)
        else:
            model.set_requires_gradient_sync(last)
        i = step * spec.grad_accum + micro
        x, y = data.batch(i, rank, spec.micro_batch, spec.model.seq_len, seed=spec.seed, device=device)
        with timing.span("train.fwd_bwd"):
            loss = model(x, y) / spec.grad_accum
            loss.backward()
        total += loss.detach().float()
    with timing.span("train.optim"):  # gradient clipping (its norm all-reduce too) + step
        if spec.grad_clip and spec.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], spec.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    dist.all_reduce(total)
    return total


def _check_records(model, cfg: Config | None, forward_digests: list) -> dict[str, Any]:
    """What `checks` records: the weights every forward used, the final shards, the references."""
    out: dict[str, Any] = {
        "forward_digests": forward_digests,
        "param_digests": {n: digest(local(p)) for n, p in model.named_parameters()},
    }
    if cfg is not None and cfg.weights.mode == "diff":
        out["references"] = {
            name: (c.topology.local_rank, None if c.weights.reference is None else digest(c.weights.reference))
            for name, c in sdpq_fsdp.module_comms(model).items()
        }
    return out


class _Steps(NamedTuple):
    losses: list[float]  # per step (NaN before a resumed run's first step)
    times: list[float]  # seconds per step run
    spans: list  # per step: {label: [inclusive s, self s, calls]} (spec.timing)
    forward_digests: list  # per step: (module, digest) of the weights every forward used (checks)


def _run_steps(spec: RunSpec, model, opt, data: TokenData, start: int, checks: bool, device: torch.device) -> _Steps:
    """Steps start .. spec.steps - 1: the losses (mean over ranks), times, timing spans and (with
    checks) the forward weights' digests; logs and saves the checkpoint as the spec says."""
    rank, world = dist.get_rank(), dist.get_world_size()
    forward_digests: list = []
    handles = _forward_digests(model, forward_digests) if checks else []
    out = _Steps([float("nan")] * spec.steps, [], [], [])
    # Note: the per-step losses stay on the device until the end (one read for the whole curve).
    losses = torch.full((spec.steps,), float("nan"), dtype=torch.float32, device=device)
    with step_timing(spec, [(dist, TORCH_COLLECTIVES, False)]):
        for step in range(start, spec.steps):
            t0 = time.perf_counter()
            lr = lr_at(spec, step)
            with timing.span("train.step"):
                losses[step] = _step(model, opt, data, spec, step, lr, rank, device) / world
            out.times.append(time.perf_counter() - t0)
            if spec.timing:
                out.spans.append(timing.take())
            if checks:
                out.forward_digests.append(list(forward_digests))
                forward_digests.clear()
            if spec.log_every and rank == 0 and (step + 1) % spec.log_every == 0:
                loss = float(losses[step])
                print(f"step {step + 1:5d}  loss {loss:.4f}  lr {lr:.2e}  {out.times[-1]:.3f}s", flush=True)
            if spec.save_at is not None and step + 1 == spec.save_at:
                if not spec.checkpoint_dir:
                    raise ValueError("RunSpec.save_at needs checkpoint_dir")
                save_checkpoint(spec.checkpoint_dir, model, opt, step + 1)
    for h in handles:
        h.remove()
    out.losses[:] = losses.tolist()
    return out


def _counter(spec: RunSpec, model, cfg: Config | None) -> str | None:
    """How the run's cross-node bytes are counted (None: not counted)."""
    if cfg is None or not cfg.stats.enabled:
        return None
    if spec.sdpq is None:
        return "sdpq.stats of sdpq's exact collectives (bitwise FSDP2's own)"
    return "sdpq.stats"


def _layout(spec: RunSpec, model, world: int) -> str:
    comms = sdpq_fsdp.module_comms(model) if sdpq_fsdp.is_applied(model) else {}
    for c in comms.values():
        return c.topology.layout
    return layout(world, int(spec.ranks_per_node))


def _result(
    spec, model, opt, opt_name, cfg, mp_policy, steps: _Steps, val: float, start: int, checks: bool, device
) -> RunResult:
    """The RunResult of a run: losses, comm statistics of every rank, and what `extra` records."""
    world = dist.get_world_size()
    comm, inter = gather_comm(world)
    counter = _counter(spec, model, cfg)
    extra: dict[str, Any] = {
        "optimizer": opt_name,
        "first_step": start + 1,
        "world_size": world,
        "params": sum(p.numel() for p in model.parameters()),
        "layout": _layout(spec, model, world),
        "cross_node_counter": counter or "not counted",
        "sdpq": None if cfg is None or spec.sdpq is None else cfg.to_dict(),
        "skipped_steps": getattr(opt, "skipped_steps", 0),
        "mp_policy": None if mp_policy is None else {k: str(v) for k, v in vars(mp_policy).items()},
    }
    if spec.timing:
        extra["timing"] = gather_step_timing(steps.spans, world)
    if checks:
        extra.update(_check_records(model, cfg, steps.forward_digests))
    return RunResult(
        losses=steps.losses,
        val_loss=val,
        step_seconds=median_step_seconds(steps.times),
        comm=comm,
        cross_node_bytes_per_step=inter / max(1, spec.steps - start) if counter else "not counted",
        optimizer_bytes_per_param=optimizer_bytes_per_param(opt, model, device),
        extra=extra,
    )


def _mesh_device(mesh) -> torch.device:
    """The device of a non-CPU DeviceMesh on this rank (e.g. cuda:LOCAL_RANK)."""
    module = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


def train(
    spec: RunSpec,
    *,
    mesh=None,
    replicate=None,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    freeze: Iterable[str] = (),
    checks: bool = False,
    data: TokenData | None = None,
    per_block: Callable[[nn.Module], nn.Module] | None = None,
) -> RunResult:
    """Run `spec` with FSDP2 on the initialised default process group (every rank calls it).

    mesh: a DeviceMesh for fully_shard (2-D = FSDP2's native HSDP); replicate: with a 1-D shard
    mesh, the replicate group sdpq all-reduces across (sdpq.fsdp.apply's HSDP); mp_policy: FSDP2
    mixed precision (default: the one spec.mixed_precision names, see mp_policy_for; giving both is
    an error);
    freeze: parameter-name prefixes to freeze; per_block: see build_model; checks: record in
    `extra` a digest of the weights every FSDP module's forward used (per step) and of every
    weight reference at the end.
    """
    if spec.backend != "fsdp2":
        raise ValueError(f"fsdp_backend.train: spec.backend is {spec.backend!r}")
    if not dist.is_initialized():
        raise RuntimeError("fsdp_backend.train needs an initialised torch.distributed process group")
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = with_ranks_per_node(spec, world)
    # The device batches and all-reduced accumulators live on: the mesh's, else the process group's.
    device = compute_device() if mesh is None or mesh.device_type == "cpu" else _mesh_device(mesh)
    data = data or (TokenData.from_path(spec.data) if spec.data else TokenData.stdlib())
    if mp_policy is not None and spec.mixed_precision is not None:
        raise ValueError("fsdp_backend.train: pass either mp_policy or spec.mixed_precision, not both")
    mp_policy = mp_policy or mp_policy_for(spec)
    cfg = sdpq_config(spec)
    model = build_model(
        spec,
        mesh=mesh,
        mp_policy=mp_policy,
        reshard_after_forward=reshard_after_forward,
        freeze=freeze,
        per_block=per_block,
    )
    opt, opt_name = build_optimizer(spec, model, cfg)
    comm_stats.reset()
    if cfg is not None:
        sdpq_fsdp.apply(model, cfg, optimizer=opt, replicate=replicate)
    if replicate is not None and spec.sdpq is None:
        raise ValueError("fsdp_backend.train: replicate needs an sdpq block (plain HSDP: a 2-D mesh)")
    start = _resume(spec, model, opt)
    with memory_tracking(spec, model, opt, spec.steps - start) as memory:
        steps = _run_steps(spec, model, opt, data, start, checks, device)
    val = validation_loss(model, data, spec, rank, world, device)

    result = _result(spec, model, opt, opt_name, cfg, mp_policy, steps, val, start, checks, device)
    if memory is not None:
        result.extra["memory"] = memory
    if cfg is not None:
        sdpq_fsdp.remove(model)
    return result
