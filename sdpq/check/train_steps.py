"""Training steps of the GPU check: the demo's GPT trained by 4 ranks (2 simulated nodes x 2)
on the one device, with FSDP2 and with ZeRO-3, sdpq and its AdamW on, and the same run on the
CPU for comparison.

Note: NCCL refuses two ranks on one GPU, so the ranks talk over gloo while their tensors (model,
optimizer states, sdpq's buffers and kernels) live on the GPU. What the report shows is that
the CUDA path computes what the CPU path computes; NCCL and real links are not exercised.
"""

from __future__ import annotations

import json
import os
import tempfile
from datetime import timedelta
from pathlib import Path

import torch

from ..launch.env import free_port
from .steps import Checks, Ctx

__all__ = ["train_fsdp", "train_zero3"]

WORLD, PER_NODE = 4, 2
# Note: bf16 GEMMs round differently on the two devices and a quantized run amplifies that like
# a change of seed: trajectories agree at the start and then only in level, hence two bounds.
FIRST_STEPS, FIRST_RTOL = 2, 0.005  # steps 0-1: the same computation up to rounding
TAIL, TAIL_RTOL = 10, 0.05  # mean of the last steps: a seed's spread on this small model


def _batch(step: int, rank: int, seq: int, batch: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Learnable synthetic bytes (a random walk mod 256): a pure function of (step, rank)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    t = torch.randint(-3, 4, (batch, seq + 1), generator=g).cumsum(1).remainder(256)
    return t[:, :-1].to(device), t[:, 1:].to(device)


def _init_rank(rank: int, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank % PER_NODE),
        LOCAL_WORLD_SIZE=str(PER_NODE),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))


def _use_kernels_for(arm_device: str, rehearse: bool) -> None:
    """Rehearsal: the "device" arm runs the Triton kernels in the interpreter, the CPU arm the
    C++ kernels (as on the GPU machine, where CPU tensors take the C++ path anyway)."""
    if not rehearse:
        return
    from ..kernels import dispatch as fused

    os.environ["SDPQ_TRITON"] = "interpret" if arm_device == "device" else "auto"
    fused._triton_mode.cache_clear()


def _fsdp_run(device: torch.device, steps: int, d_model: int, quantize: bool = True) -> list[float]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import sdpq
    from sdpq.train.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=4, d_model=d_model)).to(device, torch.bfloat16)
    mesh = init_device_mesh(device.type, (WORLD,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = sdpq.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    cfg: dict = {"topology": {"ranks_per_node": PER_NODE}}
    if not quantize:  # sdpq's collectives and AdamW, nothing quantized on the wire (AdamW's FP8 states stay)
        cfg.update(weights={"mode": "exact"}, gradients={"mode": "exact"})
    sdpq.fsdp.apply(model, cfg, optimizer=opt)
    losses, rank = [], dist.get_rank()
    for step in range(steps):
        x, y = _batch(step, rank, 64, 4, device)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        avg = loss.detach().float().reshape(1).cpu()  # gloo: the CPU copy (one sync per step is the test's)
        dist.all_reduce(avg)
        losses.append(float(avg) / WORLD)
    sdpq.fsdp.remove(model)
    return losses


def _fsdp_worker(rank: int, port: int, rehearse: bool, steps: int, d_model: int, out: str) -> None:
    _init_rank(rank, port)
    device = torch.device("cpu") if rehearse else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    res = {}
    # Note: no plain FSDP2 arm: gloo's own all-gather / reduce-scatter refuse CUDA tensors (sdpq's
    # collectives carry them through the host); the exact arm is the unquantized context.
    arms = [("sdpq_device", device), ("sdpq_cpu", torch.device("cpu")), ("exact_device", device)]
    for arm, dev in arms:
        _use_kernels_for("device" if arm.endswith("device") else "cpu", rehearse)
        res[arm] = _fsdp_run(dev, steps, d_model, quantize=not arm.startswith("exact"))
    if rank == 0:
        Path(out).write_text(json.dumps(res))
    import torch.distributed as dist

    dist.destroy_process_group()


def _spawn(worker, ctx: Ctx, steps: int, d_model: int) -> dict:
    """Runs worker on WORLD ranks. Rehearsal: forked from this process, which has imported what
    the ranks need (OMP_NUM_THREADS=1 is set, so forking is safe); GPU: spawned (no CUDA
    context may cross a fork)."""
    import torch.multiprocessing as mp

    import sdpq  # noqa: F401 - imported once here; forked ranks inherit it
    import sdpq.train.model  # noqa: F401

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "losses.json")
        method = "fork" if ctx.rehearse else "spawn"
        mp.start_processes(
            worker, args=(free_port(), ctx.rehearse, steps, d_model, out), nprocs=WORLD, start_method=method
        )
        return json.loads(Path(out).read_text())


def _tail(losses: list[float]) -> float:
    return sum(losses[-TAIL:]) / len(losses[-TAIL:])


def _compare(res: dict, c: Checks, what: str) -> dict:
    dev, cpu = res["sdpq_device"], res["sdpq_cpu"]
    rel = [abs(a - b) / abs(b) for a, b in zip(dev, cpu)]
    c.add(f"{what}: losses finite", all(v == v and abs(v) < 1e4 for arm in res.values() for v in arm))
    first = max(rel[:FIRST_STEPS])
    c.add(
        f"{what}: the first {FIRST_STEPS} steps' losses match the CPU run within {FIRST_RTOL:.1%}",
        first <= FIRST_RTOL,
        f"max {first:.2e}",
    )
    tail = _tail(dev) / _tail(cpu)
    c.add(
        f"{what}: the last {TAIL} steps' mean loss matches the CPU run within {TAIL_RTOL:.0%}",
        abs(tail - 1) <= TAIL_RTOL,
        f"ratio {tail:.4f}",
    )
    c.add(f"{what}: the loss goes down", dev[-1] < dev[0])
    figures = {
        "first_steps_max_rel_diff_vs_cpu": first,
        "loss_max_rel_diff_vs_cpu": max(rel),  # every step (reported; the trajectories may part)
        "tail_mean_ratio_vs_cpu": tail,
        "losses": res,
    }
    # context: the same device, exact collectives
    figures["tail_mean_ratio_vs_exact_device"] = _tail(dev) / _tail(res["exact_device"])
    return figures


def train_fsdp(ctx: Ctx) -> dict:
    steps, d = (3, 32) if ctx.rehearse else (30, 256)
    res = _spawn(_fsdp_worker, ctx, steps, d)
    c = Checks()
    figures = _compare(res, c, "FSDP2")
    return c.result(figures, [f"{steps} steps, d_model {d}, 2 layers, bf16 parameters, FP8+MCF AdamW; ranks over gloo"])


# ---------------------------------------------------------------------------------- ZeRO-3


def _ds_config() -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": True},
        "zero_allow_untested_optimizer": True,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1, "torch_adam": True},
        },
        "steps_per_print": 1 << 30,
        "sdpq": {"topology": {"ranks_per_node": PER_NODE}, "optimizer": {"states": "fp8"}},
    }


def _zero3_run(device: torch.device, steps: int, d_model: int) -> list[float]:
    import torch.distributed as dist

    import sdpq
    from sdpq.train.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=4, d_model=d_model))
    engine, *_ = sdpq.deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_ds_config())
    losses = []
    for step in range(steps):
        x, y = _batch(step, dist.get_rank(), 64, 4, engine.device)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        avg = loss.detach().float().reshape(1).cpu()
        dist.all_reduce(avg)
        losses.append(float(avg) / WORLD)
    engine.destroy()
    return losses


def _zero3_worker(rank: int, port: int, rehearse: bool, steps: int, d_model: int, out: str) -> None:
    _init_rank(rank, port)
    if not rehearse:
        # DeepSpeed puts a rank on cuda:LOCAL_RANK; every rank shares the one GPU here (the
        # block's topology names the simulated nodes itself).
        os.environ["LOCAL_RANK"] = "0"
        torch.cuda.set_device(0)
    _use_kernels_for("device", rehearse)
    res = {"sdpq_device": _zero3_run(torch.device("cpu" if rehearse else "cuda"), steps, d_model)}
    if rank == 0:
        Path(out).write_text(json.dumps(res))


def train_zero3(ctx: Ctx) -> dict:
    try:
        import deepspeed  # noqa: F401
    except ImportError as e:
        return {
            "status": "skip",
            "error": f"DeepSpeed is not importable here ({e}); carry it: sdpq check pack",
            "figures": {},
        }
    steps, d = (3, 32) if ctx.rehearse else (20, 256)
    res = _spawn(_zero3_worker, ctx, steps, d)
    c = Checks()
    losses = res["sdpq_device"]
    c.add("ZeRO-3: losses finite", all(v == v and abs(v) < 1e4 for v in losses))
    c.add("ZeRO-3: the loss goes down", losses[-1] < losses[0])
    return c.result(
        {"losses": res}, [f"{steps} steps, d_model {d}; DeepSpeed over gloo with the tensors on the device"]
    )
