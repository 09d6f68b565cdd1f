"""Bytes each rank puts on the intra- and inter-node links, counted at the process-group level.

Every torch.distributed collective, whoever calls it (DeepSpeed's ``deepspeed.comm`` with its
function references bound at start-up, sdpq's ``_exchange`` helpers, torch internals), ends in a
method of the ``ProcessGroup`` it runs on (``group.all_gather_single(...)``,
``group.all_to_all_single(...)``...). ``LinkBytes`` wraps those methods on the class while
installed, so every transfer is seen exactly once, with the group's real member ranks: torch's
deprecated names (``_allgather_base``, ``_reduce_scatter_base``) are the same C++ methods the new
ones call, and a Python wrapper around ``dist.*`` never reaches this level twice.

Accounting model: the one of ``sdpq/comm/traffic.py`` (the same one sdpq's own statistics and
``sdpq plan`` use). For each collective on its group it files this rank's share of

- ``inter``: the least cross-node traffic any algorithm of that collective must move (each node
  receives each foreign piece once; partial sums leave a node once);
- ``inter_ring``: what NCCL's ring moves across nodes (context);
- ``intra``: the ring's traffic inside nodes (or the rows sent to node-mates).

Nodes are ``rank // ranks_per_node`` (the simulated node boundary). Collectives are filed by
kind: ``weights`` (all-gathers), ``gradients`` (reduce-scatters and all-to-alls), ``other``
(all-reduce, broadcast, ...). Counters are per process; ``sum_over_ranks`` adds every rank's for
the job's total.

Not seen: DDP's built-in all-reduce runs inside its C++ reducer and never calls a Python
``ProcessGroup`` method. Count DDP through a comm hook (torch's ``allreduce_hook`` is the same
all-reduce in Python); sdpq's DDP hook is counted like any other collective.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import traffic

__all__ = ["LinkBytes", "PATH_OF", "LINKS", "sum_over_ranks"]

LINKS = ("inter", "inter_ring", "intra")

# ProcessGroup method -> path. Names are torch 2.13's (all_gather_single & co. were _allgather_base).
PATH_OF = {
    "all_gather_single": "weights",
    "_allgather_base": "weights",
    "allgather": "weights",
    "allgather_coalesced": "weights",
    "all_gather_single_coalesced": "weights",
    "allgather_into_tensor_coalesced": "weights",
    "reduce_scatter_single": "gradients",
    "_reduce_scatter_base": "gradients",
    "reduce_scatter": "gradients",
    "reduce_scatter_single_coalesced": "gradients",
    "reduce_scatter_tensor_coalesced": "gradients",
    "all_to_all_single": "gradients",
    "alltoall_base": "gradients",
    "alltoall": "gradients",
    "allreduce": "other",
    "allreduce_coalesced": "other",
    "broadcast": "other",
    "reduce": "other",
    "gather": "other",
    "scatter": "other",
    "send": "other",
}


def _nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    return sum(_nbytes(x) for x in t)


def _flat(ts) -> list:
    out = []
    for t in ts:
        out.extend(_flat(t) if isinstance(t, (list, tuple)) else [t])
    return out


def _split_bytes(inp, splits: list, k: int) -> list[int]:
    if not splits:
        return [_nbytes(inp) // k] * k
    row = _nbytes(inp) // max(1, inp.shape[0]) if inp.dim() else 0
    return [int(s) * row for s in splits]


def _traffic(method: str, nodes: tuple[int, ...], me: int, args: tuple) -> traffic.Traffic:
    """Group rank `me`'s share of one call of `method` (positional arguments as torch 2.13
    passes them) under sdpq/comm/traffic.py's model."""
    k = len(nodes)
    if method in ("all_gather_single", "_allgather_base"):  # (output, input, opts)
        return traffic.all_gather(nodes, me, _nbytes(args[1]))
    if method in (
        "allgather",
        "allgather_coalesced",
        "all_gather_single_coalesced",
        "allgather_into_tensor_coalesced",
    ):  # (outputs, inputs, opts): every input goes to every member
        return traffic.all_gather(nodes, me, _nbytes(_flat(args[1])))
    if method in ("reduce_scatter_single", "_reduce_scatter_base"):  # (output, input, opts)
        return traffic.reduce_scatter(nodes, me, _nbytes(args[1]) // k)
    if method in ("reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced"):
        return traffic.reduce_scatter(nodes, me, _nbytes(_flat(args[1])) // k)
    if method == "reduce_scatter":  # (outputs, [input list per output], opts)
        return traffic.reduce_scatter(nodes, me, [sum(_nbytes(lst[j]) for lst in args[1]) for j in range(k)])
    if method in ("all_to_all_single", "alltoall_base"):  # (output, input, out_splits, in_splits, opts)
        return traffic.all_to_all(nodes, me, _split_bytes(args[1], list(args[3]), k))
    if method == "alltoall":  # (outputs, inputs, opts)
        return traffic.all_to_all(nodes, me, [_nbytes(t) for t in args[1]])
    if method in ("allreduce", "allreduce_coalesced"):  # (tensors, opts)
        return traffic.all_reduce(nodes, me, _nbytes(_flat(args[0])))
    if method == "broadcast":  # (tensors, opts)
        return traffic.broadcast(nodes, me, args[1].rootRank, _nbytes(_flat(args[0])))
    if method == "reduce":  # (tensors, opts)
        return traffic.reduce(nodes, me, args[1].rootRank, _nbytes(_flat(args[0])))
    if method == "gather":  # (outputs, inputs, opts)
        return traffic.gather(nodes, me, args[2].rootRank, _nbytes(_flat(args[1])))
    if method == "scatter":  # (outputs, [per-rank inputs], opts)
        root = args[2].rootRank
        return traffic.scatter(nodes, me, root, [_nbytes(t) for t in args[1][0]] if me == root else [0] * k)
    if method == "send":  # (tensors, dst, tag)
        return traffic.send(nodes[me], nodes[int(args[1])], _nbytes(_flat(args[0])))
    raise KeyError(method)


@dataclass
class LinkBytes:
    """Counts this rank's sends per (path, link) while installed and enabled.

    ``with LinkBytes(ranks_per_node=2) as c: ...`` installs the wrappers on entry and removes
    them on exit; ``c.enabled`` switches counting on and off (a window). ``snapshot()`` marks a
    step boundary: ``steps`` keeps the bytes of every completed window slice.
    """

    ranks_per_node: int
    enabled: bool = True
    counts: dict = field(default_factory=dict)  # {(path, link): [bytes, calls]}, link in LINKS
    steps: list = field(default_factory=list)  # per snapshot: {(path, link): bytes since the last one}

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")
        self._lock = threading.Lock()
        self._undo: list = []
        self._last: dict = {}

    # -------------------------------------------------------------- install / remove

    def install(self) -> LinkBytes:
        from torch._C._distributed_c10d import ProcessGroup

        if self._undo:
            raise RuntimeError("LinkBytes is already installed")
        for name in PATH_OF:
            orig = ProcessGroup.__dict__.get(name)
            if orig is None:  # a name this torch does not have
                continue
            setattr(ProcessGroup, name, self._wrap(name, orig))
            self._undo.append((ProcessGroup, name, orig))
        return self

    def remove(self) -> None:
        while self._undo:
            cls, name, orig = self._undo.pop()
            setattr(cls, name, orig)

    def __enter__(self) -> LinkBytes:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.remove()

    def _wrap(self, name: str, orig):
        counter = self

        def wrapper(pg, *args, **kwargs):
            if counter.enabled:
                if kwargs:  # torch 2.13's distributed_c10d passes everything positionally
                    raise RuntimeError(
                        f"LinkBytes: ProcessGroup.{name} called with keyword arguments "
                        f"{sorted(kwargs)}; sdpq/comm/link_bytes.py:_sends reads positions"
                    )
                counter._record(name, pg, args)
            return orig(pg, *args, **kwargs)

        wrapper.__name__ = name
        wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
        return wrapper

    # -------------------------------------------------------------- accounting

    def _record(self, name: str, pg, args: tuple) -> None:
        ranks = dist.get_process_group_ranks(pg)  # global rank of every group rank
        me_global = dist.get_rank()
        me = ranks.index(me_global)
        share = _traffic(name, traffic.member_nodes(ranks, self.ranks_per_node), me, args)
        path = PATH_OF[name]
        with self._lock:
            for link, b in (("inter", share.inter), ("inter_ring", share.ring), ("intra", share.intra)):
                if b:  # a collective reaching both kinds of peer is a call on each link
                    c = self.counts.setdefault((path, link), [0, 0])
                    c[0] += b
                    c[1] += 1

    def snapshot(self) -> None:
        """Close a step: append the bytes counted since the previous snapshot."""
        with self._lock:
            now = {k: v[0] for k, v in self.counts.items()}
            self.steps.append({k: now[k] - self._last.get(k, 0) for k in now})
            self._last = now

    def reset(self) -> None:
        with self._lock:
            self.counts.clear()
            self.steps.clear()
            self._last = {}

    def as_dict(self) -> dict:
        """{"total": {path: {link: {"bytes", "calls"}}}, "steps": [{path: {link: bytes}}]} (picklable)."""
        total: dict = {}
        for (path, link), (b, calls) in sorted(self.counts.items()):
            total.setdefault(path, {})[link] = {"bytes": b, "calls": calls}
        steps = []
        for s in self.steps:
            d: dict = {}
            for (path, link), b in sorted(s.items()):
                d.setdefault(path, {})[link] = b
            steps.append(d)
        return {"ranks_per_node": self.ranks_per_node, "total": total, "steps": steps}


def sum_over_ranks(per_rank: list[dict]) -> dict:
    """Add the ``as_dict()`` of every rank: the bytes the whole job put on each link."""
    total: dict = {}
    n_steps = max((len(r["steps"]) for r in per_rank), default=0)
    steps: list = [{} for _ in range(n_steps)]
    for r in per_rank:
        for path, links in r["total"].items():
            for link, c in links.items():
                t = total.setdefault(path, {}).setdefault(link, {"bytes": 0, "calls": 0})
                t["bytes"] += c["bytes"]
                t["calls"] += c["calls"]
        for i, s in enumerate(r["steps"]):
            for path, links in s.items():
                for link, b in links.items():
                    steps[i].setdefault(path, {}).setdefault(link, 0)
                    steps[i][path][link] += b
    return {"total": total, "steps": steps}
