"""Emulated nodes: Linux network namespaces joined by a bridge, inter-node links shaped by tc.

Layout for K nodes (names carry a per-run tag so concurrent runs never collide):

    ns <tag>sw : bridge br0 with ports p0..p{K-1}
    ns <tag>n<i>: eth0 = 10.213.7.(i+1)/24, veth peer of port p<i>; loopback up

Every rank of node i runs inside ns <tag>n<i>. Traffic between ranks of one node is local to
the namespace (never shaped); traffic between nodes crosses two veth hops and the bridge. Both
directions are shaped with a token bucket (``tbf``) on the node's eth0 (egress) and on its
bridge port (ingress to the node). Only addresses inside these namespaces are used.

Note: the kernel here has no ``sch_netem``, so only bandwidth is shaped, not latency.
Teardown deletes the namespaces (which deletes their veths and bridge); it runs on normal exit,
on exceptions and on SIGINT/SIGTERM. ``cleanup_stale()`` removes leftovers of a killed run.
"""

from __future__ import annotations

import os
import re
import subprocess

__all__ = ["EmulatedNodes", "cleanup_stale", "SUBNET"]

SUBNET = "10.213.7"
_PREFIX = "sdpq"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _parse_rate(rate: str) -> str:
    if not re.fullmatch(r"\d+(\.\d+)?(kbit|mbit|gbit)", rate):
        raise ValueError(f"bandwidth {rate!r}; allowed: a number with kbit, mbit or gbit (e.g. 200mbit, 1gbit)")
    return rate


class EmulatedNodes:
    """Context manager creating ``nodes`` network namespaces with a shaped link between them."""

    def __init__(self, nodes: int, bandwidth: str | None = "1gbit", tag: str | None = None) -> None:
        if nodes < 1 or nodes > 200:
            raise ValueError(f"nodes={nodes}; allowed: 1..200")
        self.nodes = nodes
        self.bandwidth = _parse_rate(bandwidth) if bandwidth else None
        self.tag = tag or f"{_PREFIX}{os.getpid() % 100000}"
        self.created: list[str] = []

    def namespace(self, i: int) -> str:
        return f"{self.tag}n{i}"

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    @property
    def switch(self) -> str:
        return f"{self.tag}sw"

    def __enter__(self) -> "EmulatedNodes":
        try:
            self._create()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def _ns_add(self, name: str) -> None:
        _ip("netns", "add", name)
        self.created.append(name)

    def _create(self) -> None:
        sw = self.switch
        self._ns_add(sw)
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for i in range(self.nodes):
            ns = self.namespace(i)
            self._ns_add(ns)
            _ip("link", "add", f"{self.tag}v{i}", "netns", ns, "type", "veth", "peer", "name", f"p{i}", "netns", sw)
            _ip("-n", ns, "link", "set", f"{self.tag}v{i}", "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            for dev in ("lo", "eth0"):
                _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", sw, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", sw, "link", "set", f"p{i}", "up")
            if self.bandwidth:
                for where, dev in ((ns, "eth0"), (sw, f"p{i}")):
                    subprocess.run(
                        ["ip", "netns", "exec", where, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                         "rate", self.bandwidth, "burst", "256kb", "latency", "50ms"],
                        check=True, capture_output=True, text=True,
                    )

    def teardown(self) -> None:
        for name in reversed(self.created):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.created.clear()

    def exec_prefix(self, i: int) -> list[str]:
        """Command prefix that runs a program inside node i's namespace."""
        return ["ip", "netns", "exec", self.namespace(i)]


def cleanup_stale(prefix: str = _PREFIX) -> list[str]:
    """Delete namespaces left by a run that was killed with SIGKILL; returns their names."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = [line.split()[0] for line in out.splitlines() if re.match(rf"{prefix}\d+(sw|n\d+)\b", line)]
    for n in names:
        subprocess.run(["ip", "netns", "del", n], capture_output=True)
    return names
