"""The hot-path guard: each host-synchronising operation raises inside `hot_path` while the guard
is enabled, and nothing changes while it is off or outside a hot path."""

from __future__ import annotations

import threading

import pytest
import torch

from sdpq.comm import hotpath
from sdpq.comm.hotpath import HostSyncError, guard_enabled, hot_path


def _meta_to(t, *args, **kwargs):
    """t on the meta device, then .to(*args, **kwargs): the guard sees a copy from a device to the
    host; past the guard, torch refuses to copy a meta tensor's (absent) data."""
    m = t.to("meta")
    try:
        m.to(*args, **kwargs)
    except NotImplementedError:  # not HostSyncError (a RuntimeError, not this subclass of it)
        pass


# (what the error names, the call)
SYNCS = [
    ("Tensor.item()", lambda t: t.item()),
    ("bool(tensor)", lambda t: bool(t)),
    ("float(tensor)", lambda t: float(t)),
    ("int(tensor)", lambda t: int(t)),
    ("Tensor.tolist()", lambda t: t.tolist()),
    ("Tensor.numpy()", lambda t: t.numpy()),
    ("Tensor.cpu()", lambda t: t.cpu()),
    # .to() to the host from another device (here "meta", whose copy to the CPU then fails)
    ("Tensor.to('cpu')", lambda t: _meta_to(t, "cpu")),
    ("Tensor.to('cpu')", lambda t: _meta_to(t, torch.device("cpu"), torch.float64)),
    ("Tensor.to('cpu')", lambda t: _meta_to(t, device="cpu", copy=True)),
    ("Tensor.to('cpu')", lambda t: _meta_to(t, torch.zeros(1))),  # like another tensor: on the CPU
    ("bool(tensor)", lambda t: 1 if t > 0 else 0),  # an `if` on a tensor
    ("bool(tensor)", lambda t: repr(t)),  # printing reads the values
]


@pytest.fixture
def guard():
    was = hotpath.is_guard_enabled()
    with guard_enabled():
        yield
    assert hotpath.is_guard_enabled() == was


@pytest.mark.parametrize("op,call", SYNCS, ids=[f"{i}-{s[0]}" for i, s in enumerate(SYNCS)])
def test_each_sync_raises_inside_the_hot_path(guard, op, call):
    t = torch.tensor(1.5)
    with hot_path("unit test hook"), pytest.raises(HostSyncError) as e:
        call(t)
    assert op in str(e.value) and "unit test hook" in str(e.value)
    call(t)  # outside the hot path: allowed (the wrappers pass through)


@pytest.mark.parametrize("op,call", SYNCS, ids=[f"{i}-{s[0]}" for i, s in enumerate(SYNCS)])
def test_off_is_a_no_op(op, call):
    assert not hotpath.is_guard_enabled()
    t = torch.tensor(1.5)
    with hot_path("unit test hook"):
        call(t)
    assert hot_path("a") is hot_path("b")  # one shared no-op context: nothing allocated per call


def test_device_work_is_allowed_and_the_guard_restores_torch(guard):
    t = torch.arange(6.0)
    with hot_path("unit test hook"):
        flag = torch.where(torch.isfinite(t).all(), t, float("nan"))  # flags stay on the device
        y = t.to(torch.float64).to(dtype=torch.bfloat16)  # dtype-only .to
        t.to("meta")
        t.to("cpu", copy=True)  # a CPU tensor "to the CPU": a copy on the host, no device involved
    assert torch.equal(flag, t) and y.dtype == torch.bfloat16


def test_disable_restores_tensor_methods():
    before = {n: torch.Tensor.__dict__.get(n) for n in ("item", "__bool__", "to", "cpu")}
    with guard_enabled():
        assert torch.Tensor.__dict__.get("item") is not None
    assert {n: torch.Tensor.__dict__.get(n) for n in before} == before


def test_nested_and_per_thread(guard):
    t = torch.tensor(2.0)
    with hot_path("outer"):
        with hot_path("inner"), pytest.raises(HostSyncError, match="inner"):
            t.item()
        with pytest.raises(HostSyncError, match="outer"):
            t.item()  # still inside the outer one
        seen = []
        # Another thread is not in this thread's hot path.
        th = threading.Thread(target=lambda: seen.append(t.item()))
        th.start()
        th.join()
        assert seen == [2.0]
    assert t.item() == 2.0


def test_host_read_suspends_the_refusal_only_inside_it(guard):
    t = torch.tensor(3.0)
    with hot_path("unit test hook"):
        with hotpath.host_read():
            assert t.item() == 3.0 and int(t) == 3
        with pytest.raises(HostSyncError):
            t.item()
    assert hotpath.host_read() is not None


def test_sampled_errors_accumulate_on_the_device_and_are_read_by_the_summary(guard):
    from sdpq.comm.stats import CommStats
    from sdpq.quant.groupwise import relative_error

    parent = CommStats()
    stats = CommStats(parent=parent)
    exact = torch.tensor([3.0, 4.0])
    with hot_path("unit test hook"):
        for approx in ([3.0, 4.5], [3.0, 4.0], [float("nan"), 4.0], [3.5, 4.0]):
            stats.record_error("gradients", "inter", relative_error(torch.tensor(approx), exact))
    stats.record_error("gradients", "inter", 0.2)  # a float from elsewhere still counts
    for s in (stats, parent):
        d = s.as_dict()["gradients"]["inter"]  # outside the hot path: the one read
        assert d["error_samples"] == 4  # the NaN sample (a skipped step) is counted apart
        assert d["relative_error_mean"] == pytest.approx((0.1 + 0.0 + 0.1 + 0.2) / 4)
        assert d["relative_error_max"] == pytest.approx(0.2)
    assert stats.counters[("gradients", "inter")].nonfinite_error_samples == 1
    stats.reset()
    assert stats.as_dict() == {}


def test_device_flag_is_raised_in_the_hot_path_and_read_outside(guard):
    from sdpq.comm.device_flag import DeviceFlag

    flag = DeviceFlag()
    assert not flag.pending and flag.take() is False
    with hot_path("unit test hook"):
        flag.raise_if(torch.tensor([False, False]))
        flag.raise_if(torch.tensor(False))
    assert flag.pending and flag.take() is False and not flag.pending
    with hot_path("unit test hook"):
        flag.raise_if(torch.isnan(torch.tensor([1.0, float("nan")])))
        flag.raise_if(torch.tensor(False))  # an OR: stays raised
        with pytest.raises(HostSyncError):
            flag.take()  # reading it is a sync
    assert flag.take() is True and flag.take() is False
