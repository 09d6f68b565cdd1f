"""What a weight reference's refreshes learn about it, kept on the device and read between steps:
a non-finite weight reached it, or its holders disagree (a checksum compared every
`weights.verify_every` refreshes). Either makes the next refresh an exact one.

Note (hot path): refreshes run inside the hooks, where reading a device value would wait for the
GPU; they only raise `DeviceFlag`s. `settle()` reads them, outside the hooks (the weights'
`mark_weights_changed`). Every holder computes the flags from the same gathered bytes, so all of
them take the same decision.
"""

from __future__ import annotations

import warnings

import torch

from . import timing
from ._exchange import all_gather_rows
from .device_flag import DeviceFlag
from .stats import Recorder
from .topology import Topology

__all__ = ["ReferenceHealth", "ReferenceMismatchWarning", "checksum"]


class ReferenceMismatchWarning(RuntimeWarning):
    """verify_every found holders of one reference disagreeing; the next refresh resyncs it exactly."""


_CHECKSUM_CHUNK = 1 << 24  # bytes per pass: int64 copies of 16 M bytes at most, whatever t's size


def checksum(t: torch.Tensor) -> torch.Tensor:
    """Two int64 sums of the raw bytes (plain and position-weighted): equal on bitwise-equal
    tensors, different on virtually any corruption (a flipped bit changes the plain sum). Taken
    in chunks, so that a whole model's weights (ZeRO-1/2's flat groups) need no int64 copy."""
    raw = t.contiguous().view(torch.uint8).flatten()
    out = torch.zeros(2, dtype=torch.int64, device=t.device)
    for a in range(0, raw.numel(), _CHECKSUM_CHUNK):
        bits = raw[a : a + _CHECKSUM_CHUNK].to(torch.int64)
        weights = torch.arange(a, a + bits.numel(), dtype=torch.int64, device=t.device) % 65521 + 1
        out += torch.stack((bits.sum(), (bits * weights).sum()))
    return out


class ReferenceHealth:
    """The device flags of one reference (see the module docstring)."""

    def __init__(self, topology: Topology, device: torch.device, recorder: Recorder):
        self.topology, self._rec = topology, recorder
        self._nonfinite = DeviceFlag(device)
        self._mismatched = DeviceFlag(device)
        self._sums: torch.Tensor | None = None  # the checksums behind _mismatched

    def flag_nonfinite(self, condition: torch.Tensor) -> None:
        """A refresh decoded a non-finite group (0-d bool on the device)."""
        self._nonfinite.raise_if(condition)

    def verify(self, storage: torch.Tensor) -> None:
        """Compare the checksum of the reference's storage across its holders (the inter-node
        group), on the device."""
        topo = self.topology
        with timing.span("comm.weights"):
            sums, _ = all_gather_rows(checksum(storage), topo.inter_group)
        self._rec.record("weights", "inter", bytes=(topo.nodes - 1) * 16, elements=0)
        self._sums = sums
        self._mismatched.raise_if(sums != sums[0])

    def settle(self) -> bool:
        """Read the flags (a sync: never in the hot path): whether the next refresh must be exact.
        Warns (ReferenceMismatchWarning) when the holders disagreed."""
        exact = self._nonfinite.take()
        if self._mismatched.take():
            sums = self._sums
            warnings.warn(
                f"sdpq: the weight reference of local index {self.topology.local_rank} differs between "
                f"nodes (checksums {None if sums is None else sums.tolist()}); the next refresh "
                "resyncs it exactly",
                ReferenceMismatchWarning,
                stacklevel=3,
            )
            exact = True
        self._sums = None
        return exact

    def clear(self) -> None:
        """Forget what was flagged (the reference was replaced)."""
        self._nonfinite.clear()
        self._mismatched.clear()
        self._sums = None

    def tensors(self) -> list[torch.Tensor]:
        """The tensors the flags keep (for sdpq.memory)."""
        out = [*self._nonfinite.tensors(), *self._mismatched.tensors(), self._sums]
        return [t for t in out if t is not None]
