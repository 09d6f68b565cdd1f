"""Wall time of a callable on the check's device (CUDA events on the GPU).

Two ways to time a kernel:

- ``median_time``: one call per pair of events. The host's work for that launch (Triton's
  launcher, the wrapper's allocations and its flag's ``torch.zeros``) runs between the events,
  so a call that the GPU finishes in less time than the host takes to issue it is billed for the
  host. Kept for steps whose unit is "one call as the training loop makes it".
- ``device_time``: ``launches`` calls back to back between one pair of events, the time divided
  by ``launches``. The queue fills while the first calls run, so what is measured is the GPU's
  time per call once the host keeps ahead: what a kernel costs inside a training step, where
  the host is already ahead. A plain copy is timed the same way for the ratios.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["device_time", "median_time"]


def _event_pair_seconds(fn: Callable[[], object], calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _timed(fn: Callable[[], object], ctx, reps: int, calls: int) -> float:
    fn()  # warm-up: compiles a Triton kernel, fills the caching allocator
    ctx.sync()
    times = []
    for _ in range(max(1, reps)):
        if ctx.rehearse:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append(time.perf_counter() - t0)
        else:
            times.append(_event_pair_seconds(fn, calls))
    return statistics.median(times) / calls


def median_time(fn: Callable[[], object], ctx, reps: int) -> float:
    """Seconds per call, one call per event pair: the median of reps after one warm-up call."""
    return _timed(fn, ctx, reps, calls=1)


def device_time(fn: Callable[[], object], ctx, reps: int = 5, launches: int = 20) -> float:
    """Seconds per call, `launches` calls back to back per event pair: the median of reps."""
    return _timed(fn, ctx, reps, calls=launches if not ctx.rehearse else 1)
