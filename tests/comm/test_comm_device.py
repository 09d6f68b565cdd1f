"""sdpq.comm.device.comm_device, and the test mode that checks collective tensors against it
(tests/collective_devices.py), on real gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as torch_dist
from collective_devices import STANDIN, CollectiveDeviceError, nccl_devices, on_standin

import sdpq.comm.device as device_module
from sdpq.comm import Topology
from sdpq.comm._exchange import all_gather_rows, group_device
from sdpq.comm.agreement import check_agreement
from sdpq.comm.device import comm_device


@pytest.mark.parametrize(
    ("backend", "device_type"),
    [("nccl", "cuda"), ("gloo", "cpu"), ("mpi", "cpu"), ("ucc", "cpu"), ("xccl", "xpu"),
     ("cpu:gloo,cuda:nccl", "cuda"), ("cpu:gloo", "cpu")],
)  # fmt: skip
def test_backend_to_device_type(backend, device_type):
    assert device_module._device_type(backend) == device_type


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match=r"backend 'carrier-pigeon' has no registered device types.*gloo"):
        device_module._device_type("carrier-pigeon")


def test_nccl_is_the_current_gpu_not_device_zero(monkeypatch):
    """NCCL: the device the launcher selected (torch.cuda.current_device()), not a bare "cuda"."""
    monkeypatch.setattr(device_module, "_backend_name", lambda group: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert comm_device(object()) == torch.device("cuda", 3)
    assert group_device(object()) == torch.device("cuda", 3)  # the name its callers use
    assert group_device(None) == torch.device("cpu")  # no group: no collective runs


def _gloo(ctx):
    return str(comm_device()), str(comm_device(torch_dist.group.WORLD)), str(comm_device(torch_dist.new_group([0, 1])))


def test_gloo_is_the_cpu(dist):
    assert dist.run(_gloo, 2, 1, timeout=30) == [("cpu", "cpu", "cpu")] * 2


def _mode(ctx):
    out = {}
    group = torch_dist.group.WORLD
    # sdpq's own set-up collectives (layout check, agreement) pass under the mode.
    with nccl_devices() as report:
        topo = Topology.build(2)
        check_agreement("test", {"a": 1}, topo.world_group)
        rows, _ = all_gather_rows(torch.full((3,), float(ctx.rank), device=comm_device(group)), group)
        out["rows"] = (on_standin(rows), rows[:, 0].tolist())
        torch_dist.all_reduce(torch.ones(1))  # the test's own collective: not sdpq's, not checked
    out["setup"] = (report.checked, report.unchecked)
    # A host tensor handed to an sdpq collective is reported (the collective still runs: no hang).
    try:
        with nccl_devices() as report:
            all_gather_rows(torch.ones(3), group)
        out["host"] = None
    except CollectiveDeviceError as e:
        out["host"] = str(e)
    return out


def test_mode_passes_sdpq_setup_and_catches_a_host_tensor(dist):
    for r in dist.run(_mode, 4, 2, timeout=30):
        assert r["rows"] == (True, [0.0, 1.0, 2.0, 3.0])
        checked, unchecked = r["setup"]
        assert checked >= 3 and unchecked >= 1
        assert r["host"] is not None and ("allgather" in r["host"] or "all_gather" in r["host"]), r["host"]
        assert "sdpq/comm/_exchange.py" in r["host"] and f"needs {STANDIN}" in r["host"]
