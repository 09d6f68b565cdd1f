"""A CPU test mode that catches tensors sdpq hands to a collective on the wrong device.

On a GPU cluster the process groups are NCCL, which only takes tensors on this rank's current
GPU: a CPU tensor fails with "No backend type associated with device type cpu". On this
CPU-only machine every tensor is on the CPU and gloo takes them all, so such bugs pass every
test. `nccl_devices()` makes them visible:

- the backend is reported as NCCL to `sdpq.comm.device.comm_device`, and "this rank's current
  GPU" is a stand-in accelerator, ``STANDIN = torch.device("cpu", 0)``: a device name distinct
  from the host's ``torch.device("cpu")`` (``STANDIN != torch.device("cpu")``), whose tensors
  are physically CPU tensors, so every CPU code path still runs;
- provenance tracking (a TorchFunctionMode) plays the device: a tensor asked for on STANDIN
  (``device=STANDIN`` in a factory call, ``.to(STANDIN)``, ``device=t.device`` of such a
  tensor) is tagged as living there, and so is every new tensor an operation computes from a
  tagged input (an accelerator operation's result stays on the accelerator); ``.device`` of a
  tagged tensor reports STANDIN. ``.to(STANDIN)`` of a host tensor copies it (as a host to
  device copy does), ``.to("cpu")`` / ``.cpu()`` of a tagged tensor copies it back untagged;
  ``p.data = t`` moves the tag with the data. In-place writes keep the destination's tag;
- every collective (the ProcessGroup methods that all torch.distributed collectives call:
  all_reduce, all_gather(_into_tensor), reduce_scatter(_tensor), all_to_all(_single),
  broadcast, gather, scatter, send, recv, reduce and their coalesced forms) called from sdpq's
  code checks every tensor it is handed: each must be tagged (on STANDIN). A tensor made on the
  host, or on the device of a host tensor (the parameters with CPU offload), fails the check:
  exactly what NCCL would refuse. The collective still runs (on gloo), so no rank is left
  waiting; the violations are raised as a `CollectiveDeviceError` when the mode exits.

Scope: collectives issued by DeepSpeed, by the test itself, or inside torch's object
collectives (``all_gather_object``: torch picks their device from the real backend) are counted
in ``report.unchecked``, not checked; a collective counts as sdpq's when the first caller frame
outside torch is in the sdpq package. Tensors computed by C++ (autograd's gradient formulas,
DeepSpeed's buffers on its CPU "accelerator") are host tensors here: sdpq must move what it
hands to a collective to the communication device itself, which on a GPU costs nothing. The
mode does not check that an operation's inputs share a device (DeepSpeed's CPU accelerator mixes
them); tests check restored state's device with `device_of` directly.

It is for the tests of a DeepSpeed engine, the optimizer guard and the collectives in one rank's
`dist.run` function (the mode is per thread and per process)::

    with nccl_devices() as report:
        engine.load_checkpoint(...)
    assert report.checked > 0
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

STANDIN = torch.device("cpu", 0)
HOST = torch.device("cpu")
_TAG = "_sdpq_on_standin"
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_SDPQ_DIR = os.path.dirname(os.path.abspath(__import__("sdpq").__file__)) + os.sep
_REPO_DIR = os.path.dirname(_SDPQ_DIR.rstrip(os.sep))
_COLLECTIVES = (
    "allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather", "_allgather_base",
    "all_gather_single", "allgather_coalesced", "allgather_into_tensor_coalesced",
    "all_gather_single_coalesced", "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single",
    "reduce_scatter_tensor_coalesced", "reduce_scatter_single_coalesced", "alltoall", "alltoall_base",
    "all_to_all_single", "gather", "scatter", "send", "recv",
)  # fmt: skip


class CollectiveDeviceError(AssertionError):
    """sdpq handed a collective a tensor that is not on the group's communication device."""


@dataclasses.dataclass
class Report:
    checked: int = 0  # sdpq's collectives whose tensors were checked
    unchecked: int = 0  # others (DeepSpeed's, the test's, torch's object collectives)
    violations: list[str] = dataclasses.field(default_factory=list)


def on_standin(t: torch.Tensor) -> bool:
    """Whether `t` lives on the stand-in accelerator (was asked for there, or computed from such)."""
    return bool(getattr(t, _TAG, False))


def device_of(t: torch.Tensor) -> torch.device:
    """Where `t` lives in the test mode: STANDIN or the host."""
    return STANDIN if on_standin(t) else HOST


def _tag(out: Any, inputs: set[int]) -> Any:
    for t in pytree.tree_leaves(out):
        if isinstance(t, torch.Tensor) and id(t) not in inputs:
            setattr(t, _TAG, True)
    return out


def _is_standin(device: Any) -> bool:
    return device is not None and torch.device(device) == STANDIN


class _Provenance(TorchFunctionMode):
    """Tags tensors that live on STANDIN (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if name in ("__get__", "__set__"):
            attr = getattr(getattr(func, "__self__", None), "__name__", "")
            if name == "__get__" and attr == "device" and on_standin(args[0]):
                return STANDIN
            if name == "__set__" and attr == "data":
                func(*args, **kwargs)
                setattr(args[0], _TAG, on_standin(args[1]))
                return None
        if func is torch.Tensor.to:
            return self._to(args[0], args[1:], kwargs)
        if func is torch.Tensor.cpu:
            return args[0].clone() if on_standin(args[0]) else func(*args, **kwargs)
        if func in (torch.Tensor.backward, torch.autograd.backward):
            return self._backward(func, args, kwargs)
        if "device" in kwargs and kwargs["device"] is not None:
            standin = _is_standin(kwargs["device"])
            if standin:
                kwargs["device"] = HOST
            out = func(*args, **kwargs)
            return _tag(out, set()) if standin else out
        leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        out = func(*args, **kwargs)
        if any(on_standin(t) for t in leaves):
            _tag(out, {id(t) for t in leaves})
        return out

    def _to(self, t: torch.Tensor, args: tuple, kwargs: dict):
        copy = kwargs.pop("copy", False)
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if isinstance(args[0] if args else None, torch.Tensor) and on_standin(args[0]):
            device = STANDIN  # .to(other): other's device
        keep = {"dtype": dtype, "non_blocking": non_blocking, "copy": copy}
        if memory_format is not None:
            keep["memory_format"] = memory_format
        if device is None:  # a dtype change: stays where it is
            out = t.to(**keep)
            return _tag(out, {id(t)}) if on_standin(t) else out
        if _is_standin(device):
            if on_standin(t):
                return t.to(**keep)
            out = t.to(HOST, **{**keep, "copy": True})  # host -> accelerator: a copy
            return _tag(out, set())
        return t.to(device, **{**keep, "copy": keep["copy"] or on_standin(t)})  # -> host: untagged copy

    def _backward(self, func, args, kwargs):
        """Run autograd's engine with this mode active, so that the hooks it calls (DeepSpeed's
        gradient reduction, hence sdpq's) see tagged tensors as the rest of the step does."""
        from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
        from torch.autograd.graph import _engine_run_backward

        if func is torch.Tensor.backward:
            names = ("gradient", "retain_graph", "create_graph", "inputs")
            bound = dict(zip(names, args[1:]), **kwargs)
            tensors, grads = (args[0],), bound.get("gradient")
        else:
            names = ("tensors", "grad_tensors", "retain_graph", "create_graph", "grad_variables", "inputs")
            bound = dict(zip(names, args), **kwargs)
            tensors, grads = bound["tensors"], bound.get("grad_tensors")
            tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
        inputs = bound.get("inputs")
        inputs = () if inputs is None else ((inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs))
        create = bool(bound.get("create_graph", False))
        retain = bound.get("retain_graph")
        with self:
            grads_ = _make_grads(tensors, _tensor_or_tensors_to_tuple(grads, len(tensors)), is_grads_batched=False)
            _engine_run_backward(
                tensors, grads_, create if retain is None else retain, create, inputs,
                allow_unreachable=True, accumulate_grad=True,
            )  # fmt: skip


def _caller() -> tuple[str | None, bool]:
    """(the first frame outside torch as "file:line (function)" when it is sdpq's, None
    otherwise; whether the call comes from one of torch's object collectives)."""
    frame = sys._getframe(2)
    object_collective = False
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_TORCH_DIR) and path != __file__:  # (torch.distributed's
            # list collectives dispatch through __torch_function__, hence through this module)
            where = f"{os.path.relpath(path, _REPO_DIR)}:{frame.f_lineno} ({frame.f_code.co_name})"
            return (where if path.startswith(_SDPQ_DIR) else None), object_collective
        object_collective = object_collective or "_object" in frame.f_code.co_name
        frame = frame.f_back
    return None, object_collective


def _checked(method: str, orig, report: Report):
    def collective(pg, *args, **kwargs):
        where, object_collective = _caller()
        if where is None or object_collective:
            report.unchecked += 1
        else:
            report.checked += 1
            for t in pytree.tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and not on_standin(t):
                    report.violations.append(
                        f"{method} from {where}: a {tuple(t.shape)} {t.dtype} tensor on {HOST}, but the group's "
                        f"backend (reported as nccl) needs {STANDIN}"
                    )
        return orig(pg, *args, **kwargs)

    return collective


@contextlib.contextmanager
def nccl_devices():
    """The test mode of the module docstring; yields its `Report`. Raises CollectiveDeviceError
    at exit (when the body raised nothing else) if sdpq handed a collective a tensor that is not
    on the group's communication device."""
    import torch.distributed as dist

    import sdpq.comm.device as comm_device_module

    pg_class = dist.ProcessGroup
    report = Report()
    saved_pg = {m: pg_class.__dict__[m] for m in _COLLECTIVES if m in pg_class.__dict__}
    saved_device = (comm_device_module._backend_name, comm_device_module._current_device)
    try:
        for m, orig in saved_pg.items():
            setattr(pg_class, m, _checked(m, orig, report))
        comm_device_module._backend_name = lambda group: "nccl"  # type: ignore[assignment]
        comm_device_module._current_device = lambda device_type: STANDIN  # type: ignore[assignment]
        with _Provenance():
            yield report
    finally:
        for m, orig in saved_pg.items():
            setattr(pg_class, m, orig)
        comm_device_module._backend_name, comm_device_module._current_device = saved_device
    if report.violations:
        shown = "\n  ".join(report.violations[:10])
        more = f"\n  ... and {len(report.violations) - 10} more" if len(report.violations) > 10 else ""
        raise CollectiveDeviceError(f"{len(report.violations)} collective tensor(s) off the device:\n  {shown}{more}")
