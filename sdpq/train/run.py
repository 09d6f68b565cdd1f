"""What one training run is (backend, model, data, schedule, sdpq block) and what it reports.

Both backends (``fsdp_backend.train``, ``deepspeed_backend.train``) take a ``RunSpec`` and
return a ``RunResult``, so the demo, the benchmarks and ``python -m sdpq.train`` treat them alike.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .model import GPTConfig, ModelConfig, model_config_from_dict

__all__ = [
    "TORCH_COLLECTIVES",
    "gather_comm",
    "RunSpec",
    "RunResult",
    "lr_at",
    "digest",
    "validation_loss",
    "median_step_seconds",
    "step_timing",
    "gather_step_timing",
    "MIXED_PRECISION",
]

# RunSpec.mixed_precision values. "bf16": bf16 compute on full-precision parameters, what users
# of each framework run: FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) (the
# FSDP2 tutorial's and torchtitan's policy; FSDP2's own default would reduce in bf16), DeepSpeed
# "bf16": {"enabled": true} (bf16 parameters and gradients, fp32 master in the optimizer).
MIXED_PRECISION = (None, "bf16")


@dataclass(frozen=True)
class RunSpec:
    backend: Literal["fsdp2", "deepspeed", "ddp"] = "fsdp2"
    model: ModelConfig = field(default_factory=GPTConfig)  # GPTConfig or LlamaConfig (sdpq.train.model)
    sdpq: dict[str, Any] | None = None  # the "sdpq" block; None = the unquantized baseline
    steps: int = 200
    micro_batch: int = 4  # sequences per rank per micro-step
    grad_accum: int = 1
    lr: float = 1e-3  # at 3e-3 this GPT trains chaotically: a tiny lr perturbation moves the 200-step loss ~5%
    warmup: int = 20
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 = no clipping
    bf16: bool = False  # bf16 parameters/compute (MCF master needs it)
    mixed_precision: str | None = None  # "bf16": see MIXED_PRECISION (combines with bf16 for FSDP2)
    seed: int = 0
    data: str | None = None  # None = the stdlib corpus; else a dir of text or a Megatron prefix
    ranks_per_node: int | str = "auto"
    checkpoint_dir: str | None = None
    save_at: int | None = None  # save a checkpoint after this step
    resume: bool = False  # load the checkpoint in checkpoint_dir and continue
    eval_batches: int = 8
    log_every: int = 10
    timing: bool = False  # per-step time spans (sdpq.comm.timing) in RunResult.extra["timing"]
    # sdpq.memory's report just before the last optimizer step (gradients alive; sdpq's hooks'
    # transient peaks measured during the steps) and the bytes of every live tensor, in
    # RunResult.extra["memory"] (slows the steps).
    measure_memory: bool = False
    # FSDP2 gradient accumulation: "no_sync" skips the reduce-scatter on all but the last
    # micro-step; "defer_all_reduce" reduce-scatters every micro-step and defers only HSDP's
    # cross-node all-reduce to the last one (set_requires_all_reduce(False) before it).
    accumulation: Literal["no_sync", "defer_all_reduce"] = "no_sync"
    # Without an sdpq block: "exact" counts cross-node bytes with sdpq's exact collectives
    # (bitwise the framework's own, see settings.EXACT); "off" runs the framework alone ("not
    # counted"). python -m sdpq.train defaults to "exact"; library callers keep the plain framework.
    # "meter" (deepspeed backend): the process-group meter counts, with or without a block (plain
    # ZeRO-1/2 runs DeepSpeed's own collectives, which sdpq's statistics never see).
    count_bytes: Literal["exact", "meter", "off"] = "off"
    # The DeepSpeed config to run as it is (a --config file with its overrides; deepspeed backend
    # only); None = the one deepspeed_backend.ds_config builds from this spec.
    deepspeed: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.backend not in ("fsdp2", "deepspeed", "ddp"):
            raise ValueError(f"RunSpec.backend: {self.backend!r}; allowed: 'fsdp2', 'deepspeed', 'ddp'")
        if self.accumulation not in ("no_sync", "defer_all_reduce"):
            raise ValueError(f"RunSpec.accumulation: {self.accumulation!r}; allowed: 'no_sync', 'defer_all_reduce'")
        if self.count_bytes not in ("exact", "meter", "off"):
            raise ValueError(f"RunSpec.count_bytes: {self.count_bytes!r}; allowed: 'exact', 'meter', 'off'")
        if self.count_bytes == "meter" and self.backend != "deepspeed":
            raise ValueError(
                f"RunSpec.count_bytes 'meter' is for backend 'deepspeed' (got {self.backend!r}); FSDP2 and DDP "
                "count with 'exact'"
            )
        if self.deepspeed is not None and self.backend != "deepspeed":
            raise ValueError("RunSpec.deepspeed: a DeepSpeed config is for backend 'deepspeed'")
        if self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(f"RunSpec.mixed_precision: {self.mixed_precision!r}; allowed: None, 'bf16'")
        for name in ("steps", "micro_batch", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"RunSpec.{name}: {getattr(self, name)!r}; allowed: an integer >= 1")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunSpec:
        """The inverse of dataclasses.asdict(spec) after a JSON round trip (the model config as
        a dict, betas as a list)."""
        d = dict(d)
        d["model"] = model_config_from_dict(d["model"])
        if "betas" in d:
            d["betas"] = tuple(d["betas"])
        return cls(**d)


@dataclass
class RunResult:
    losses: list[float]  # training loss of every step (mean over ranks), index 0 = step 1
    val_loss: float
    step_seconds: float  # median wall time per step after warm-up
    comm: dict[str, Any]  # sdpq.stats summary dict (bytes per link and path)
    cross_node_bytes_per_step: float | str  # "not counted" where no counter ran (RunSpec.count_bytes)
    optimizer_bytes_per_param: float
    extra: dict[str, Any] = field(default_factory=dict)


def lr_at(spec: RunSpec, step: int) -> float:
    """Linear warm-up then cosine decay to 10% (step counts from 0)."""
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    t = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
    return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def median_step_seconds(times: list[float], warmup: int = 5) -> float:
    """Median wall time per step, the first `warmup` steps excluded (fewer when the run is
    shorter; NaN without steps)."""
    warm = times[min(warmup, len(times) - 1) :] if times else [float("nan")]
    return statistics.median(warm)


def digest(t) -> str:
    """Short hash of a tensor's bytes: bitwise comparisons across ranks and runs in tests."""
    t = t.detach().contiguous().reshape(-1)
    return hashlib.sha1(t.view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16]


def validation_loss(forward, data, spec: RunSpec, rank: int, world: int, device: torch.device | str = "cpu") -> float:
    """Mean loss of ``spec.eval_batches`` validation batches per rank, averaged over all ranks
    (NaN when eval_batches is 0). ``forward(x, y)`` returns the loss; call on every rank. Batches
    and the all-reduced sum live on `device` (the compute device, which the process group's
    backend needs); the host reads the result once."""
    import torch.distributed as dist

    if spec.eval_batches <= 0:
        return float("nan")
    total = torch.zeros((), dtype=torch.float64, device=device)
    with torch.no_grad():
        for i in range(spec.eval_batches):
            x, y = data.batch(i, rank, spec.micro_batch, spec.model.seq_len, seed=spec.seed, split="val", device=device)
            total += forward(x, y).detach().double()
    dist.all_reduce(total)
    return float(total) / (world * spec.eval_batches)


# torch.distributed collectives timed as "comm.other" with spec.timing (the backends call them
# synchronously on CPU; their work handles stay unwrapped: FSDP2 checks isinstance(work, Work)).
TORCH_COLLECTIVES = (
    "all_gather_single",
    "all_gather_into_tensor",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_reduce",
    "all_to_all_single",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "barrier",
)


METER = "process-group meter (sdpq.comm.link_bytes)"


@contextlib.contextmanager
def link_meter(spec: RunSpec):
    """With spec.count_bytes "meter": the process-group byte meter, counting every collective
    of every caller while the block runs (yielded); else None."""
    if spec.count_bytes != "meter":
        yield None
        return
    from ..comm.link_bytes import LinkBytes

    with LinkBytes(int(spec.ranks_per_node)) as meter:
        yield meter


def gather_comm(world: int, meter=None) -> tuple[dict, int]:
    """Every rank's process-wide sdpq counters: ({"total": summed over ranks, "per_rank": [...]},
    the bytes all ranks sent across nodes). With a `link_meter`, the cross-node bytes are the
    meter's (its totals under "meter"). Collective."""
    import torch.distributed as dist

    from ..comm import stats as comm_stats

    per_rank: list = [None] * world
    dist.all_gather_object(per_rank, comm_stats.process_stats().as_dict())
    total = comm_stats.sum_over_ranks(per_rank)
    inter = sum(links.get("inter", {}).get("bytes", 0) for links in total.values())
    out: dict[str, Any] = {"total": total, "per_rank": per_rank}
    if meter is not None:
        from ..comm.link_bytes import sum_over_ranks

        metered: list = [None] * world
        dist.all_gather_object(metered, meter.as_dict())
        links_total = sum_over_ranks(metered)["total"]
        out["meter"] = links_total
        inter = sum(links.get("inter", {}).get("bytes", 0) for links in links_total.values())
    return out, inter


@contextlib.contextmanager
def step_timing(spec: RunSpec, comm_modules=()):
    """While a run lasts: with spec.timing, sdpq.comm.timing on (from a clean slate) and the
    collectives of `comm_modules` ((module, names, wrap_work) triples) timed as "comm.other";
    restored afterwards. Yields the timing module, or None without spec.timing."""
    if not spec.timing:
        yield None
        return
    from ..comm import timing

    prev = timing.enable()
    timing.reset()
    undo = [timing.instrument(m, names, wrap_work=wrap) for m, names, wrap in comm_modules]
    try:
        yield timing
    finally:
        for u in reversed(undo):
            u()
        timing.enable(prev)
        timing.reset()


@contextlib.contextmanager
def memory_tracking(spec: RunSpec, target, optimizer=None, steps: int = 0):
    """With spec.measure_memory: yields a dict that holds, after the block, this rank's
    sdpq.memory report (with the transient peak of every sdpq hook run inside the block) and the
    bytes of every live tensor, taken just before the `steps`-th step of `optimizer` (the
    gradients are alive then), or at the end of the block without one. Else yields None."""
    if not spec.measure_memory:
        yield None
        return
    from .. import memory

    out: dict = {}
    with memory.transients() as peaks:

        def take(*_) -> None:
            out.update(report=memory.report(target, optimizer, transients=peaks).as_dict())
            out["live_bytes"] = memory.live_tensor_bytes()

        calls = [0]

        def before_step(*_) -> None:
            calls[0] += 1
            if calls[0] == steps:
                take()

        handle = optimizer.register_step_pre_hook(before_step) if optimizer is not None else None
        try:
            yield out
        finally:
            if handle is not None:
                handle.remove()
        if not out:
            take()


def optimizer_bytes_per_param(opt, model, device: torch.device) -> float:
    """Bytes per parameter of what the optimizer steps (weights, master, states, metadata; frozen
    parameters count as weights), summed over ranks (collective)."""
    import torch.distributed as dist

    from ..optim.layout import local

    params = [p for p in model.parameters()]
    try:
        from ..optim.memory import memory_report

        rep = memory_report(opt)
        nbytes = sum(rep.get(k, 0) for k in ("weights", "master", "states", "metadata"))
        numel = sum(local(p).numel() for p in params if any(p is q for g in opt.param_groups for q in g["params"]))
        # Frozen parameters are weights too.
        nbytes += sum(local(p).nbytes for p in params if not p.requires_grad)
        numel += sum(local(p).numel() for p in params if not p.requires_grad)
    except Exception:  # the optimizer layer's report is unavailable: count tensors ourselves
        loc = [local(p) for p in params]
        nbytes = sum(t.nbytes for t in loc)
        numel = sum(t.numel() for t in loc)
        for st in opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    nbytes += local(v).nbytes
    t = torch.tensor([float(nbytes), float(numel)], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t[0] / t[1])


def gather_step_timing(per_step: list[dict], world: int) -> list:
    """Every rank's per-step span records ({label: [inclusive s, self s, calls]} per step), in rank
    order (collective: call on every rank)."""
    import torch.distributed as dist

    out: list = [None] * world
    dist.all_gather_object(out, per_step)
    return out
