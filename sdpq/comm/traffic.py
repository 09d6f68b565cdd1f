"""The one model of what a collective costs on the links: every byte count in sdpq comes from here
(the process-group meter `link_bytes`, sdpq's own statistics `stats`, `sdpq plan`, the demo and
the benchmarks).

Cross-node bytes are counted as a real cluster pays them, for sdpq and baselines alike: the
**least traffic** any algorithm of that collective must move across node boundaries. Data that
several members of a node need crosses into that node once; data that can be summed is summed
inside a node before it leaves. NCCL's **ring** (what most clusters run for all-gather,
reduce-scatter and all-reduce) is given beside it as context, never as the headline.

For a group of k members on n distinct nodes, M the bytes of the full tensor (all pieces, or the
whole reduce-scatter input of one member):

| collective | least cross-node bytes (whole job) | NCCL ring (whole job) |
|---|---|---|
| all-gather, reduce-scatter | (n - 1) M | n (k - 1) / k M (n > 1) |
| all-reduce | 2 (n - 1) M | 2 n (k - 1) / k M |
| broadcast, reduce | (n - 1) M | (n - 1) M (a chain through the nodes) |
| all-to-all, gather, scatter, send | the rows sent from one node to another | the same |

(The rows of an all-to-all, gather or scatter are distinct data: nothing can be combined, so the
least traffic, the ring's and a flat count agree there.)

NCCL builds its rings node by node (every member of a node, then the next node), so a ring over
n > 1 nodes crosses n node boundaries; the model orders the ring the same way. At 2 nodes x 2
the ring moves 1.5x the least, at 2 x 8 1.875x, at 8 x 8 1.125x.

A "flat" count (every member sends its piece to every other member) is L times the least for
L members per node. No cluster pays it, and nothing here counts it.

Each function returns one member's share (`Traffic`), so that per-process counters summed over
the group give the job's total:

- all-gather: my piece times the foreign nodes it must reach;
- reduce-scatter: my output chunk times the foreign nodes that contribute a partial sum to it;
- all-reduce: a reduce-scatter and an all-gather of my 1/k of the tensor;
- broadcast / reduce: the root's (its data reaches, or partial sums arrive from, each foreign
  node once);
- all-to-all / gather / scatter / send: the rows this member sends.

`intra` is the ring's traffic inside nodes (or the rows sent to node-mates): context for the
NVLink side, not a lower bound. Pure arithmetic on node numbers: no torch.distributed here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Traffic",
    "member_nodes",
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "send",
    "per_node",
    "KINDS",
]

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "reduce", "all_to_all")


@dataclass(frozen=True)
class Traffic:
    """One member's share of a collective's bytes (or elements: every function is linear)."""

    inter: int = 0  # the least cross-node traffic: the headline
    ring: int = 0  # cross-node bytes of NCCL's ring (context)
    intra: int = 0  # inside nodes (the ring's hops there, or rows to node-mates)

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.inter + other.inter, self.ring + other.ring, self.intra + other.intra)

    def scaled(self, factor: int) -> Traffic:
        return Traffic(self.inter * factor, self.ring * factor, self.intra * factor)


def member_nodes(ranks: Sequence[int], ranks_per_node: int) -> tuple[int, ...]:
    """The node of every member of a group, from its global ranks (rank = node * L + local)."""
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
    return tuple(r // ranks_per_node for r in ranks)


def _foreign_nodes(nodes: Sequence[int], me: int) -> int:
    return len(set(nodes) - {nodes[me]})


def _ring_next(nodes: Sequence[int], me: int) -> int:
    """The member `me` sends to in a ring that visits the nodes one after the other."""
    order = sorted(range(len(nodes)), key=lambda j: (nodes[j], j))
    return order[(order.index(me) + 1) % len(order)]


def _ring_hop(nodes: Sequence[int], me: int, nbytes: int) -> Traffic:
    """`me`'s ring hop carrying nbytes: cross-node or inside the node."""
    if nodes[_ring_next(nodes, me)] != nodes[me]:
        return Traffic(ring=nbytes)
    return Traffic(intra=nbytes)


def _pieces(nodes: Sequence[int], pieces: int | Sequence[int]) -> list[int]:
    k = len(nodes)
    if isinstance(pieces, int):
        return [pieces] * k
    if len(pieces) != k:
        raise ValueError(f"{len(pieces)} piece sizes for a group of {k} members")
    return [int(p) for p in pieces]


def _check(nodes: Sequence[int], me: int) -> None:
    if not 0 <= me < len(nodes):
        raise ValueError(f"member {me} is not in a group of {len(nodes)}")


def all_gather(nodes: Sequence[int], me: int, pieces: int | Sequence[int]) -> Traffic:
    """Every member ends with every piece (`pieces`: bytes of each member's input, or one size)."""
    _check(nodes, me)
    p = _pieces(nodes, pieces)
    if len(nodes) == 1:
        return Traffic()
    least = Traffic(inter=p[me] * _foreign_nodes(nodes, me))
    # A ring hop carries every piece but the receiver's own.
    return least + _ring_hop(nodes, me, sum(p) - p[_ring_next(nodes, me)])


def reduce_scatter(nodes: Sequence[int], me: int, chunks: int | Sequence[int]) -> Traffic:
    """Member j ends with the sum of chunk j (`chunks`: bytes of each member's output chunk)."""
    _check(nodes, me)
    c = _pieces(nodes, chunks)
    if len(nodes) == 1:
        return Traffic()
    least = Traffic(inter=c[me] * _foreign_nodes(nodes, me))
    # A ring hop carries the partial sums of every chunk but the sender's own.
    return least + _ring_hop(nodes, me, sum(c) - c[me])


def _even_chunks(nbytes: int, k: int) -> list[int]:
    return [nbytes // k + (1 if j < nbytes % k else 0) for j in range(k)]


def all_reduce(nodes: Sequence[int], me: int, nbytes: int) -> Traffic:
    """A reduce-scatter then an all-gather of the same nbytes-byte tensor."""
    chunks = _even_chunks(nbytes, len(nodes))
    return reduce_scatter(nodes, me, chunks) + all_gather(nodes, me, chunks)


def all_to_all(nodes: Sequence[int], me: int, sends: Sequence[int]) -> Traffic:
    """`sends[j]`: the bytes `me` sends to member j (uneven splits included)."""
    _check(nodes, me)
    if len(sends) != len(nodes):
        raise ValueError(f"{len(sends)} send sizes for a group of {len(nodes)} members")
    inter = sum(int(b) for j, b in enumerate(sends) if nodes[j] != nodes[me])
    intra = sum(int(b) for j, b in enumerate(sends) if j != me and nodes[j] == nodes[me])
    return Traffic(inter=inter, ring=inter, intra=intra)


def _chain(nodes: Sequence[int], me: int, root: int, nbytes: int, *, towards_root: bool) -> Traffic:
    """Broadcast (away from the root) or reduce (towards it) as a node-ordered chain: every
    member but the chain's last sends nbytes to the next."""
    _check(nodes, root)
    # The root, its node-mates, then each other node in turn: a chain crosses n - 1 boundaries.
    distinct = sorted(set(nodes))
    at = {nd: i for i, nd in enumerate(distinct)}
    chain = sorted(range(len(nodes)), key=lambda j: (j != root, (at[nodes[j]] - at[nodes[root]]) % len(distinct), j))
    if towards_root:
        chain.reverse()  # the broadcast's chain walked back: root last
    pos = chain.index(me)
    if pos == len(chain) - 1:
        return Traffic()
    cross = nodes[chain[pos + 1]] != nodes[me]
    return Traffic(ring=nbytes) if cross else Traffic(intra=nbytes)


def broadcast(nodes: Sequence[int], me: int, root: int, nbytes: int) -> Traffic:
    """The root's nbytes reach every member: each foreign node receives them once."""
    _check(nodes, me)
    least = Traffic(inter=nbytes * _foreign_nodes(nodes, root)) if me == root else Traffic()
    return least + _chain(nodes, me, root, nbytes, towards_root=False)


def reduce(nodes: Sequence[int], me: int, root: int, nbytes: int) -> Traffic:
    """The sum reaches the root: one partial sum from each foreign node (counted at the root)."""
    _check(nodes, me)
    least = Traffic(inter=nbytes * _foreign_nodes(nodes, root)) if me == root else Traffic()
    return least + _chain(nodes, me, root, nbytes, towards_root=True)


def gather(nodes: Sequence[int], me: int, root: int, nbytes: int) -> Traffic:
    """`me`'s nbytes reach the root (distinct data: sent as it is)."""
    _check(nodes, me)
    return send(nodes[me], nodes[root], nbytes) if me != root else Traffic()


def scatter(nodes: Sequence[int], me: int, root: int, pieces: Sequence[int]) -> Traffic:
    """The root sends pieces[j] to member j."""
    if me != root:
        return Traffic()
    return all_to_all(nodes, me, pieces)


def send(src_node: int, dst_node: int, nbytes: int) -> Traffic:
    if src_node != dst_node:
        return Traffic(inter=nbytes, ring=nbytes)
    return Traffic(intra=nbytes)


def per_node(kind: str, nbytes: int | float, nodes: int, ranks_per_node: int) -> dict[str, float]:
    """Closed forms for an even group of `nodes` x `ranks_per_node` members and a tensor of
    nbytes: {"least", "ring"}, the cross-node bytes one node receives (the job's total / nodes).
    What `sdpq plan` multiplies by its bits; the meter's sums must equal it (tests/comm)."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}; allowed: {', '.join(KINDS)}")
    if nodes < 1 or ranks_per_node < 1:
        raise ValueError(f"nodes and ranks_per_node must be >= 1, got {nodes} and {ranks_per_node}")
    if nodes == 1:
        return {"least": 0.0, "ring": 0.0}
    k = nodes * ranks_per_node
    least = (nodes - 1) / nodes * nbytes
    if kind in ("all_gather", "reduce_scatter"):
        return {"least": least, "ring": (k - 1) / k * nbytes}
    if kind == "all_reduce":
        return {"least": 2 * least, "ring": 2 * (k - 1) / k * nbytes}
    if kind in ("broadcast", "reduce"):
        return {"least": least, "ring": least}
    # all-to-all of nbytes per member, split evenly over the k members.
    foreign = (k - ranks_per_node) / k * nbytes * ranks_per_node
    return {"least": foreign, "ring": foreign}
