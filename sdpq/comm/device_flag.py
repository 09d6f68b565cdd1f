"""A yes/no decided on the device inside the hot path and read on the host later, where a sync is
allowed (`sdpq.comm.hotpath`).

    flag.raise_if(nonfinite)     # hot path: an OR on the device, nothing read
    ...
    if flag.take():              # later, outside the hot path: the host learns the answer
        ...

On CUDA, `raise_if` also queues a copy of the flag into pinned host memory and records an event
behind it, so `take` waits for that event only, not for everything queued since: called a step
later, the event has long completed and `take` costs no wait. On CPU the value is read directly.

Note: the flag is the same on every rank that computes it from the same gathered bytes, so ranks
that act on `take()` at the same point of the call sequence take the same decision, as
collectives require.
"""

from __future__ import annotations

import torch

__all__ = ["DeviceFlag"]


class DeviceFlag:
    """An OR of boolean 0-d tensors, read and cleared by `take()`."""

    __slots__ = ("_value", "_host", "_event")

    def __init__(self, device: torch.device | str | None = None) -> None:
        self._value: torch.Tensor | None = None  # bool, on the device
        self._host: torch.Tensor | None = None  # CUDA: pinned copy of _value
        self._event: torch.cuda.Event | None = None
        if device is not None and torch.device(device).type == "cuda":
            # Note: pinned at construction (outside the hot path): a first pinned allocation may
            # wait for the device, a copy into an allocated one does not.
            self._host = torch.empty((), dtype=torch.bool, pin_memory=True)

    def tensors(self) -> tuple:
        """The tensors this flag keeps (None where not made yet)."""
        return (self._value, self._host)

    @property
    def pending(self) -> bool:
        """Whether a value was raised since the last take() (known on the host, no read)."""
        return self._value is not None

    def raise_if(self, condition: torch.Tensor) -> None:
        """OR `condition` (a boolean tensor, any shape: any element) into the flag, on its device."""
        c = condition.detach().any()
        self._value = c if self._value is None else self._value | c
        if c.is_cuda:
            if self._host is None:
                self._host = torch.empty((), dtype=torch.bool, pin_memory=True)
            self._host.copy_(self._value, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()  # on the current stream, behind the copy

    def take(self) -> bool:
        """The flag's value (False when nothing was raised), then cleared. Not for the hot path."""
        if self._value is None:
            return False
        if self._event is not None and self._host is not None:
            self._event.synchronize()
            result = bool(self._host)
        else:
            result = bool(self._value)
        self.clear()  # after the read: a read that raised leaves the flag as it was
        return result

    def clear(self) -> None:
        self._value = None
        self._event = None
