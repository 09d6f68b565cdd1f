"""A guard against host synchronisation in sdpq's hot path (the hooks FSDP2 and ZeRO-3 call on
every step, and the collectives they run).

On a GPU, reading a device tensor's value on the host (`Tensor.item()`, `bool(t)`, `float(t)`,
`int(t)`, `.tolist()`, `.numpy()`, `.cpu()`, `.to("cpu")` of a device tensor) waits for every
kernel queued before it: inside a communication hook that stalls the CPU thread that should be queueing the
next layer's work, and the overlap of communication and compute that FSDP2 and ZeRO-3 build
with their streams is lost. On CPU the same calls cost nothing, so CPU tests cannot see them by
timing; this guard makes them visible.

    with hot_path("FSDP2 reduce-scatter hook"):    # entered by the hooks themselves
        ...

is free while the guard is off (one flag test, a shared no-op context). Tests turn it on with
`enable_guard()` / `disable_guard()`, the `guard_enabled()` context, or the environment variable
`SDPQ_HOTPATH_GUARD=1` (read at import); every listed operation called inside a `hot_path` on
that thread then raises `HostSyncError` naming the operation and the hot path. Calls outside
any `hot_path` (the training loop, `sdpq.stats.summary()`, checkpoints) are never affected.

How: while enabled, the listed `torch.Tensor` methods are replaced by wrappers that check a
per-thread stack of the hot paths entered. Why not a `TorchFunctionMode`: a mode is popped while its handler runs
a function, so a sync inside a Python-level torch function (`torch.nn.functional.*`, a
`torch.distributed` wrapper) called from the hot path would go unseen, and entering a mode on
every hook call costs a stack push even where nothing is checked. Patching the methods of
`torch.Tensor` (a Python class over `torch._C.TensorBase`; `bool()`, `float()` and `int()` find
`__bool__` / `__float__` / `__int__` there) sees every call from Python, at any depth. It relies
only on those methods' names and on `Tensor.to`'s public argument forms, unchanged across torch
2.x (tested on 2.13; 2.11 - 2.15 are the releases sdpq's users run). Hooks run on the
autograd engine's device thread on CUDA; the depth is per thread, and each hook enters the guard
on the thread it runs on.

`host_read()` suspends the refusal for a read of a value that lives on the host on every device
(a CPU generator's draw, which a CUDA run never makes): CPU tests cannot tell it from a device
read, so the code says so where it makes one.

Where: here, below every layer, because the kernels' dispatch (`sdpq.kernels.dispatch`) makes
such a read; the hooks and collectives import it as `sdpq.comm.hotpath`.

What it does not see: syncs inside C++ operators (`torch.nonzero`, boolean-mask indexing).
Printing a tensor reads its values from Python and is seen.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = [
    "ENV_VAR",
    "HostSyncError",
    "hot_path",
    "host_read",
    "enable_guard",
    "disable_guard",
    "guard_enabled",
    "is_guard_enabled",
]

ENV_VAR = "SDPQ_HOTPATH_GUARD"


class HostSyncError(RuntimeError):
    """A host-synchronising tensor operation was called inside sdpq's hot path while the guard
    was enabled."""


_local = threading.local()  # .where: the names of the hot paths entered on this thread
_NULL = contextlib.nullcontext()
_enabled = False
# name -> torch.Tensor's own attribute of that name, or None where it inherits TensorBase's
_originals: dict[str, Callable[..., Any] | None] = {}
_lock = threading.Lock()


def _stack() -> list[str]:
    s = getattr(_local, "where", None)
    if s is None:
        s = _local.where = []
    return s


class _HotPath:
    __slots__ = ("where",)

    def __init__(self, where: str):
        self.where = where

    def __enter__(self) -> None:
        _stack().append(self.where)

    def __exit__(self, *exc: object) -> None:
        _stack().pop()


def hot_path(where: str) -> contextlib.AbstractContextManager[None]:
    """The context a hook or a collective's hot path runs in; `where` names it in the error.
    A shared no-op context while the guard is off."""
    if not _enabled:
        return _NULL
    return _HotPath(where)


def host_read() -> contextlib.AbstractContextManager[None]:
    """A read of a host-resident value inside a hot path (see the module docstring)."""
    if not _enabled:
        return _NULL
    return _HotPath("")  # an empty name: nothing is refused until it is left


def _refuse(op: str) -> None:
    s = getattr(_local, "where", None)
    if s and s[-1]:
        raise HostSyncError(
            f"{op} inside sdpq's hot path ({s[-1]}) synchronises the host with the device; keep the "
            "value on the device (torch.where, in-place flags) and read it where a sync is allowed"
        )


def _guarded(op: str, orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def wrapper(self, *args, **kwargs):
        _refuse(op)
        return orig(self, *args, **kwargs)

    return wrapper


def _target_device(args: tuple, kwargs: dict) -> torch.device | None:
    """The device a `Tensor.to(...)` call names, in any of its forms (device, "cpu", another
    tensor, positional or keyword); None when it names only a dtype."""
    for a in (kwargs.get("device"), kwargs.get("other"), *args):
        if isinstance(a, torch.Tensor):
            return a.device
        if isinstance(a, (str, torch.device)):
            return torch.device(a)
    return None


def _guarded_to(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def wrapper(self, *args, **kwargs):
        # Note: only a copy from another device to the host is refused. On a CPU tensor .to("cpu")
        # is a no-op, and code that moves a tensor to the device it computes on (`x.to(device)`,
        # the CPU in gloo tests) must pass: it is a host-to-device copy on a GPU.
        if getattr(_local, "where", None) and self.device.type != "cpu":
            device = _target_device(args, kwargs)
            if device is not None and device.type == "cpu":
                _refuse(f"Tensor.to({str(device)!r})")
        return orig(self, *args, **kwargs)

    return wrapper


# method name -> how the error names it
_METHODS = {
    "item": "Tensor.item()",
    "tolist": "Tensor.tolist()",
    "numpy": "Tensor.numpy()",
    "cpu": "Tensor.cpu()",
    "__bool__": "bool(tensor)",
    "__float__": "float(tensor)",
    "__int__": "int(tensor)",
}


def enable_guard() -> None:
    """Make the listed operations raise inside every `hot_path` (process-wide, until
    `disable_guard()`)."""
    global _enabled
    with _lock:
        if _enabled:
            return
        for name in (*_METHODS, "to"):
            _originals[name] = torch.Tensor.__dict__.get(name)
            orig = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, _guarded_to(orig) if name == "to" else _guarded(_METHODS[name], orig))
        _enabled = True


def disable_guard() -> None:
    """Restore torch.Tensor's own methods; `hot_path` is a no-op again."""
    global _enabled
    with _lock:
        if not _enabled:
            return
        _enabled = False
        for name, orig in _originals.items():
            # Note: most are inherited from TensorBase (deleting the wrapper restores them); a
            # release that defines one on torch.Tensor itself gets its own method back.
            if orig is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, orig)
        _originals.clear()


def is_guard_enabled() -> bool:
    return _enabled


@contextlib.contextmanager
def guard_enabled() -> Iterator[None]:
    """The guard on for a block (tests), restored to its previous state after it."""
    was = _enabled
    enable_guard()
    try:
        yield
    finally:
        if not was:
            disable_guard()


if os.environ.get(ENV_VAR, "").strip() not in ("", "0"):
    enable_guard()
