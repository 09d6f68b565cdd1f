"""Communication statistics: bytes per link class and path, call counts, sampled errors.

Byte accounting model: sdpq/comm/traffic.py's, the one every count in sdpq uses (the same for
quantized and exact collectives, so ratios are fair). `inter` is the least cross-node traffic
of each collective (each node receives each foreign piece once), `ring_bytes` beside it what
NCCL's ring would move across nodes (context), `intra` the traffic inside nodes. sdpq's
hierarchical collectives cross nodes over groups with one member per node, where the least
traffic and the ring agree; the exact (baseline) collectives over the whole world are recorded
through the model (`Recorder.record_share`). Every byte of the wire buffer counts, codes,
padding and scales alike. `elements` counts the bucket elements those bytes carry (padding
excluded), so bits_per_element = 8 * bytes / elements is what crossed the link per useful value.

Sampled errors arrive as 0-d device tensors from inside the hot path (reading them there would
wait for the device): they are summed on their device and read on the host only when the figures
are (`as_dict`, `summary`, `table`), the one place statistics synchronise.

Counters are per process (per rank). Every collective records into one CommStats: the
process-wide one (`process_stats()`) unless given another; the integrations give each model /
engine its own, whose `parent` is the process-wide one, so two models in one process keep
apart and the process-wide figures still sum everything. Each integration registers where it
keeps a model's / engine's counters (`register_holder`); `holder_stats` asks them.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..config import StatsConfig
from . import traffic

__all__ = [
    "CommStats",
    "Recorder",
    "LinkCounters",
    "process_stats",
    "summary",
    "reset",
    "register_holder",
    "holder_stats",
    "PATHS",
    "LINKS",
]

PATHS = ("weights", "gradients")
LINKS = ("intra", "inter")


@dataclass
class LinkCounters:
    bytes: int = 0
    elements: int = 0
    calls: int = 0
    baseline_bytes: int = 0  # what the unquantized collective in the input dtype would send
    ring_bytes: int = 0  # what NCCL's ring would move on this link (context; see traffic.py)
    error_samples: int = 0
    error_sum: float = 0.0
    error_max: float = 0.0
    nonfinite_error_samples: int = 0
    # (device, stream) -> fp64 [error sum, finite samples, non-finite samples, error max], not yet read
    device_errors: dict = field(default_factory=dict, repr=False)

    def add_error(self, relative_error: float | torch.Tensor) -> None:
        if isinstance(relative_error, torch.Tensor):
            self._add_device_error(relative_error)
        elif not math.isfinite(relative_error):
            self.nonfinite_error_samples += 1  # a skipped (overflowing) step says nothing of accuracy
        else:
            self.error_samples += 1
            self.error_sum += relative_error
            self.error_max = max(self.error_max, relative_error)

    def _add_device_error(self, e: torch.Tensor) -> None:
        """Accumulate on e's device: no host read (see the module docstring)."""
        v = e.detach().reshape(()).to(torch.float64)
        # Note: one accumulator per CUDA stream: the hooks of one path run on several (FSDP2's
        # reduce-scatter and all-reduce streams), and an in-place sum shared between unordered
        # streams would lose samples.
        key = (v.device, torch.cuda.current_stream(v.device).stream_id if v.is_cuda else 0)
        finite = torch.isfinite(v)
        kept = torch.where(finite, v, 0.0)
        one = torch.ones((), dtype=torch.float64, device=v.device)
        upd = torch.stack((kept, torch.where(finite, one, 0.0), torch.where(finite, 0.0, one), kept))
        acc = self.device_errors.get(key)
        if acc is None:
            self.device_errors[key] = upd
        else:
            acc[:3] += upd[:3]
            torch.maximum(acc[3:], upd[3:], out=acc[3:])

    def settle(self) -> None:
        """Fold the device-side error sums into the host figures (reads the device: a sync)."""
        for device in {d for d, _ in self.device_errors if d.type == "cuda"}:
            torch.cuda.synchronize(device)  # every stream that added to them, not only this one
        for acc in self.device_errors.values():
            total, finite, nonfinite, top = acc.tolist()
            self.error_sum += total
            self.error_samples += int(finite)
            self.nonfinite_error_samples += int(nonfinite)
            if finite:
                self.error_max = max(self.error_max, top)
        self.device_errors.clear()

    def as_dict(self) -> dict:
        bpe = 8.0 * self.bytes / self.elements if self.elements else float("nan")
        base = 8.0 * self.baseline_bytes / self.elements if self.elements else float("nan")
        return {
            "bytes": self.bytes,
            "ring_bytes": self.ring_bytes,
            "elements": self.elements,
            "calls": self.calls,
            "bits_per_element": bpe,
            "baseline_bits_per_element": base,
            "compression": (self.baseline_bytes / self.bytes) if self.bytes else float("nan"),
            "error_samples": self.error_samples,
            "relative_error_mean": self.error_sum / self.error_samples if self.error_samples else float("nan"),
            "relative_error_max": self.error_max if self.error_samples else float("nan"),
        }


@dataclass
class CommStats:
    """Counters of bytes, elements, calls and sampled errors per (path, link). Collective objects
    record into one (default: `process_stats()`) and decide with a `Recorder` (their StatsConfig)
    what to record; `config` here is the default for objects created without a StatsConfig.
    Whatever is recorded here is also recorded into `parent` (if any)."""

    config: StatsConfig = field(default_factory=StatsConfig)
    counters: dict = field(default_factory=dict)
    parent: CommStats | None = None

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def _get(self, path: str, link: str) -> LinkCounters:
        if path not in PATHS or link not in LINKS:
            raise ValueError(f"unknown path/link {path!r}/{link!r}; allowed {PATHS} x {LINKS}")
        key = (path, link)
        if key not in self.counters:
            self.counters[key] = LinkCounters()
        return self.counters[key]

    def record(
        self,
        path: str,
        link: str,
        *,
        bytes: int,
        elements: int,
        baseline_bytes: int = 0,
        calls: int = 1,
        ring_bytes: int | None = None,
    ) -> None:
        """Add one collective's share. ring_bytes None: the same as bytes, which holds for every
        collective whose group has at most one member per node, and for all-to-alls (their rows
        are distinct data: traffic.py). World-wide exact collectives pass the model's figure."""
        ring = int(bytes) if ring_bytes is None else int(ring_bytes)
        with self._lock:
            c = self._get(path, link)
            c.bytes += int(bytes)
            c.ring_bytes += ring
            c.elements += int(elements)
            c.calls += calls
            c.baseline_bytes += int(baseline_bytes)
        if self.parent is not None:
            self.parent.record(
                path, link, bytes=bytes, elements=elements, baseline_bytes=baseline_bytes, calls=calls, ring_bytes=ring
            )

    def record_error(self, path: str, link: str, relative_error: float | torch.Tensor) -> None:
        """One sampled relative error: a float, or a 0-d tensor kept on its device until read."""
        with self._lock:
            self._get(path, link).add_error(relative_error)
        if self.parent is not None:
            self.parent.record_error(path, link, relative_error)

    def reset(self) -> None:
        """Clear these counters (not the parent's)."""
        with self._lock:
            self.counters.clear()

    def as_dict(self) -> dict:
        """{path: {link: {bytes, elements, calls, bits_per_element, ...}}} for recorded pairs.
        Reads the sampled errors still on the device (see the module docstring)."""
        out: dict = {}
        with self._lock:
            for c in self.counters.values():
                c.settle()
        for (path, link), c in sorted(self.counters.items()):
            out.setdefault(path, {})[link] = c.as_dict()
        return out

    def table(self) -> str:
        cols = [
            "path",
            "link",
            "calls",
            "MB sent",
            "ring MB",
            "bits/elem",
            "baseline bits/elem",
            "compression",
            "rel err mean",
            "rel err max",
        ]
        rows = [cols]
        for path, links in self.as_dict().items():
            for link, d in links.items():
                rows.append(
                    [
                        path,
                        link,
                        str(d["calls"]),
                        f"{d['bytes'] / 1e6:.3f}",
                        f"{d['ring_bytes'] / 1e6:.3f}",
                        f"{d['bits_per_element']:.3f}",
                        f"{d['baseline_bits_per_element']:.3f}",
                        f"{d['compression']:.2f}x",
                        f"{d['relative_error_mean']:.3g}",
                        f"{d['relative_error_max']:.3g}",
                    ]
                )
        widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
        lines = ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def summary(self) -> tuple[str, dict]:
        """(a printable table, the same figures as a dict)."""
        return self.table(), self.as_dict()


class Recorder:
    """What one collective object records, and where (its StatsConfig + a CommStats)."""

    def __init__(self, config: StatsConfig | None = None, stats: CommStats | None = None):
        self.stats = stats if stats is not None else _DEFAULT
        self.config = config if config is not None else self.stats.config
        self.enabled = self.config.enabled

    def sample_due(self, call_index: int) -> bool:
        """Whether the call with this (per-object, 0-based) index should measure its error."""
        every = self.config.error_sample_every
        return self.enabled and every > 0 and call_index % every == 0

    def record(self, path: str, link: str, **kw) -> None:
        if self.enabled:
            self.stats.record(path, link, **kw)

    def record_error(self, path: str, link: str, relative_error: float | torch.Tensor) -> None:
        if self.enabled:
            self.stats.record_error(path, link, relative_error)

    def record_share(self, path: str, wire: traffic.Traffic, elements: traffic.Traffic, itemsize: int) -> None:
        """One collective's share under the byte model: `wire` its bytes as sent, `elements` the
        same collective counted in elements (the model is linear), whose bytes in the plain
        dtype (`itemsize`) are the baseline."""
        if wire.inter:
            self.record(
                path,
                "inter",
                bytes=wire.inter,
                ring_bytes=wire.ring,
                elements=elements.inter,
                baseline_bytes=elements.inter * itemsize,
            )
        if wire.intra:
            self.record(
                path, "intra", bytes=wire.intra, elements=elements.intra, baseline_bytes=elements.intra * itemsize
            )

    def record_all_gather(self, path: str, topology, row_bytes: int, elements: int, itemsize: int) -> None:
        """A world all-gather of this rank's row over `topology` (a comm.topology.Topology):
        row_bytes on the wire for `elements` elements of `itemsize` bytes as plain, counted by the
        byte model (the row crosses into each other node once)."""
        nodes = traffic.member_nodes(range(topology.world_size), topology.ranks_per_node)
        me = topology.rank
        self.record_share(
            path, traffic.all_gather(nodes, me, row_bytes), traffic.all_gather(nodes, me, elements), itemsize
        )


_DEFAULT = CommStats()


def process_stats() -> CommStats:
    """The process-wide counters: what collectives record into unless given others, and the
    parent of every model's / engine's own."""
    return _DEFAULT


def summary() -> tuple[str, dict]:
    """(table, dict) of the process-wide counters (`sdpq.stats.summary()` with no target)."""
    return _DEFAULT.summary()


def reset() -> None:
    _DEFAULT.reset()


# Note: the collectives know no framework: each integration registers, when it is imported, a
# function that finds the counters it left on a target (an FSDP2 model, a DeepSpeed engine). A
# target exists only after its integration ran, so its finder is registered by then.
_HOLDERS: list[Callable[[object], CommStats | None]] = []


def register_holder(find: Callable[[object], CommStats | None]) -> None:
    """Register `find(target) -> CommStats | None`: the counters an integration keeps on `target`
    (None: not one of its targets). Registering the same function twice keeps one."""
    if find not in _HOLDERS:
        _HOLDERS.append(find)


def holder_stats(target: object) -> CommStats | None:
    """The counters a registered integration keeps on `target`, or None."""
    for find in _HOLDERS:
        stats = find(target)
        if isinstance(stats, CommStats):
            return stats
    return None


def sum_over_ranks(per_rank: list[dict]) -> dict:
    """Sum the `as_dict()` counters of several ranks (bytes, elements, calls, baseline bytes);
    bits per element recomputed from the sums (NaN where no element was counted)."""
    total: dict = {}
    for d in per_rank:
        for path, links in d.items():
            for link, c in links.items():
                t = total.setdefault(path, {}).setdefault(
                    link, {"bytes": 0, "ring_bytes": 0, "elements": 0, "calls": 0, "baseline_bytes": 0}
                )
                t["bytes"] += c["bytes"]
                t["ring_bytes"] += c["ring_bytes"]
                t["elements"] += c["elements"]
                t["calls"] += c["calls"]
                if c["elements"] and not math.isnan(c["baseline_bits_per_element"]):
                    t["baseline_bytes"] += round(c["baseline_bits_per_element"] * c["elements"] / 8)
    for links in total.values():
        for t in links.values():
            t["bits_per_element"] = 8 * t["bytes"] / t["elements"] if t["elements"] else float("nan")
    return total
