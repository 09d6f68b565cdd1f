"""Quantized gradient all-reduce of one flat bucket across a group (HSDP's replicate dimension).

SUM semantics, in place: every rank ends with the same sum over ranks of x, bit for bit.

    1. reduce-scatter: a `GradReduceScatter` on the group (its node layout: usually one rank
       per node, so one 4-bit inter-node stage; two levels when the group spans several ranks
       of a node), with everything it brings: Hadamard smoothing, the rank's own contribution
       exact, optional error feedback, pipelined slices, NaN on every rank for any inf/NaN;
    2. all-gather: every rank quantizes its reduced chunk once more (the inter-node format, with
       Hadamard smoothing) and the codes are all-gathered; EVERY rank, the chunk's owner
       included, decodes the same bytes, so the replicas' gradients, and so their parameters
       after the optimizer step, stay bitwise identical.

Bytes: 2 (R - 1) / R of the bucket at `inter_bits` (4 by default; + scales) per rank, where a ring all-reduce of
bf16 sends 2 (R - 1) / R at 16 bits: about 0.26 of it (0.27 against fp32 scales). Phase 2
re-quantizes an already reduced sum, so its error does not grow with R.

Note (exact mode): `gradients.mode = "exact"` is a plain SUM all-reduce in the input dtype, with
the same non-finite rule (a rank holding inf/NaN contributes NaN everywhere).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..config import GradientsConfig, StatsConfig
from ..kernels import decode_rows, decode_rows_inverse_hadamard, encode_rows
from ..quant import true_div
from . import timing, traffic
from ._exchange import all_gather_rows, all_reduce_sum
from .grads import GradReduceScatter
from .segments import Segment, cut_segments
from .stats import CommStats, Recorder
from .topology import Topology

__all__ = ["GradAllReduce", "exact_all_reduce"]


def _gathered(row: torch.Tensor, group) -> torch.Tensor:
    rows, work = all_gather_rows(row, group)
    if work is not None:
        work.wait()
    return rows


def exact_all_reduce(flat: torch.Tensor, topology: Topology, rec: Recorder, divide_by: int | None = None) -> None:
    """The plain SUM all-reduce of `flat` in place (divided by `divide_by` in fp32, if given),
    its bytes recorded under the byte model (comm/traffic.py)."""
    group = topology.world_group
    # Note: as GradReduceScatter's exact mode, an inf on one rank must not become a finite
    # (or inf) value on some ranks only: a rank holding a non-finite value sends NaN.
    flat.copy_(torch.where(torch.isfinite(flat).all(), flat, float("nan")))
    with timing.span("comm.grads"):
        all_reduce_sum(flat, group)
    if divide_by is not None:
        flat.copy_(true_div(flat.float(), divide_by))
    item, numel = flat.element_size(), flat.numel()
    nodes = traffic.member_nodes(range(topology.world_size), topology.ranks_per_node)
    elems = traffic.all_reduce(nodes, topology.rank, numel)
    rec.record_share("gradients", elems.scaled(item), elems, item)


class GradAllReduce:
    """All-reduce (SUM, in place) of a flat bucket of `numel` elements over `topology`'s group.
    Every rank builds it with the same arguments and calls it collectively.

    stats / record_to: as for WeightGather (bytes are recorded under "gradients", per link).
    segments: where the bucket's parameters lie (offsets in the bucket): both phases keep their
    groups and Hadamard blocks inside one parameter (see GradReduceScatter).
    """

    def __init__(
        self,
        numel: int,
        topology: Topology,
        config: GradientsConfig | None = None,
        *,
        device: torch.device | str | None = None,
        stats: StatsConfig | None = None,
        record_to: CommStats | None = None,
        segments: Sequence[Segment] | None = None,
    ):
        self.config = c = config or GradientsConfig()
        self.topology = topology
        self.numel = numel
        # Phase 1; its state (residual, rounding stream, call count) is this object's state.
        chunks = None if segments is None else cut_segments(segments, numel, topology.world_size)
        self.reduce_scatter = GradReduceScatter(
            numel, topology, c, device=device, stats=stats, record_to=record_to, segments=chunks
        )  # fmt: skip
        rs = self.reduce_scatter
        # Phase 2 travels on the slowest link the group has (the inter-node format across nodes).
        self.gather_spec = rs.inter_spec if topology.nodes > 1 else rs.intra_spec
        self.hadamard = (rs.hadamard_block, c.seed) if c.hadamard else None
        self._rec = Recorder(stats, record_to)
        cn = rs.chunk_numel
        self._own_valid = max(0, min(cn, numel - topology.rank * cn))  # this rank's chunk, padding excluded

    def state_dict(self) -> dict:
        return self.reduce_scatter.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.reduce_scatter.load_state_dict(state)

    def reset_error_feedback(self) -> None:
        self.reduce_scatter.reset_error_feedback()

    def held_tensors(self):
        """(kind, tensor) of what this rank keeps between calls (for sdpq.memory)."""
        return self.reduce_scatter.held_tensors()

    def all_reduce(self, x: torch.Tensor, divide_by: int | None = None) -> torch.Tensor:
        """x (flat, `numel` elements, any float dtype) <- the sum over the group's ranks, divided
        by `divide_by` in fp32 before it is rounded to x's dtype (DDP's average); returns x."""
        if x.numel() != self.numel:
            raise ValueError(f"input has {x.numel()} elements; this all-reduce was built for {self.numel}")
        flat = x.view(-1)
        if self.topology.world_size == 1:
            if divide_by is not None and divide_by != 1:
                flat.copy_(true_div(flat.float(), divide_by))
            return x  # a group of one: the sum is x itself (nothing to send, nothing to round)
        with timing.span("grads.all_reduce"):
            if self.config.mode == "exact":
                self._exact(flat, divide_by)
            else:
                chunk = torch.empty(self.reduce_scatter.chunk_numel, dtype=torch.float32, device=flat.device)
                self.reduce_scatter.reduce_scatter(flat, out=chunk)  # the fp32 sum, not rounded to x's dtype
                total = self._gather(chunk, flat.element_size())[: self.numel]
                flat.copy_(total if divide_by is None else true_div(total, divide_by))
        return x

    __call__ = all_reduce

    def _exact(self, flat: torch.Tensor, divide_by: int | None = None) -> None:
        exact_all_reduce(flat, self.topology, self._rec, divide_by)

    def _gather(self, chunk: torch.Tensor, itemsize: int) -> torch.Tensor:
        """Quantize this rank's reduced chunk, all-gather, decode every rank's chunk alike:
        fp32 [R * chunk_numel], the same bits on every rank."""
        rs, spec = self.reduce_scatter, self.gather_spec
        C, cn = rs.padded_chunk, rs.chunk_numel
        row = torch.zeros((1, C), dtype=torch.float32, device=chunk.device)
        placement = rs.placement
        if placement is not None:
            placement.pack_chunk(chunk, self.topology.rank, row[0])
        else:
            row[0, :cn] = chunk
        gen = rs._generator(chunk.device)
        with timing.span("grads.encode"):
            wire, _, _ = encode_rows(row, spec, hadamard=self.hadamard, generator=gen)
        with timing.span("comm.grads"):
            rows = self._all_gather_by_node(wire[0])
        with timing.span("grads.decode"):
            if self.hadamard is not None:
                vals = decode_rows_inverse_hadamard(rows, spec, C, self.hadamard)
            else:
                vals = torch.empty((rows.shape[0], C), dtype=torch.float32, device=chunk.device)
                decode_rows(rows, spec, C, vals)
        self._record_gather(itemsize)
        return vals[:, :cn].reshape(-1) if placement is None else placement.unpack(vals)

    def _all_gather_by_node(self, row: torch.Tensor) -> torch.Tensor:
        """Every rank's wire row [N, W] in rank order, each row crossing the inter-node link once
        per other node: across nodes among the ranks of one local index (n' L + l for every n'),
        then inside the node (a group within one node, or one rank per node: one all-gather)."""
        topo = self.topology
        nodes, L = topo.nodes, topo.ranks_per_node
        if nodes == 1 or L == 1:
            return _gathered(row, topo.world_group)
        across = _gathered(row, topo.inter_group)  # [nodes, W]: the chunks of local index l
        inside = _gathered(across.reshape(-1), topo.intra_group)  # [L, nodes * W]
        return inside.view(L, nodes, -1).transpose(0, 1).reshape(nodes * L, -1)

    def _record_gather(self, itemsize: int) -> None:
        # This rank's chunk crosses to the other nodes once each (to the ranks of its local index);
        # inside the node it passes on the chunks of its local index, one per node.
        topo, wire = self.topology, self.gather_spec.wire_bytes(self.reduce_scatter.padded_chunk)
        nodes, L = topo.nodes, topo.ranks_per_node
        cn = self.reduce_scatter.chunk_numel
        if nodes == 1 or L == 1:
            peers = topo.world_size - 1
            link = "inter" if nodes > 1 else "intra"
            elems = peers * self._own_valid
            self._rec.record("gradients", link, bytes=peers * wire, elements=elems, baseline_bytes=elems * itemsize)
            return
        elems = (nodes - 1) * self._own_valid
        self._rec.record(
            "gradients", "inter", bytes=(nodes - 1) * wire, elements=elems, baseline_bytes=elems * itemsize
        )
        forwarded = sum(max(0, min(cn, self.numel - (n * L + topo.local_rank) * cn)) for n in range(nodes))
        elems = (L - 1) * forwarded
        self._rec.record(
            "gradients", "intra", bytes=(L - 1) * nodes * wire, elements=elems, baseline_bytes=elems * itemsize
        )
