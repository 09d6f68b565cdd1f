"""Measured optimizer memory: bytes per parameter of the tensors that exist, and (`measure_peak`,
from sdpq._memprobe) the peak of the allocations made during one step()."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from .._memprobe import measure_peak
from .layout import local
from .states import is_metadata_key

__all__ = ["memory_report", "measure_peak", "state_tensors"]

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


def state_tensors(optimizer) -> Iterable[tuple[str, Tensor]]:
    """(kind, tensor) of every tensor the optimizer keeps: "master" (MCF compensation),
    "states" (moments) or "metadata" (FP8 scales, k, gm; step counters)."""
    for key, _, t in _state_tensors(optimizer):
        yield _kind(key, t), t


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
