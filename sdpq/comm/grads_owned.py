"""Two-level quantized reduce of a bucket whose pieces have owners of unequal sizes (ZeRO-1/2).

DeepSpeed's ZeRO-1 and ZeRO-2 cut each flat parameter group into N equal contiguous partitions;
a gradient bucket (parameters in backward order) usually covers parts of one or two of them, and
each rank needs only the sum of the pieces it owns. An equal-chunk reduce-scatter would pad every
rank's chunk to the largest owner's share and send the padding; here every owner's share travels
at its own size (all_to_all with split sizes), so each element crosses each link once, whatever
the split: the bytes of a balanced reduce-scatter.

Per call (SUM semantics; the caller divides):
  0. pack: the pieces of owner r, in bucket order, each starting at a multiple of A elements
     (A = the larger group size, and at least the Hadamard block), so that no quantization group
     or Hadamard block mixes two pieces (two parameters, or a parameter and padding); optional
     blockwise randomized Hadamard of the packed values (shared seed; each owner inverts its sum);
  1. intra-node (`intra_bits`): local rank l' receives the packed pieces of owners {n' L + l'}
     from every rank of its node and adds the dequantized rows to its own, kept exact;
  2. inter-node (`inter_bits`): the node partial of owner n' L + l goes to node n'; the owner
     adds the other nodes' dequantized partials to its own node's, kept exact.

Error feedback (`error_feedback`, opt-in): the inter-node stage's quantization error of each
row this rank sends is kept per bucket (the caller names it: `key`) and added to that bucket's
row at the next call, so that over many calls the owner's sums drift from the exact ones by at
most one call's error. Memory: fp32, the rows this rank sends to other nodes: about
4 (nodes - 1) / (nodes L) bytes per gradient element of every bucket (L ranks per node), on every
rank. The caller calls `sweep()` once per optimizer step: residuals of buckets that did not
recur since the last sweep are dropped (buckets regroup when parameters get no gradient). A
residual carries one call's error of a skipped (overflowing) step, and under fp16 loss scaling
is in the units of the scale it was made at: both bounded by one call's error.

Note (non-finite): a group holding inf/NaN decodes as NaN at its owner (its scale is not
finite); the sum of an owner's pieces is then NaN where plain DeepSpeed's would be inf or NaN,
and DeepSpeed's overflow check (fp16) sees it on that owner and skips the step everywhere.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple

import torch

from ..config import GradientsConfig, StatsConfig
from ..kernels import decode_rows, encode_rows
from ..quant import QuantSpec
from ..quant.groupwise import SCALE_DTYPES
from ..quant.hadamard import hadamard as _hadamard
from ..quant.hadamard import inverse_hadamard as _inverse_hadamard
from . import timing
from ._exchange import all_to_all_split
from ._rng import generator_state, per_rank_generator, restore_generator
from .stats import CommStats, Recorder
from .topology import Topology

__all__ = ["Piece", "OwnedReduceScatter", "flat_pieces"]


class Piece(NamedTuple):
    """A run of one parameter's gradient inside a bucket, and the world rank that owns it."""

    offset: int  # in the bucket
    numel: int
    owner: int


class _Packing(NamedTuple):
    """Where each owner's pieces sit in the packed buffer (a pure function of the pieces)."""

    starts: tuple[int, ...]  # per owner: its first element in the packed buffer
    sizes: tuple[int, ...]  # per owner: packed elements (a multiple of A)
    valid: tuple[int, ...]  # per owner: bucket elements (padding excluded)
    runs: tuple[tuple[Piece, int], ...]  # (piece, its packed offset), owner-major
    total: int


def _hashable(k):
    """A key back from a checkpoint (lists where tuples were)."""
    return tuple(_hashable(x) for x in k) if isinstance(k, (list, tuple)) else k


def _round_up(n: int, a: int) -> int:
    return -(-n // a) * a


def pack_layout(pieces: Sequence[Piece], world_size: int, align: int) -> _Packing:
    """Owner-major packing: owner 0's pieces first (in bucket order), each at a multiple of align."""
    by_owner: list[list[Piece]] = [[] for _ in range(world_size)]
    for p in pieces:
        if not 0 <= p.owner < world_size:
            raise ValueError(f"piece {p}: owner must be a rank in [0, {world_size})")
        if p.numel > 0:
            by_owner[p.owner].append(p)
    starts, sizes, runs, at = [], [], [], 0
    for own in by_owner:
        starts.append(at)
        for p in own:
            runs.append((p, at))
            at += _round_up(p.numel, align)
        sizes.append(at - starts[-1])
    valid = tuple(sum(p.numel for p in own) for own in by_owner)
    return _Packing(tuple(starts), tuple(sizes), valid, tuple(runs), at)


def flat_pieces(sizes: Sequence[int], partition_numel: int, cap: int) -> list[tuple[int, int, list[Piece]]]:
    """A flat buffer of tensors of `sizes` (one after the other from 0; padding after them), cut
    into equal partitions of `partition_numel`, rank r owning the r-th: -> (start, end, pieces)
    per window of at most `cap` elements, each piece one tensor's run inside one partition
    (offsets relative to the window's start). For buffers reduced whole (DeepSpeed's
    BF16_Optimizer), cut into exchanges of bounded size."""
    if partition_numel <= 0 or cap <= 0:
        raise ValueError(f"flat_pieces: partition_numel ({partition_numel}) and cap ({cap}) must be positive")
    cuts: set[int] = set()
    at = 0
    for n in sizes:
        cuts.update((at, at + n))
        at += n
    cuts.update(range(0, at, partition_numel))
    cuts.update(range(0, at, cap))
    edges = sorted(cuts)
    out: list[tuple[int, int, list[Piece]]] = []  # windows: [k cap, (k + 1) cap), the last one shorter
    for lo, hi in zip(edges, edges[1:]):
        start = lo // cap * cap
        if not out or out[-1][0] != start:
            out.append((start, start, []))
        pieces = out[-1][2]
        pieces.append(Piece(lo - start, hi - lo, lo // partition_numel))
        out[-1] = (start, hi, pieces)
    return out


class OwnedReduceScatter:
    """Every rank calls it collectively with the same bucket size and the same pieces."""

    def __init__(
        self,
        topology: Topology,
        config: GradientsConfig | None = None,
        *,
        device: torch.device | str | None = None,
        stats: StatsConfig | None = None,
        record_to: CommStats | None = None,
    ):
        self.config = c = config or GradientsConfig()
        if c.mode != "two_level":
            raise ValueError(
                f"OwnedReduceScatter: gradients.mode must be 'two_level' (exact: the plain collective), got {c.mode!r}"
            )
        self.topology = topology
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        scale = SCALE_DTYPES[c.scale_dtype]
        self.intra_spec = QuantSpec(c.intra_bits, c.intra_group_size, c.rounding, scale)
        self.inter_spec = QuantSpec(c.inter_bits, c.inter_group_size, c.rounding, scale)
        self.block = c.hadamard_block if c.hadamard else 1
        self.align = max(c.intra_group_size, c.inter_group_size, self.block)
        self._rec = Recorder(stats, record_to)
        self._layouts: dict[tuple, _Packing] = {}
        self._gen: torch.Generator | None = None
        self._itemsize = 2
        self.residuals: dict[Hashable, torch.Tensor] = {}  # bucket key -> inter-node residual rows
        self._used: set = set()  # keys reduced since the last sweep
        self.calls = 0

    def layout(self, pieces: Sequence[Piece]) -> _Packing:
        key = tuple(pieces)
        lay = self._layouts.get(key)
        if lay is None:
            if len(self._layouts) >= 1024:  # buckets recur every step; bound the cache anyway
                self._layouts.clear()
            lay = self._layouts[key] = pack_layout(pieces, self.topology.world_size, self.align)
        return lay

    def __call__(
        self,
        bucket: torch.Tensor,
        pieces: Sequence[Piece],
        *,
        plain_itemsize: int | None = None,
        key: Hashable | None = None,
    ) -> list[tuple[Piece, torch.Tensor]]:
        """-> [(piece, fp32 sum over ranks of that piece)] for the pieces this rank owns.
        plain_itemsize: bytes per element the plain collective would send (the statistics'
        baseline; default: the bucket's own dtype). key: names the bucket across calls (the same
        on every rank); needed with error feedback, whose residual is the bucket's."""
        if self.config.error_feedback and key is None:
            raise ValueError("OwnedReduceScatter: gradients.error_feedback needs a key naming the bucket")
        x = bucket.detach().reshape(-1)
        self._itemsize = plain_itemsize or x.element_size()
        lay = self.layout(pieces)
        me = self.topology.rank
        with timing.span("grads.reduce_scatter"):
            packed = torch.zeros(lay.total, dtype=torch.float32, device=x.device)
            for p, at in lay.runs:
                packed[at : at + p.numel] = x[p.offset : p.offset + p.numel]
            if self.block > 1 and lay.total:
                packed = _hadamard(packed, self.block, self.config.seed)
            partial = self._intra(packed, lay)
            total = self._inter(partial, lay, key)
            if self.block > 1 and total.numel():
                total = _inverse_hadamard(total, self.block, self.config.seed)
        self.calls += 1
        base = lay.starts[me]
        return [(p, total[at - base : at - base + p.numel]) for p, at in lay.runs if p.owner == me]

    def state_dict(self) -> dict:
        """The rounding stream, the call count and the residuals: what a resumed run needs to
        continue bitwise."""
        residuals = [(k, r.detach().to("cpu", copy=True)) for k, r in self.residuals.items()]
        return {"generator": generator_state(self._gen), "calls": self.calls, "residuals": residuals}

    def load_state_dict(self, state: dict) -> None:
        self._gen = restore_generator(self._gen, state["generator"], self.device)
        self.calls = int(state["calls"])
        self.residuals = {_hashable(k): r.to(self.device, copy=True) for k, r in state.get("residuals", [])}
        self._used = set()

    def sweep(self) -> None:
        """Drop the residuals of buckets not reduced since the last sweep (once per step)."""
        if self._used or self.residuals:
            self.residuals = {k: r for k, r in self.residuals.items() if k in self._used}
        self._used = set()

    def held_tensors(self):
        """(kind, tensor) of what this exchange keeps between calls (sdpq.memory)."""
        for r in self.residuals.values():
            yield "error_feedback", r

    # ------------------------------------------------------------------ stages

    def _generator(self, device: torch.device) -> torch.Generator | None:
        if self.config.rounding != "stochastic":
            return None
        if self._gen is None:  # independent streams per rank: rounding errors then cancel
            self._gen = per_rank_generator(self.config.seed, self.topology.rank, device)
        return self._gen

    def _exchange(
        self,
        rows: list[torch.Tensor],
        own_index: int,
        spec: QuantSpec,
        group,
        link: str,
        elems: int,
        feedback: list[torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """Send rows[j] (fp32) to group rank j, quantized; return own row + the dequantized rows
        received: the fp32 sum of what every member sent here. elems: bucket elements leaving
        this rank (padding excluded), for the statistics' baseline. feedback[j]: row j's residual,
        added before quantizing and replaced by the new error."""
        k = len(rows)
        n_own = rows[own_index].numel()
        gen = self._generator(rows[own_index].device)
        with timing.span("grads.encode"):
            wires = []
            for j, r in enumerate(rows):
                res = None if feedback is None else feedback[j]
                if j == own_index or r.numel() == 0:
                    wires.append(torch.empty(0, dtype=torch.uint8, device=r.device))
                    continue
                if res is not None:
                    r = r + res
                wire, _, bad = encode_rows(r.view(1, -1), spec, generator=gen)
                wires.append(wire.view(-1))
                if res is not None:
                    deq = decode_rows(wire, spec, r.numel(), torch.empty(1, r.numel(), device=r.device))
                    torch.sub(r, deq.view(-1), out=res)
                    res.masked_fill_(bad, 0.0)  # an overflowing step is skipped: carry no inf/NaN
        recv_bytes = 0 if n_own == 0 else spec.wire_bytes(n_own)
        out_splits = [0 if j == own_index else recv_bytes for j in range(k)]
        inp = torch.cat(wires)
        recv = torch.empty(sum(out_splits), dtype=torch.uint8, device=inp.device)
        with timing.span("comm.grads"):
            all_to_all_split(recv, inp, out_splits, [w.numel() for w in wires], group)
        sent = inp.numel()
        self._rec.record("gradients", link, bytes=sent, elements=elems, baseline_bytes=elems * self._itemsize)
        total = rows[own_index].clone()
        if n_own and k > 1:
            with timing.span("grads.reduce"):
                vals = decode_rows(recv.view(k - 1, recv_bytes), spec, n_own, total.new_empty(k - 1, n_own))
                total += vals.sum(0)
        return total

    def _intra(self, packed: torch.Tensor, lay: _Packing) -> torch.Tensor:
        """-> the node partial of owners {n' L + l} (their packed pieces one after the other)."""
        topo = self.topology
        L, nodes, l = topo.ranks_per_node, topo.nodes, topo.local_rank

        def row(lp: int) -> torch.Tensor:
            parts = [
                packed[lay.starts[n * L + lp] : lay.starts[n * L + lp] + lay.sizes[n * L + lp]] for n in range(nodes)
            ]
            return torch.cat(parts) if len(parts) > 1 else parts[0]

        if L == 1:
            return row(0)
        elems = sum(lay.valid[n * L + lp] for n in range(nodes) for lp in range(L) if lp != l)
        return self._exchange([row(lp) for lp in range(L)], l, self.intra_spec, topo.intra_group, "intra", elems)

    def _inter(self, partial: torch.Tensor, lay: _Packing, key: Hashable | None) -> torch.Tensor:
        """Node partial of owners {n' L + l} -> the owner's total (this rank's packed pieces)."""
        topo = self.topology
        L, nodes, l, node = topo.ranks_per_node, topo.nodes, topo.local_rank, topo.node
        sizes = [lay.sizes[n * L + l] for n in range(nodes)]
        offsets = [sum(sizes[:n]) for n in range(nodes)]
        rows = [partial[offsets[n] : offsets[n] + sizes[n]] for n in range(nodes)]
        if nodes == 1:
            return rows[0]
        elems = sum(lay.valid[n * L + l] for n in range(nodes) if n != node)
        feedback = None
        if self.config.error_feedback:
            # Note: one buffer per bucket, the rows to other nodes one after the other (the own
            # row is summed exactly); rebuilt zero if the bucket's layout changed.
            others = sum(sizes) - sizes[node]
            res = self.residuals.get(key)
            if res is None or res.numel() != others:
                res = self.residuals[key] = torch.zeros(others, dtype=torch.float32, device=partial.device)
            self._used.add(key)
            feedback, at = [], 0
            for n in range(nodes):
                feedback.append(None if n == node else res[at : at + sizes[n]])
                at += 0 if n == node else sizes[n]
        return self._exchange(rows, node, self.inter_spec, topo.inter_group, "inter", elems, feedback)
