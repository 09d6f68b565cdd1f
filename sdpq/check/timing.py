"""Median wall time of a callable on the check's device (CUDA events on the GPU)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["median_time"]


def median_time(fn: Callable[[], object], ctx, reps: int) -> float:
    """Seconds per call: one warm-up call (compiles a Triton kernel), then the median of reps."""
    fn()
    ctx.sync()
    times = []
    for _ in range(max(1, reps)):
        if ctx.rehearse:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        else:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)
