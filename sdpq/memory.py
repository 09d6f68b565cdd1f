"""sdpq.memory: the bytes this rank keeps, by kind, counted from the live objects.

    rep = sdpq.memory.report(model, optimizer)   # an FSDP2 or DDP model (with or without sdpq) or
    print(rep.table())                           # a DeepSpeed ZeRO engine (optimizer: its own)

    with sdpq.memory.transients() as peaks:      # the allocation peak of every sdpq hook
        train_one_step()
    rep = sdpq.memory.report(model, optimizer, transients=peaks)

Kinds (bytes of this rank; `per_param` divides by the model's parameter count, all ranks together):

| kind | what |
|---|---|
| parameters | the framework's parameters (FSDP2: shards; ZeRO-3: compute partitions; ZeRO-1/2: flat groups) |
| gradients | the framework's gradients (FSDP2: `.grad`; ZeRO-3: flat partitions; ZeRO-1/2: see below) |
| master | master weights kept beside the parameters (ZeRO's fp32 partitions; sdpq AdamW's MCF compensation) |
| optimizer_states | moments and their metadata (FP8 scales, step counters) |
| weight_reference | sdpq's node-resident weight references (`weights.reference`; none on one node) |
| error_feedback | sdpq's gradient residuals (`gradients.error_feedback`) |
| sdpq_buffers | sdpq's other tensors: flags, checksums; HSDP's deferred micro-step sum (fp32) |

ZeRO-1/2's gradients: the parameters' `.grad`, the contiguous reduce buckets, ZeRO-2's gradient
partition and, with fp32 accumulation (BF16_Optimizer), its fp32 buffer.

A storage shared by several tensors is counted once, in the first kind above that holds it (a
ZeRO-3 bf16 master aliased to the compute partition is parameters only). What sdpq keeps is
the last three kinds (`sdpq_bytes`); the transient peaks are measured inside sdpq's hooks
(`sdpq._memprobe`: glibc's heap on the CPU, the caching allocator on a GPU).
"""

from __future__ import annotations

import gc
import sys
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ._memprobe import TransientPeaks, transients

__all__ = ["report", "transients", "live_tensor_bytes", "MemoryReport", "KINDS", "SDPQ_KINDS", "storage_key"]

KINDS = (
    "parameters",
    "gradients",
    "master",
    "optimizer_states",
    "weight_reference",
    "error_feedback",
    "sdpq_buffers",
)
SDPQ_KINDS = ("weight_reference", "error_feedback", "sdpq_buffers")


def storage_key(t: torch.Tensor) -> tuple:
    """What identifies a tensor's memory: its device and storage address."""
    return (t.device, t.untyped_storage().data_ptr())


@dataclass(frozen=True)
class MemoryReport:
    """Bytes per kind on this rank (see the module docstring)."""

    bytes: dict[str, int]
    model_numel: int  # the model's parameters, all ranks together
    transient_peaks: dict[str, int] = field(default_factory=dict)  # per hook: largest allocation peak

    @property
    def sdpq_bytes(self) -> int:
        return sum(self.bytes[k] for k in SDPQ_KINDS)

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    @property
    def largest_transient(self) -> int | None:
        return max(self.transient_peaks.values()) if self.transient_peaks else None

    @property
    def per_param(self) -> dict[str, float]:
        """Bytes per model parameter, per kind (and "total", "sdpq")."""
        n = max(self.model_numel, 1)
        out = {k: v / n for k, v in self.bytes.items()}
        out.update(total=self.total / n, sdpq=self.sdpq_bytes / n)
        return out

    def as_dict(self) -> dict:
        return {
            "bytes": dict(self.bytes),
            "model_numel": self.model_numel,
            "per_param": self.per_param,
            "sdpq_bytes": self.sdpq_bytes,
            "total": self.total,
            "transient_peaks": dict(self.transient_peaks),
        }

    def table(self) -> str:
        pp = self.per_param
        rows = [f"{'kind':<18}{'MB':>12}{'B/param':>10}"]
        rows += [f"{k:<18}{self.bytes[k] / 1e6:>12.3f}{pp[k]:>10.3f}" for k in KINDS]
        rows.append(f"{'total':<18}{self.total / 1e6:>12.3f}{pp['total']:>10.3f}")
        for name, peak in sorted(self.transient_peaks.items()):
            rows.append(f"{'peak ' + name:<40} {peak / 1e6:.3f} MB")
        return "\n".join(rows)


class _Ledger:
    """Bytes per kind, each storage counted once (whole storages: a view counts its base)."""

    def __init__(self) -> None:
        self.bytes = {k: 0 for k in KINDS}
        self._seen: set = set()

    def add(self, kind: str, t: torch.Tensor | None) -> None:
        if t is None:
            return
        t = _local(t)
        if t.device.type == "meta":
            return
        key = storage_key(t)
        if key in self._seen:
            return
        self._seen.add(key)
        self.bytes[kind] += t.untyped_storage().nbytes()

    def add_all(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        for kind, t in items:
            self.add(kind, t)


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # a DTensor: this rank's shard
    return to_local() if callable(to_local) else t


def _optimizer_tensors(optimizer) -> Iterator[tuple[str, torch.Tensor]]:
    from .optim.memory import state_tensors

    if optimizer is None:
        return
    inner = getattr(optimizer, "optimizer", None)  # a framework's wrapper (Accelerate, DeepSpeed)
    if not hasattr(optimizer, "state") and inner is not None:
        optimizer = inner
    for kind, t in state_tensors(optimizer):
        yield ("master" if kind == "master" else "optimizer_states"), t


def _module_report(model: nn.Module, optimizer, ledger: _Ledger) -> int:
    """An FSDP2 model (its sharded parameters) or a DDP one (full replicas), sdpq applied or not."""
    from .integrations import ddp as sdpq_ddp
    from .integrations import fsdp as sdpq_fsdp

    params = list(model.parameters())
    for p in params:
        ledger.add("parameters", p)
    for p in params:
        ledger.add("gradients", p.grad)
    ledger.add_all(_optimizer_tensors(optimizer))
    if sdpq_fsdp.is_applied(model):
        for c in sdpq_fsdp.module_comms(model).values():
            ledger.add_all(c.held_tensors())
    if sdpq_ddp.is_applied(model):
        ledger.add_all(sdpq_ddp.held_tensors(model))
    return sum(p.numel() for p in params)


def _deepspeed_report(engine, ledger: _Ledger) -> int:
    """A DeepSpeed ZeRO engine: what DeepSpeed keeps (read through sdpq.deepspeed, where DeepSpeed's
    internals are named), its optimizer's states, and sdpq's."""
    from .integrations import deepspeed as sdpq_deepspeed

    ledger.add_all(sdpq_deepspeed.framework_tensors(engine))
    ledger.add_all(_optimizer_tensors(sdpq_deepspeed.stepped_optimizer(engine)))
    adapter = sdpq_deepspeed.get_adapter(engine)
    if adapter is not None:
        ledger.add_all(adapter.held_tensors())
    return sdpq_deepspeed.model_numel(engine)


def live_tensor_bytes(device: torch.device | str | None = None) -> int:
    """Bytes of every tensor storage alive in this process that Python can reach (each storage
    once; `device`: only those on it). An independent count, for checking `report` against:
    it reads no sdpq object. Collects garbage first; slow on a large heap (tests, benchmarks)."""
    gc.collect()
    want = torch.device(device) if device is not None else None
    seen: set = set()
    total = 0
    with warnings.catch_warnings():  # isinstance() on deprecated module attributes warns
        warnings.simplefilter("ignore")
        objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for o in objects:
        if not isinstance(o, torch.Tensor) or is_traceable_wrapper_subclass(o) or o.device.type == "meta":
            continue  # a DTensor holds no storage of its own: its local tensor is counted
        if want is not None and o.device != want:
            continue
        key = storage_key(o)
        if key not in seen:
            seen.add(key)
            total += o.untyped_storage().nbytes()
    return total


def _is_deepspeed_engine(target) -> bool:
    """Whether target is a DeepSpeed engine (DeepSpeed is not imported to find out)."""
    if "deepspeed" not in sys.modules:
        return False
    from .integrations import deepspeed as sdpq_deepspeed

    return sdpq_deepspeed.is_engine(target)


def report(target, optimizer=None, *, transients: TransientPeaks | None = None) -> MemoryReport:
    """What this rank keeps, by kind (see the module docstring). `target`: an FSDP2 or DDP model
    (sdpq applied or not; pass its `optimizer`) or a DeepSpeed ZeRO engine (its own optimizer is
    read). `transients`: what `sdpq.memory.transients()` measured. Not collective."""
    ledger = _Ledger()
    if _is_deepspeed_engine(target):
        numel = _deepspeed_report(target, ledger)
    elif isinstance(target, nn.Module):
        numel = _module_report(target, optimizer, ledger)
    else:
        raise TypeError(
            f"sdpq.memory.report: {type(target).__name__} is neither a model (FSDP2 or DDP) nor a DeepSpeed engine"
        )
    peaks = dict(transients.peaks) if transients is not None else {}
    return MemoryReport(bytes=ledger.bytes, model_numel=numel, transient_peaks=peaks)
