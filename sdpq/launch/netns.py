"""Emulated nodes: Linux network namespaces joined by a bridge, inter-node links shaped by tc.

Layout for K nodes (names carry a per-run tag so concurrent runs never collide):

    ns <tag>sw : bridge br0 with ports p0..p{K-1}
    ns <tag>n<i>: eth0 = 10.213.7.(i+1)/24, veth peer of port p<i>; loopback up

Every rank of node i runs inside ns <tag>n<i>. Traffic between ranks of one node is local to
the namespace (never shaped); traffic between nodes crosses two veth hops and the bridge. Both
directions are shaped with a token bucket (``tbf``) on the node's eth0 (egress) and on its
bridge port (ingress to the node). Only addresses inside these namespaces are used.

One-way latency (``latency="2ms"``) is a ``netem`` qdisc on each node's eth0 with the ``tbf``
beneath it. Note: the kernel of our CI machines has no ``sch_netem`` (nor ``fq``/``etf``, the
other ways to delay packets), so there only bandwidth can be shaped; asking for latency there
fails with an error that says so, before any job starts.
Teardown deletes the namespaces (which deletes their veths and bridge); it runs on normal exit,
on exceptions and on SIGINT/SIGTERM. ``cleanup_stale()`` removes leftovers of a killed run.
"""

from __future__ import annotations

import json
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


def _parse_delay(delay: str) -> str:
    if not re.fullmatch(r"\d+(\.\d+)?(us|ms)", delay):
        raise ValueError(f"latency {delay!r}; allowed: a number with us or ms (e.g. 500us, 2ms)")
    return delay


def _tc(ns: str, *args: str) -> None:
    r = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", *args], capture_output=True, text=True)
    if r.returncode != 0:
        kind = "netem" if "netem" in args else args[args.index("root") + 1 if "root" in args else -1]
        hint = " (this kernel has no sch_netem: only --bandwidth can be emulated here)" if kind == "netem" else ""
        raise RuntimeError(f"tc qdisc add {' '.join(args)} failed: {r.stderr.strip()}{hint}")


class EmulatedNodes:
    """Context manager creating ``nodes`` network namespaces with a shaped link between them."""

    def __init__(
        self, nodes: int, bandwidth: str | None = "1gbit", tag: str | None = None, latency: str | None = None
    ) -> None:
        if nodes < 1 or nodes > 200:
            raise ValueError(f"nodes={nodes}; allowed: 1..200")
        self.nodes = nodes
        self.bandwidth = _parse_rate(bandwidth) if bandwidth else None
        self.latency = _parse_delay(latency) if latency else None
        self.tag = tag or f"{_PREFIX}{os.getpid() % 100000}"
        self.created: list[str] = []

    def namespace(self, i: int) -> str:
        return f"{self.tag}n{i}"

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    @property
    def switch(self) -> str:
        return f"{self.tag}sw"

    def __enter__(self) -> EmulatedNodes:
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
            tbf = ["tbf", "rate", self.bandwidth, "burst", "256kb", "latency", "50ms"] if self.bandwidth else None
            if self.latency:  # netem delays node i's egress; the rate limit sits beneath it
                _tc(ns, "dev", "eth0", "root", "handle", "1:", "netem", "delay", self.latency, "limit", "100000")
                if tbf:
                    _tc(ns, "dev", "eth0", "parent", "1:1", "handle", "10:", *tbf)
            elif tbf:
                _tc(ns, "dev", "eth0", "root", *tbf)
            if tbf:
                _tc(sw, "dev", f"p{i}", "root", *tbf)

    def teardown(self) -> None:
        for name in reversed(self.created):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.created.clear()

    def exec_prefix(self, i: int) -> list[str]:
        """Command prefix that runs a program inside node i's namespace."""
        return ["ip", "netns", "exec", self.namespace(i)]

    def link_bytes(self) -> int:
        """Bytes sent across the inter-node link so far (sum of every node's eth0 tx counter:
        each inter-node packet leaves exactly one node; traffic within a node never uses eth0)."""
        total = 0
        for i in range(self.nodes):
            out = subprocess.run(
                ["ip", "-n", self.namespace(i), "-j", "-s", "link", "show", "eth0"],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            total += json.loads(out)[0]["stats64"]["tx"]["bytes"]
        return total


def cleanup_stale(prefix: str = _PREFIX) -> list[str]:
    """Delete namespaces left by a run that was killed with SIGKILL; returns their names."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = [line.split()[0] for line in out.splitlines() if re.match(rf"{prefix}\d+(sw|n\d+)\b", line)]
    for n in names:
        subprocess.run(["ip", "netns", "del", n], capture_output=True)
    return names
