"""DeepSpeed training backend (ZeRO-3, or the stage the config names): `train(spec) -> RunResult`
on an initialised process group.

Builds the spec's model (same init on every rank) and trains it with `sdpq.deepspeed.initialize` on
`spec.deepspeed` (a --config file as written, with the flags' overrides: sdpq.train.settings) or,
without one, a DeepSpeed config built from the spec (ZeRO-3, AdamW, gradient clipping and
accumulation, bf16 if asked, `spec.sdpq` as the "sdpq" block). Without a block it is plain
DeepSpeed, or with spec.count_bytes "exact" sdpq's exact collectives (bitwise DeepSpeed's own)
so that the run counts its cross-node bytes (ZeRO-3; "meter" counts any stage, with or without a
block, at the process groups). Batches and the loss accumulators live on the
compute device (sdpq.launch.env.compute_device). Checkpoints are DeepSpeed's own `engine.save_checkpoint` /
`load_checkpoint` (which carry sdpq's per-rank state). Batches are a pure function of
(seed, micro-step, rank), so a resumed run sees exactly the tokens of the uninterrupted one.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from ..comm import stats as comm_stats
from ..comm import timing
from ..config import Config
from ..launch.env import compute_device
from .data import TokenData
from .model import model_from_config
from .run import (
    METER,
    TORCH_COLLECTIVES,
    RunResult,
    RunSpec,
    digest,
    gather_comm,
    gather_step_timing,
    link_meter,
    lr_at,
    median_step_seconds,
    memory_tracking,
    step_timing,
    validation_loss,
)
from .settings import EXACT, layout, with_ranks_per_node

__all__ = ["train", "ds_config", "run_config", "merge_config", "optimizer_bytes_per_param", "CKPT_TAG"]

CKPT_TAG = "step{step}"

# Collectives timed as "comm.other" with spec.timing: ZeRO-3 calls deepspeed.comm (handles of
# asynchronous ones are wrapped so that their wait() is timed too); torch.distributed below it
# only for what bypasses deepspeed.comm.
_DS_COLLECTIVES = (
    "all_gather_into_tensor",
    "allgather_fn",
    "all_gather",
    "all_gather_coalesced",
    "reduce_scatter_fn",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "reduce_scatter_coalesced",
    "all_reduce",
    "all_reduce_coalesced",
    "inference_all_reduce",
    "broadcast",
    "all_to_all_single",
    "barrier",
    "reduce",
)


def merge_config(base: dict, over: dict) -> dict:
    """`base` with `over` merged in key by key (nested dicts merged, other values replaced)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge_config(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def ds_config(spec: RunSpec, overrides: dict | None = None) -> dict:
    """The DeepSpeed config of a run, as it is recorded: spec.deepspeed (a --config file with the
    flags' overrides) when given, else one built from the spec (ZeRO-3, AdamW, `torch_adam` to keep
    DeepSpeed off its JIT-built fused Adam on CPU); `overrides` merged in key by key."""
    if spec.deepspeed is not None:
        return merge_config(json.loads(json.dumps(spec.deepspeed)), overrides or {})
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": spec.micro_batch,
        "gradient_accumulation_steps": spec.grad_accum,
        "gradient_clipping": spec.grad_clip,
        "zero_optimization": {"stage": 3},
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": spec.lr,
                "betas": list(spec.betas),
                "eps": spec.eps,
                "weight_decay": spec.weight_decay,
                "torch_adam": True,
            },
        },
        "bf16": {"enabled": bool(spec.bf16 or spec.mixed_precision == "bf16")},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if spec.sdpq is not None:
        cfg["sdpq"] = json.loads(json.dumps(spec.sdpq))
    return merge_config(cfg, overrides or {})


def run_config(spec: RunSpec, recorded: dict) -> tuple[dict, str | None]:
    """(what sdpq.deepspeed.initialize gets, how cross-node bytes are counted or None = not
    counted). Every key DeepSpeed reads is `recorded`'s; the "sdpq" block gets the run's
    ranks_per_node where it says "auto" (the value sdpq would read from the launcher), and a
    config without a block gets sdpq's exact collectives to count bytes (spec.count_bytes)."""
    from ..integrations.deepspeed import IncompatibleConfigError, check_config

    cfg = json.loads(json.dumps(recorded))
    block = cfg.get("sdpq")
    counter = "sdpq.stats"
    if spec.count_bytes == "meter":  # every collective, whoever runs it: with or without a block
        counter = METER
        if not block:
            cfg.pop("sdpq", None)
            return cfg, counter
    elif not block:
        cfg.pop("sdpq", None)
        stage = (cfg.get("zero_optimization") or {}).get("stage", 0)
        # Note: ZeRO-1/2's exact mode is DeepSpeed's own code path, which sdpq does not count.
        if spec.count_bytes != "exact" or stage != 3:
            return cfg, None
        block = json.loads(json.dumps(EXACT))
        try:
            check_config(cfg, Config.from_dict(block))
        except IncompatibleConfigError:  # e.g. ZeRO++ or a stage other than 3: sdpq cannot be installed
            return cfg, None
        counter = "sdpq.stats of sdpq's exact collectives (bitwise DeepSpeed's own)"
    topology = dict(block.get("topology") or {})
    if topology.get("ranks_per_node", "auto") == "auto":
        topology["ranks_per_node"] = spec.ranks_per_node
    cfg["sdpq"] = dict(block, topology=topology)
    if counter != METER and not Config.from_dict(cfg["sdpq"]).stats.enabled:
        return cfg, None
    return cfg, counter


def optimizer_bytes_per_param(engine, device: torch.device | None = None) -> float:
    """Bytes per parameter of what ZeRO keeps per partition element, summed over ranks: compute
    weights (ZeRO-3: the ds_tensor partitions; ZeRO-1/2: the whole bf16 group every rank holds),
    master partition, optimizer states and metadata (gradients excluded; tensors sharing memory
    counted once). Collective; its all-reduce runs on `device` (default: the compute device)."""
    from ..optim.memory import memory_report

    zopt = engine.optimizer
    if hasattr(zopt, "fp32_partitioned_groups_flat"):  # ZeRO-3
        masters = list(zopt.fp32_partitioned_groups_flat)
        weights = [t for t in zopt.fp16_partitioned_groups_flat if t is not None]
    elif hasattr(zopt, "fp32_groups_flat_partition"):  # ZeRO-1 with fp32 accumulation (BF16_Optimizer)
        masters, weights = list(zopt.fp32_groups_flat_partition), list(zopt.bf16_groups_flat)
    else:  # ZeRO-1/2 (DeepSpeedZeroOptimizer)
        masters, weights = list(zopt.single_partition_of_fp32_groups), list(zopt.bit16_groups_flat)

    class _View:  # ZeRO-3 swaps its flat partitions into param_groups only inside step()
        param_groups = [{"params": masters}]
        state = zopt.optimizer.state

    rep = memory_report(_View(), extra_weights=weights)
    nbytes = sum(rep[k] for k in ("weights", "master", "states", "metadata"))
    t = torch.tensor([float(nbytes), float(rep["numel"])], dtype=torch.float64, device=device or compute_device())
    dist.all_reduce(t)
    return float(t[0] / t[1])


def train(
    spec: RunSpec, *, data: TokenData | None = None, checks: bool = False, ds_overrides: dict | None = None
) -> RunResult:
    """Run `spec` with DeepSpeed (ZeRO-3 unless the config names another stage) on the initialised
    default process group (every rank calls it). checks (ZeRO-3): record in `extra` digests of
    every parameter partition and weight reference at the end (bitwise comparisons in tests).
    ds_overrides: merged into the DeepSpeed config
    (e.g. {"zero_optimization": {"stage3_param_persistence_threshold": 0}})."""
    from ..integrations import deepspeed as sdpq_ds

    if spec.backend != "deepspeed":
        raise ValueError(f"deepspeed_backend.train: spec.backend is {spec.backend!r}")
    if not dist.is_initialized():
        raise RuntimeError("deepspeed_backend.train needs an initialised torch.distributed process group")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = with_ranks_per_node(spec, world)
    data = data or (TokenData.from_path(spec.data) if spec.data else TokenData.stdlib())
    with step_timing(spec, _comm_modules() if spec.timing else ()):
        return _train(spec, sdpq_ds, rank, world, data, checks, ds_overrides)


def _comm_modules() -> list:
    import deepspeed.comm as ds_comm

    return [(ds_comm, _DS_COLLECTIVES, True), (dist, TORCH_COLLECTIVES, False)]


def _check_records(engine, adapter) -> dict[str, Any]:
    """What `checks` records, keyed by parameter name (ds_id numbering continues across engines in
    a process): every rank's final partitions and weight references."""
    names: dict[int, str] = {}
    for n, p in engine.module.named_parameters():
        names.setdefault(p.ds_id, n)
    out: dict[str, Any] = {"partition_digests": {n: digest(p.ds_tensor) for n, p in engine.module.named_parameters()}}
    if adapter is not None:
        out["references"] = {
            names[i]: (adapter.topology.local_rank, None if wg.reference is None else digest(wg.reference))
            for i, wg in adapter.weights.items()
        }
    return out


def _optional_records(spec: RunSpec, engine, adapter, spans, world: int, checks: bool, memory) -> dict[str, Any]:
    """What the run records on request: timing spans, check digests, the memory report."""
    out: dict[str, Any] = {}
    if spec.timing:
        out["timing"] = gather_step_timing(spans, world)
    if checks:
        out.update(_check_records(engine, adapter))
    if memory is not None:
        out["memory"] = memory
    return out


def _resume(spec: RunSpec, engine) -> int:
    """The first step to run: 0, or the step of the DeepSpeed checkpoint when spec.resume."""
    if not spec.resume:
        return 0
    if not spec.checkpoint_dir:
        raise ValueError("RunSpec.resume needs checkpoint_dir")
    path, client = engine.load_checkpoint(spec.checkpoint_dir)
    if path is None:
        raise FileNotFoundError(f"no DeepSpeed checkpoint in {spec.checkpoint_dir}")
    return int(client["step"])


def _run_steps(
    spec: RunSpec, engine, data: TokenData, start: int, rank: int, device: torch.device, schedule: bool
) -> tuple[torch.Tensor, list, list]:
    """Steps start .. spec.steps - 1: (this rank's loss per step on `device`, NaN before start;
    seconds per step; timing spans); logs and saves the checkpoint as the spec says. schedule:
    set the warm-up + cosine learning rate (off when the config has DeepSpeed's own "scheduler")."""
    # Note: the losses stay on the device; only a logged step reads one back to the host.
    local = torch.full((spec.steps,), float("nan"), dtype=torch.float64, device=device)
    times: list[float] = []
    spans: list = []  # per step: {label: [inclusive s, self s, calls]} (spec.timing)
    for step in range(start, spec.steps):
        t0 = time.perf_counter()
        with timing.span("train.step"):
            if schedule:
                for g in engine.optimizer.param_groups:
                    g["lr"] = lr_at(spec, step)
            local[step] = 0.0
            for micro in range(spec.grad_accum):
                i = step * spec.grad_accum + micro
                x, y = data.batch(i, rank, spec.micro_batch, spec.model.seq_len, seed=spec.seed, device=device)
                with timing.span("train.fwd_bwd"):
                    loss = engine(x, y)
                    engine.backward(loss)
                with timing.span("train.optim"):
                    engine.step()  # DeepSpeed steps the optimizer at the accumulation boundary
                local[step] += loss.detach().double() / spec.grad_accum
        times.append(time.perf_counter() - t0)
        if spec.timing:
            spans.append(timing.take())
        if spec.log_every and rank == 0 and (step + 1) % spec.log_every == 0:
            lr, loss0 = engine.optimizer.param_groups[0]["lr"], float(local[step])
            print(f"step {step + 1:5d}  loss(rank0) {loss0:.4f}  lr {lr:.2e}  {times[-1]:.3f}s", flush=True)
        if spec.save_at is not None and step + 1 == spec.save_at:
            if not spec.checkpoint_dir:
                raise ValueError("RunSpec.save_at needs checkpoint_dir")
            tag = CKPT_TAG.format(step=step + 1)
            engine.save_checkpoint(spec.checkpoint_dir, tag=tag, client_state={"step": step + 1})
    return local, times, spans


def _train(
    spec: RunSpec, sdpq_ds, rank: int, world: int, data: TokenData, checks: bool, ds_overrides: dict | None
) -> RunResult:
    device = compute_device()
    torch.manual_seed(spec.seed)
    model = model_from_config(spec.model)
    n_params = model.num_params()
    recorded = ds_config(spec, ds_overrides)
    config, counter = run_config(spec, recorded)
    engine, _, _, _ = sdpq_ds.initialize(model=model, model_parameters=model.parameters(), config=config)
    # What DeepSpeed made of the config (train_batch_size alone gives the micro batch, ...).
    spec = replace(
        spec, micro_batch=engine.train_micro_batch_size_per_gpu(), grad_accum=engine.gradient_accumulation_steps()
    )
    adapter = sdpq_ds.get_adapter(engine)
    start = _resume(spec, engine)
    comm_stats.reset()
    with memory_tracking(spec, engine) as memory, link_meter(spec) as meter:  # ZeRO-3's gradient partitions persist
        local, times, spans = _run_steps(spec, engine, data, start, rank, device, schedule="scheduler" not in config)
    summed = local.nan_to_num(0.0)
    dist.all_reduce(summed)  # one collective for the whole loss curve
    curve = (summed / world).tolist()
    losses = [curve[s] if s >= start else float("nan") for s in range(spec.steps)]
    # Statistics of the training steps only (evaluation gathers come after).
    comm, inter = gather_comm(world, meter)

    engine.eval()
    val = validation_loss(engine, data, spec, rank, world, device)
    engine.train()

    zopt = engine.optimizer
    own_block = bool(recorded.get("sdpq"))
    extra: dict[str, Any] = {
        "optimizer": type(zopt.optimizer).__module__ + "." + type(zopt.optimizer).__name__,
        "first_step": start + 1,
        "world_size": world,
        "params": n_params,
        "skipped_steps": int(engine.skipped_steps),
        "sdpq": adapter.config.to_dict() if adapter is not None and own_block else None,
        "layout": adapter.topology.layout if adapter is not None else layout(world, int(spec.ranks_per_node)),
        "cross_node_counter": counter or "not counted",
        "step_times": times,
        "ds_config": recorded,
    }
    extra.update(_optional_records(spec, engine, adapter, spans, world, checks, memory))
    result = RunResult(
        losses=losses,
        val_loss=val,
        step_seconds=median_step_seconds(times),
        comm=comm,
        cross_node_bytes_per_step=inter / max(1, spec.steps - start) if counter else "not counted",
        optimizer_bytes_per_param=optimizer_bytes_per_param(engine, device),
        extra=extra,
    )
    engine.destroy()
    return result
