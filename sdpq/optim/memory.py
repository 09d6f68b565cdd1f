"""Measured optimizer memory: bytes per parameter of the tensors that exist, and the peak of
the allocations made during one step()."""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from .layout import local
from .states import is_metadata_key

__all__ = ["memory_report", "measure_peak"]

KINDS = ("weights", "master", "states", "metadata")


def _kind(key, t: Tensor) -> str:
    if key == "master_lo":
        return "master"
    if t.dim() == 0 or (isinstance(key, str) and is_metadata_key(key)):
        return "metadata"
    return "states"


def _state_tensors(optimizer) -> Iterable[tuple[str, object, Tensor]]:
    """(kind-key, param, tensor) for every tensor kept in optimizer.state (also the compressed
    store and the inner optimizer of sdpq.optim.compress)."""
    stores = [optimizer.state]
    inner = getattr(optimizer, "inner", None)
    if inner is not None:
        stores.append(inner.state)
    for store in stores:
        for p, st in store.items():
            if not isinstance(st, dict):
                continue
            for key, value in st.items():
                values = value.values() if isinstance(value, dict) else [value]
                for v in values:
                    if isinstance(v, Tensor):
                        yield key, p, local(v)


def memory_report(optimizer, extra_weights: Iterable[Tensor] = ()) -> dict:
    """Bytes of the tensors that actually exist, per kind and per parameter element.

    weights: the parameters (local shards) plus ``extra_weights`` (e.g. DeepSpeed's bf16
    compute partitions next to fp32 master partitions); master: MCF compensation; states:
    moment tensors (FP8 codes, bf16, fp32); metadata: FP8 scales/k/gm and step counters.
    Works for any torch.optim optimizer. Tensors sharing memory are counted once.
    """
    seen: set = set()
    out = {k: 0 for k in KINDS}

    def add(kind: str, t: Tensor) -> None:
        key = (t.device, t.data_ptr(), t.numel(), t.dtype)
        if t.numel() and key in seen:
            return
        seen.add(key)
        out[kind] += t.numel() * t.element_size()

    numel = 0
    params = {id(p): p for g in optimizer.param_groups for p in g["params"]}
    for p in params.values():
        numel += local(p).numel()
        add("weights", local(p))
    for t in extra_weights:
        add("weights", local(t))
    for key, _, t in _state_tensors(optimizer):
        add(_kind(key, t), t)
    total = sum(out.values())
    report: dict[str, Any] = dict(numel=numel, **out, total=total, bytes_per_param=total / max(numel, 1))
    report["per_param"] = {k: out[k] / max(numel, 1) for k in KINDS}
    return report


class _mallinfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _heap_in_use() -> Callable[[], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        fn = libc.mallinfo2
    except (OSError, AttributeError, TypeError):
        return None
    fn.restype = _mallinfo2

    def in_use() -> int:
        m = fn()
        return m.uordblks + m.hblkhd  # heap chunks in use + mmapped chunks (large tensors)

    return in_use


class _Sampler(TorchDispatchMode):
    def __init__(self, in_use: Callable[[], int]):
        super().__init__()
        self.in_use = in_use
        self.base = in_use()
        self.peak = self.base

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.in_use())
        return out


def measure_peak(fn: Callable[[], object], device: torch.device | str = "cpu") -> tuple[object, int | None]:
    """(fn(), peak bytes allocated above the level at the call) - measured, not estimated.

    CUDA: the caching allocator's peak. CPU: glibc's heap in use (mallinfo2), sampled after
    every aten operation; None where glibc is not available."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        torch.cuda.synchronize(device)
        return result, torch.cuda.max_memory_allocated(device) - base
    in_use = _heap_in_use()
    if in_use is None:
        return fn(), None
    with _Sampler(in_use) as sampler:
        result = fn()
    return result, sampler.peak - sampler.base
