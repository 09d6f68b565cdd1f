"""Wall-clock spans for `sdpq bench step`: where a training step's time goes.

    from sdpq.comm import timing
    with timing.span("grads.encode"):
        ...

Off by default, and then `span()` returns one shared no-op object: the cost at a call site is a
global read and two empty method calls (no clock read, no allocation). `enable()` turns it on
for the process; `take()` returns what was recorded since the last `take()`/`reset()` and
clears it (the training loop calls it once per step).

Per label the record is [inclusive seconds, self seconds, calls]. Spans nest: a span's *self*
time excludes the spans opened inside it (on the same thread), so the self times of all spans
inside an outer span add up exactly to that span's inclusive time. Nesting is tracked per
thread; a span on another thread is recorded but subtracted from no parent.

The clock is `time.perf_counter` on the host: on CPU that is the work itself; for CUDA tensors it
is the time to *launch* the work (kernels run asynchronously), so the split is meaningful on CPU.

`instrument(module, names)` wraps the collectives of a framework's comm module (e.g.
`torch.distributed`, `deepspeed.comm`) in "comm.other" spans, so the framework's own
collectives count as communication like sdpq's: a synchronous call is timed whole; an
asynchronous one is timed at issue and, where `wrap_work=True`, its handle's `wait()` too. A
collective called inside another "comm.*" span is not timed again.
"""

from __future__ import annotations

import functools
import threading
import time

__all__ = ["span", "enable", "disable", "enabled", "reset", "take", "snapshot", "instrument", "COMM_PREFIX"]

COMM_PREFIX = "comm."
_clock = time.perf_counter
_enabled = False
_lock = threading.Lock()
_records: dict[str, list] = {}  # label -> [inclusive s, self s, calls]
_local = threading.local()


def _stack() -> list:
    s = getattr(_local, "stack", None)
    if s is None:
        s = _local.stack = []
    return s


class _Span:
    __slots__ = ("label", "t0", "child")

    def __init__(self, label: str):
        self.label = label
        self.child = 0.0

    def __enter__(self):
        _stack().append(self)
        self.t0 = _clock()
        return self

    def __exit__(self, *exc) -> None:
        dt = _clock() - self.t0
        stack = _stack()
        stack.pop()
        if stack:
            stack[-1].child += dt
        with _lock:
            rec = _records.get(self.label)
            if rec is None:
                _records[self.label] = [dt, dt - self.child, 1]
            else:
                rec[0] += dt
                rec[1] += dt - self.child
                rec[2] += 1


class _NoSpan:
    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


_NO_SPAN = _NoSpan()


def span(label: str):
    """A context manager timing its body under `label` (a no-op while timing is off)."""
    return _Span(label) if _enabled else _NO_SPAN


def enable(on: bool = True) -> bool:
    """Turn timing on (or off with on=False) for this process; returns the previous setting."""
    global _enabled
    prev, _enabled = _enabled, bool(on)
    return prev


def disable() -> bool:
    return enable(False)


def enabled() -> bool:
    return _enabled


def reset() -> None:
    with _lock:
        _records.clear()


def snapshot() -> dict[str, list]:
    """{label: [inclusive s, self s, calls]} recorded so far (a copy)."""
    with _lock:
        return {k: list(v) for k, v in _records.items()}


def take() -> dict[str, list]:
    """snapshot() and reset() in one step."""
    with _lock:
        out = {k: list(v) for k, v in _records.items()}
        _records.clear()
    return out


def _in_comm() -> bool:
    s = getattr(_local, "stack", None)
    return bool(s) and s is not None and s[-1].label.startswith(COMM_PREFIX)


class _TimedWork:
    """A collective's handle whose wait() is timed as communication; everything else delegates."""

    def __init__(self, work, label: str):
        self._work = work
        self._label = label

    def wait(self, *args, **kwargs):
        if not _enabled or _in_comm():
            return self._work.wait(*args, **kwargs)
        with _Span(self._label):
            return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


def _timed(fn, label: str, wrap_work: bool):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not _enabled or _in_comm():
            return fn(*args, **kwargs)
        with _Span(label):
            out = fn(*args, **kwargs)
        if wrap_work and out is not None and hasattr(out, "wait"):
            return _TimedWork(out, label)
        return out

    wrapper.__sdpq_timed__ = fn  # type: ignore[attr-defined]  # marks (and undoes) the wrapping
    return wrapper


def instrument(module, names, *, label: str = "comm.other", wrap_work: bool = False):
    """Wrap `module.<name>` for every name it has in "comm.other" spans (see the module doc).
    wrap_work: also time the returned handle's wait() (the handle is then a proxy object, which
    code that checks `isinstance(work, dist.Work)`, like FSDP2, would not accept). Returns a
    function that restores the originals."""
    saved = []
    for name in names:
        fn = getattr(module, name, None)
        if fn is None or not callable(fn) or hasattr(fn, "__sdpq_timed__"):
            continue
        saved.append((name, fn))
        setattr(module, name, _timed(fn, label, wrap_work))

    def undo() -> None:
        for name, fn in saved:
            setattr(module, name, fn)

    return undo
