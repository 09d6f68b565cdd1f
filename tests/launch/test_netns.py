"""The emulated cluster: shaped link between namespaces, always torn down (needs root and iproute2)."""

import os
import shutil
import subprocess

import pytest

from sdpq.launch.emulated import measure_link
from sdpq.launch.netns import EmulatedNodes, cleanup_stale

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="network namespaces need root and iproute2",
)


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_shaped_link_and_teardown():
    with EmulatedNodes(2, "200mbit", tag="sdpq97001") as c:
        assert "sdpq97001n1" in _namespaces()
        mbit = measure_link(c, megabytes=8)
    assert 140 < mbit < 215, mbit  # tbf at 200 Mbit/s, TCP overhead below it
    assert "sdpq97001" not in _namespaces()


def test_torn_down_on_error_and_stale_cleanup():
    with pytest.raises(RuntimeError):
        with EmulatedNodes(2, None, tag="sdpq97002"):
            raise RuntimeError("job failed")
    assert "sdpq97002" not in _namespaces()
    subprocess.run(["ip", "netns", "add", "sdpq97003n0"], check=True)  # as if a run was SIGKILLed
    assert "sdpq97003n0" in cleanup_stale()
    assert "sdpq97003" not in _namespaces()


def test_bad_bandwidth_is_a_clear_error():
    with pytest.raises(ValueError, match="200mbps"):
        EmulatedNodes(2, "200mbps")
