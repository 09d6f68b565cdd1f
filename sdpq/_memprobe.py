"""Measured allocation peaks: of one call (`measure_peak`), and of every sdpq hook while
`transients()` is on (what `sdpq.memory` reports as the largest transient buffer of a step).

CUDA: the caching allocator's own counters (`memory_allocated`, `max_memory_allocated`; the
peak statistic is reset at every measured call, so a user's own peak readings are not
meaningful while tracking is on). CPU: glibc's heap in use (`mallinfo2`), sampled after every
aten operation inside the measured call; None where glibc lacks it.

Where: below every layer (like `_hotpath`), because the hooks of both integrations and the
optimizer's memory report use it. Off, `hook_span` is one flag test and a shared no-op context.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import threading
from collections.abc import Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["measure_peak", "heap_in_use", "transients", "hook_span", "TransientPeaks"]


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


def _heap_reader() -> Callable[[], int] | None:
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


heap_in_use = _heap_reader()  # () -> bytes of the C heap in use, or None without glibc


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


@contextlib.contextmanager
def _peak(device: torch.device) -> Iterator[list]:
    """Yields a one-element list that holds, after the block, the peak bytes allocated above
    the level at entry (None where it cannot be measured)."""
    box: list = [None]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield box
        torch.cuda.synchronize(device)
        box[0] = torch.cuda.max_memory_allocated(device) - base
        return
    if heap_in_use is None:
        yield box
        return
    with _Sampler(heap_in_use) as sampler:
        yield box
    box[0] = sampler.peak - sampler.base


def measure_peak(fn: Callable[[], object], device: torch.device | str = "cpu") -> tuple[object, int | None]:
    """(fn(), peak bytes allocated above the level at the call) - measured, not estimated."""
    with _peak(torch.device(device)) as box:
        result = fn()
    return result, box[0]


class TransientPeaks:
    """The largest allocation peak seen per hook name while tracking was on."""

    def __init__(self) -> None:
        self.peaks: dict[str, int] = {}
        self._lock = threading.Lock()

    def record(self, name: str, nbytes: int | None) -> None:
        if nbytes is None:
            return
        with self._lock:
            self.peaks[name] = max(self.peaks.get(name, 0), nbytes)

    @property
    def largest(self) -> int:
        return max(self.peaks.values(), default=0)


_NULL = contextlib.nullcontext()
_active: TransientPeaks | None = None


@contextlib.contextmanager
def transients() -> Iterator[TransientPeaks]:
    """Measure the allocation peak of every sdpq hook run inside the block."""
    global _active
    prev, _active = _active, TransientPeaks()
    try:
        yield _active
    finally:
        _active = prev


def hook_span(name: str, device: torch.device | str = "cpu"):
    """Entered by every sdpq hook: measures its peak while `transients()` is on."""
    if _active is None:
        return _NULL
    return _span(_active, name, torch.device(device))


@contextlib.contextmanager
def _span(peaks: TransientPeaks, name: str, device: torch.device) -> Iterator[None]:
    with _peak(device) as box:
        yield
    peaks.record(name, box[0])
