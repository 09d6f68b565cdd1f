"""The device a process group's collectives take their tensors on.

A tensor handed to a collective must live where the group's backend can move it: NCCL only
takes CUDA tensors ("No backend type associated with device type cpu" otherwise), gloo takes
CPU tensors (and CUDA ones, slowly, through the host). Every buffer sdpq creates for a
collective (bookkeeping flags, agreement digests, gather outputs, decision tensors) is made on
`comm_device(group)`, never on the device of some unrelated tensor (the parameters may be
offloaded to the CPU while the group is NCCL) and never on a bare "cuda" (the current device
of this rank, not device 0).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .direct_group import DirectGroup

__all__ = ["comm_device"]


def _backend_name(group) -> str:
    """The backend of `group` as torch.distributed names it ("nccl", "gloo", or
    "cpu:gloo,cuda:nccl" for a group with one backend per device type)."""
    return str(dist.get_backend(group))


def _current_device(device_type: str) -> torch.device:
    """This rank's current device of an accelerator type (torch.cuda.current_device() for
    "cuda": the device the launcher selected with set_device, not device 0)."""
    return torch.device(device_type, torch.get_device_module(device_type).current_device())


def _device_type(backend: str) -> str:
    if ":" in backend:
        # One backend per device type (torch's default without an explicit backend on a GPU
        # machine): the accelerator's, since sdpq's data buffers live there.
        types = [part.split(":", 1)[0].strip() for part in backend.split(",")]
        accelerators = [t for t in types if t != "cpu"]
        return accelerators[0] if accelerators else "cpu"
    capability = dist.Backend.backend_capability.get(backend.lower())
    if not capability:
        known = ", ".join(sorted(dist.Backend.backend_capability))
        raise ValueError(
            f"sdpq: process group backend {backend!r} has no registered device types (known backends: {known}); "
            "register it with torch.distributed.Backend.register_backend(..., devices=[...])"
        )
    # Note: the first device a backend lists is the one it is built for: gloo, mpi, ucc -> cpu,
    # nccl -> cuda, xccl -> xpu.
    return capability[0]


def comm_device(group=None) -> torch.device:
    """The device of the tensors a collective on `group` (default: the world) takes.

    - NCCL (and any backend that only serves one accelerator type, e.g. xccl): this rank's
      current device of that type (``torch.cuda.current_device()``);
    - gloo, mpi, ucc (backends built for the host): the CPU;
    - a group with one backend per device type ("cpu:gloo,cuda:nccl"): the accelerator's;
    - a backend torch.distributed does not know: ValueError naming it;
    - a `DirectGroup` (not in torch.distributed's registry): the device it was built for.
    """
    if isinstance(group, DirectGroup):
        return group.device()
    device_type = _device_type(_backend_name(group))
    return torch.device("cpu") if device_type == "cpu" else _current_device(device_type)
