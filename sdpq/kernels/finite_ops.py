"""``torch.ops.sdpq.first_nonfinite(tensors) -> int``: the index of the first tensor of a list
that holds an inf or a NaN, -1 when none does (empty tensors count as finite; the list must hold
at least one tensor, which picks the kernel).

    CPU    C++ (``sdpq/csrc/finite.cpp``, built at first use by ``native``): one scan of each
           tensor's bits, one call for the whole list

It answers on the host (an int), so it is for host-side decisions such as the optimizer's
skip-step guard (``sdpq.optim.guard``), which keeps its device-side torch check elsewhere and
where the kernel cannot be built.
"""

from __future__ import annotations

import torch

from . import native

__all__ = ["cpu_available"]

_LIB = torch.library.Library("sdpq", "FRAGMENT")  # noqa: TOR901 (the guard's share of the namespace)
_LIB.define("first_nonfinite(Tensor[] tensors) -> int")


def cpu_available() -> bool:
    """The C++ kernel is registered for CPU tensors (built now if needed)."""
    return native.load("finite")
