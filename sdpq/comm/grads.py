"""Two-level quantized gradient reduce-scatter of one flat bucket (docs/architecture.md).

SUM semantics: rank r gets sum over ranks of x[r*c : (r+1)*c] with c = ceil(numel / N) (the caller
divides for an average). The bucket is viewed as N chunks (chunk r goes to rank r), each padded
with zeros to C elements so that Hadamard blocks, quantization groups and pipeline slices never
straddle a chunk; padding never reaches the caller.

Per pipeline slice (a column range of every chunk):
  1. optional randomized Hadamard (blockwise, shared seed; inverted once at the end);
  2. intra-node, `intra_bits`: row l' = chunks {n'*L + l'}, all_to_all_single in the node, sum of
     the dequantized rows in fp32 -> node partial of the `nodes` chunks owned by local index l;
  3. inter-node, `inter_bits` (+ optional error feedback): row n' = partial of chunk n'*L + l,
     all_to_all_single across nodes, dequantize, sum in fp32, inverse Hadamard.
Slices are issued asynchronously so slice j's inter-node exchange overlaps slice j+1's
intra-node exchange (the two stages run on different process groups).

Note (non-finite): a rank whose quantized rows hold any non-finite group marks ALL its outgoing
scales NaN, and its own partial NaN. NaN then reaches every rank of the node in stage 2, and
every node in stage 3, so an overflow anywhere gives a NaN result on every rank (the caller
skips the step) and never finite garbage. The check reads the scales only (no host sync).
Note (own rows): a rank's own contribution to its own chunk is summed exactly, never quantized.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch

from ..config import GradientsConfig, StatsConfig
from ..kernels import decode_rows, encode_rows, reduce_rows
from ..quant import QuantSpec
from ..quant.groupwise import SCALE_DTYPES, relative_error
from ..quant.hadamard import hadamard as _hadamard
from ..quant.hadamard import inverse_hadamard as _inverse_hadamard
from ..quant.rows import poison_scales_
from . import timing, traffic
from ._exchange import all_to_all_rows, reduce_scatter_flat
from ._rng import generator_state, per_rank_generator, restore_generator
from .agreement import check_agreement
from .chunks import chunk_layout
from .segments import Segment
from .stats import CommStats, Recorder
from .topology import Topology

__all__ = ["GradReduceScatter"]

_NAN = float("nan")


class _Call(NamedTuple):
    """What the stages of one two-level call share."""

    x: torch.Tensor  # the flat bucket as given (slices of fp32 rows are made from it one by one)
    result: torch.Tensor  # [padded chunk] fp32: this rank's reduced chunk
    had: tuple[int, int] | None  # (Hadamard block, seed)
    gen: torch.Generator | None  # stochastic rounding stream
    sample: bool  # measure the quantization error this call
    fused_inter: bool  # intra sum re-encoded for the inter stage inside the reduction


class _Pending(NamedTuple):
    """An all-to-all in flight: this rank's own row (kept exact), what arrives, its handle and
    the non-finite groups of what was sent. recv None: no exchange on this link."""

    own: Any
    recv: torch.Tensor | None
    work: Any  # None once complete (an exchange staged through the host, see _exchange)
    bad: Any


def _wait(work) -> None:
    """Wait for an exchange's handle; None is an exchange that has already completed."""
    if work is not None:
        with timing.span("comm.grads"):
            work.wait()


class _NodePartial(NamedTuple):
    """The intra-node sum of a slice: P [nodes, S] (unfused), or its inter-node wire rows, own
    row and non-finite groups (fused)."""

    P: Any
    wire: torch.Tensor | None
    own_p: Any
    bad: Any


class GradReduceScatter:
    """Reduce-scatter (SUM) of one flat bucket. Every rank builds it with the same arguments
    and calls it collectively.

    numel: elements of the full input bucket; each rank gets `chunk_numel` = ceil(numel / N)
    (elements past the end of the bucket, on the last ranks, are returned as zeros).
    stats / record_to: as for WeightGather.
    segments: per chunk, where its parameters lie (`sdpq.comm.segments`): every quantization
    group and Hadamard block is then kept inside one parameter (and one row of it), so a row
    that is zero on every rank comes back exactly zero. Without it, blocks are cut at fixed
    multiples of the chunk.
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
        segments: Sequence[Sequence[Segment]] | None = None,
    ):
        if numel < 1:
            raise ValueError(f"GradReduceScatter: numel must be positive, got {numel}")
        self.config = c = config or GradientsConfig()
        self.topology = topo = topology
        self.numel = numel
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        N = topo.world_size
        lay = chunk_layout(numel, N, topo.ranks_per_node, c, segments)
        self.chunk_numel, self.padded_chunk, self.slices, self.hadamard_block, self.placement = lay
        cn = self.chunk_numel
        valid = [max(0, min(cn, numel - r * cn)) for r in range(N)]
        self.slice_numel = self.padded_chunk // self.slices
        self.intra_spec = QuantSpec(
            bits=c.intra_bits,
            group_size=c.intra_group_size,
            rounding=c.rounding,
            scale_dtype=SCALE_DTYPES[c.scale_dtype],
        )
        self.inter_spec = QuantSpec(
            bits=c.inter_bits,
            group_size=c.inter_group_size,
            rounding=c.rounding,
            scale_dtype=SCALE_DTYPES[c.scale_dtype],
        )
        self._count_elements(valid)
        check_agreement(
            "GradReduceScatter",
            {
                "gradients": dataclasses.asdict(c),
                "numel": numel,
                "layout": topo.layout,
                "placement": None if lay.placement is None else lay.placement.digest(),
            },
            topo.world_group,
        )
        self.residual: torch.Tensor | None = None  # error feedback of the inter-node stage
        self.calls = 0
        self._rec = Recorder(stats, record_to)
        self._gen: torch.Generator | None = None

    def _count_elements(self, valid: list[int]) -> None:
        """Bucket elements that leave this rank on each link per call (padding excluded), for the
        statistics; valid[r] = the bucket elements in rank r's chunk."""
        topo = self.topology
        N, L, nodes, l, n = topo.world_size, topo.ranks_per_node, topo.nodes, topo.local_rank, topo.node
        # Note: the two-level stages run over groups with one member per node (inter) or inside
        # one node (intra): their flat, ring and least-traffic counts agree.
        self._intra_elems = sum(valid[m * L + k] for m in range(nodes) for k in range(L) if k != l)
        self._inter_elems = sum(valid[m * L + l] for m in range(nodes) if m != n)
        # The exact reduce-scatter under the byte model: this rank's chunk, summed from every node.
        self._world_elems = traffic.reduce_scatter(traffic.member_nodes(range(N), L), topo.rank, valid)
        self._valid_own = valid[topo.rank]

    # ------------------------------------------------------------------ public API

    def reduce_scatter(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Full flat input (`numel` elements, any float dtype) -> this rank's summed chunk
        (`chunk_numel` elements, in out's dtype or x's)."""
        if x.numel() != self.numel:
            raise ValueError(f"input has {x.numel()} elements; this reduce-scatter was built for {self.numel}")
        if out is not None and out.numel() != self.chunk_numel:
            raise ValueError(f"out has {out.numel()} elements; expected chunk_numel {self.chunk_numel}")
        dtype = out.dtype if out is not None else x.dtype
        with timing.span("grads.reduce_scatter"):
            if self.config.mode == "exact":
                result = self._exact(x.detach().reshape(-1))
            else:
                result = self._two_level(x.detach().reshape(-1))
            self.calls += 1
            if out is None:
                return result.to(dtype)
            out.view(-1).copy_(result)
            return out

    __call__ = reduce_scatter

    def state_dict(self) -> dict:
        """This rank's state for checkpoints: the error-feedback residual, the rounding stream
        and the call count, everything a resumed run needs to continue bitwise."""
        # Note: the generator is created now if it is not yet (same seed as at its first use), so
        # that what is saved does not depend on whether this rank has rounded anything yet.
        gen = self._generator(self.device) if self.config.mode == "two_level" else None
        return {
            "residual": None if self.residual is None else self.residual.clone(),
            "generator": generator_state(gen),
            "calls": self.calls,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a saved state; without "generator" or "calls" (older checkpoints) those stay
        as they are."""
        r = state.get("residual")
        self.residual = None if r is None else r.to(self.device).clone()
        if "calls" in state:
            self.calls = int(state["calls"])
        if "generator" in state:
            self._gen = restore_generator(self._gen, state["generator"], self.device)

    def reset_error_feedback(self) -> None:
        self.residual = None

    def held_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(kind, tensor) of what this rank keeps between calls (for sdpq.memory)."""
        if self.residual is not None:
            yield "error_feedback", self.residual

    # ------------------------------------------------------------------ exact

    def _exact(self, x: torch.Tensor) -> torch.Tensor:
        topo = self.topology
        N, cn = topo.world_size, self.chunk_numel
        # A plain reduce-scatter would only bring an inf to the rank owning it: a rank holding a
        # non-finite value sends NaN everywhere instead (finite inputs travel unchanged, so the
        # result is bitwise the plain collective's). One copy of the bucket, never two.
        bad = ~torch.isfinite(x).all()
        if N * cn != self.numel:
            buf = torch.zeros(N * cn, dtype=x.dtype, device=x.device)
            buf[: self.numel] = x
            buf.masked_fill_(bad, _NAN)
        else:
            buf = x.masked_fill(bad, _NAN)
        if N == 1:
            return buf
        res = torch.empty(cn, dtype=x.dtype, device=x.device)
        with timing.span("comm.grads"):
            reduce_scatter_flat(res, buf, topo.world_group)
        item = x.element_size()
        self._rec.record_share("gradients", self._world_elems.scaled(item), self._world_elems, item)
        return res

    # ------------------------------------------------------------------ two-level

    def _generator(self, device: torch.device) -> torch.Generator | None:
        if self.config.rounding != "stochastic":
            return None
        if self._gen is None:
            # Independent streams per rank: rounding errors of different ranks then cancel.
            self._gen = per_rank_generator(self.config.seed, self.topology.rank, device)
        return self._gen

    def _slice_rows(self, x: torch.Tensor, j: int) -> torch.Tensor:
        """Pipeline slice j of the flat bucket x as rows [N, S]: columns j*S .. (j+1)*S of every
        chunk (chunk r in row r), zero past the chunk and past the bucket.

        Note (memory): a view of x (in x's dtype: the encodes read any float dtype, and widening
        to fp32 is exact) when the bucket needs no padding, else an fp32 buffer of one slice: the
        bucket is never copied whole, and a slice's rows are freed once encoded (the stages only
        read them: encodes and sums write new buffers)."""
        N, cn, C, S = self.topology.world_size, self.chunk_numel, self.padded_chunk, self.slice_numel
        if self.placement is not None:  # x is already the padded rows (see _two_level)
            return x.view(N, C)[:, j * S : (j + 1) * S]
        if cn == C and N * cn == self.numel:
            return x.view(N, C)[:, j * S : (j + 1) * S]
        rows = torch.zeros((N, S), dtype=torch.float32, device=x.device)
        lo, hi = j * S, min((j + 1) * S, cn)  # the chunk columns this slice takes from x
        if hi <= lo:
            return rows
        full = self.numel // cn  # chunks that lie in x entirely; chunk `full` partly, if any
        rows[:full, : hi - lo] = x[: full * cn].view(full, cn)[:, lo:hi]
        part = self.numel - full * cn  # elements of chunk `full` in x
        if full < N and part > lo:
            rows[full, : min(hi, part) - lo] = x[full * cn + lo : full * cn + min(hi, part)]
        return rows

    def _two_level(self, x: torch.Tensor) -> torch.Tensor:
        topo, c = self.topology, self.config
        cn, C = self.chunk_numel, self.padded_chunk
        if c.error_feedback and topo.nodes > 1 and self.residual is None:
            self.residual = torch.zeros((topo.nodes, C), dtype=torch.float32, device=x.device)
        sample = self._rec.sample_due(self.calls)
        if self.placement is not None:
            # Note (memory): one padded copy of the bucket in its own dtype, as the unaligned path
            # makes one fp32 slice when a chunk needs padding.
            with timing.span("grads.encode"):
                x = self.placement.pack(x, self.numel).view(-1)
        call = _Call(
            x=x,
            result=torch.empty(0, dtype=torch.float32, device=x.device),  # allocated below
            had=(self.hadamard_block, c.seed) if c.hadamard else None,
            gen=self._generator(x.device),
            sample=sample,
            # The fused path re-quantizes the intra-node sum inside the reduction; error feedback
            # and error sampling need the node partial itself, so they take the unfused inter stage.
            fused_inter=self.residual is None and not sample,
        )
        # Software pipeline: inter(j) is in flight while intra(j+1) is prepared and exchanged.
        # Note (memory): a stage's buffers (sent and received rows, own rows; an exchange's work
        # object holds its input) are dropped as soon as the stage is summed, before the next
        # stage allocates its own.
        intra = [self._issue_intra(call, 0)]  # the intra exchange in flight (none after the last)
        # The result chunk is allocated once slice 0 is encoded: that slice's rows are freed by then.
        call = call._replace(result=torch.empty(C, dtype=torch.float32, device=x.device))
        for j in range(self.slices):
            part = self._finish_intra(call, intra.pop())
            inter = self._issue_inter(call, j, part)
            del part
            if j + 1 < self.slices:
                intra.append(self._issue_intra(call, j + 1))
            self._finish_inter(call, j, inter)
            del inter
        self._record_two_level(x.element_size())
        if self.placement is not None:
            out = torch.empty(cn, dtype=torch.float32, device=x.device)
            self.placement.unpack_chunk(call.result, topo.rank, out)
            out[self._valid_own :] = 0
            return out
        call.result[self._valid_own :] = 0  # padding and past-the-end positions
        return call.result[:cn]

    def _issue_intra(self, call: _Call, j: int) -> _Pending:
        """Encode slice j for the intra-node all-to-all and start it (own row kept exact)."""
        topo, S, had = self.topology, self.slice_numel, call.had
        L, nodes, l = topo.ranks_per_node, topo.nodes, topo.local_rank
        Xj = self._slice_rows(call.x, j)
        if L == 1:  # no intra stage: the "node partial" is the rank's own (transformed) rows
            with timing.span("grads.encode"):
                if nodes > 1 and call.fused_inter:  # straight to the inter stage's wire rows
                    # Note (memory): the encode transforms inside the kernel; no transformed copy.
                    wire, own, bad = encode_rows(
                        Xj, self.inter_spec, hadamard=had, own_row=topo.node, generator=call.gen
                    )
                    return _Pending(_NodePartial(None, wire, own[0], bad), None, None, None)
                return _Pending(_hadamard(Xj, *had) if had else Xj.float(), None, None, None)
        # Wire row l' = chunks {n' * L + l'} of this slice (segments of one row, in node order).
        with timing.span("grads.encode"):
            wire, own, bad = encode_rows(
                Xj, self.intra_spec, segments=nodes, hadamard=had, own_row=l, generator=call.gen
            )
            poison_scales_(wire, self.intra_spec, nodes * S, bad)
        if call.sample:
            seg = (_hadamard(Xj, *had) if had else Xj.float()).reshape(nodes, L, S).transpose(0, 1)
            got = decode_rows(wire, self.intra_spec, nodes * S, torch.empty(L, nodes * S, device=Xj.device))
            others = [k for k in range(L) if k != l]
            self._rec.record_error(
                "gradients", "intra", relative_error(got[others], seg[others].reshape(L - 1, nodes * S))
            )
        del Xj  # (a slice-sized copy, unless a view of x) before the exchange allocates
        with timing.span("comm.grads"):
            recv, work = all_to_all_rows(wire, topo.intra_group, async_op=True)
        return _Pending(own, recv, work, bad)

    def _finish_intra(self, call: _Call, p: _Pending) -> _NodePartial:
        """Wait for the intra-node exchange and sum it: the node partial [nodes, S], or (fused)
        its inter-node wire rows directly."""
        topo, S = self.topology, self.slice_numel
        nodes, l = topo.nodes, topo.local_rank
        if p.recv is None:  # no intra stage (see _issue_intra)
            return p.own if isinstance(p.own, _NodePartial) else _NodePartial(p.own, None, None, None)
        _wait(p.work)
        with timing.span("grads.reduce"):  # decode + sum (+ re-encode for the inter stage)
            if nodes > 1 and call.fused_inter:
                wire, own_p, bad = reduce_rows(
                    p.recv,
                    self.intra_spec,
                    nodes * S,
                    p.own,
                    l,
                    p.bad,
                    encode_spec=self.inter_spec,
                    encode_numel=S,
                    own_seg=topo.node,
                    generator=call.gen,
                )
                return _NodePartial(None, wire, own_p, bad)
            had = call.had if nodes == 1 else None
            P = reduce_rows(p.recv, self.intra_spec, nodes * S, p.own, l, p.bad, hadamard=had)
        return _NodePartial(P.view(nodes, S), None, None, None)

    def _issue_inter(self, call: _Call, j: int, part: _NodePartial) -> _Pending:
        """Encode the node partial for the inter-node all-to-all (unless fused) and start it."""
        topo, S = self.topology, self.slice_numel
        nodes = topo.nodes
        if nodes == 1:
            return _Pending(part.P, None, None, None)
        wire, own_p, bad = part.wire, part.own_p, part.bad
        if wire is None:  # unfused: error feedback / error sampling / no intra stage
            wire, own_p, bad = self._encode_inter(call, j, part.P)
        with timing.span("grads.encode"):
            poison_scales_(wire, self.inter_spec, S, bad)
        with timing.span("comm.grads"):
            recv, work = all_to_all_rows(wire, topo.inter_group, async_op=True)
        return _Pending(own_p, recv, work, bad)

    def _encode_inter(self, call: _Call, j: int, P: torch.Tensor) -> tuple:
        """The unfused inter-node encode of a node partial: error feedback in and out, error
        sampling. -> (wire rows, own row, non-finite groups)."""
        S, nodes, node = self.slice_numel, self.topology.nodes, self.topology.node
        with timing.span("grads.encode"):
            if self.residual is not None:
                P = P + self.residual[:, j * S : (j + 1) * S]
            wire, own, bad = encode_rows(P, self.inter_spec, own_row=node, generator=call.gen)
            if self.residual is not None or call.sample:
                # Note (memory): one partial-sized buffer, reused in place (P may be a view of the input).
                deq = decode_rows(wire, self.inter_spec, S, torch.empty(nodes, S, device=P.device))
                deq.masked_fill_(bad, _NAN)
                if call.sample:
                    others = [m for m in range(nodes) if m != node]
                    self._rec.record_error("gradients", "inter", relative_error(deq[others], P[others]))
                if self.residual is not None:
                    res = torch.sub(P, deq, out=deq)
                    res[node] = 0  # own row is summed exactly
                    # Note: an overflowing step is skipped by the caller; do not carry NaN forward.
                    self.residual[:, j * S : (j + 1) * S] = res.masked_fill_(bad, 0.0)
        return wire, own[0], bad

    def _finish_inter(self, call: _Call, j: int, p: _Pending) -> None:
        """Wait for the inter-node exchange; sum, inverse-transform and store slice j."""
        S, L, had = self.slice_numel, self.topology.ranks_per_node, call.had
        out = call.result[j * S : (j + 1) * S]
        if p.recv is None:  # one node: own is the node partial (already inverse-transformed if L > 1)
            y = p.own[0]
            with timing.span("grads.reduce"):
                out[:] = _inverse_hadamard(y, *had) if had and L == 1 else y
            return
        _wait(p.work)
        with timing.span("grads.reduce"):  # decode + sum + inverse Hadamard
            out[:] = reduce_rows(p.recv, self.inter_spec, S, p.own, self.topology.node, p.bad, hadamard=had)

    def _record_two_level(self, itemsize: int) -> None:
        topo = self.topology
        L, nodes, S, k = topo.ranks_per_node, topo.nodes, self.slice_numel, self.slices
        if L > 1:
            b = (L - 1) * k * self.intra_spec.wire_bytes(nodes * S)
            self._rec.record(
                "gradients", "intra", bytes=b, elements=self._intra_elems, baseline_bytes=self._intra_elems * itemsize
            )
        if nodes > 1:
            b = (nodes - 1) * k * self.inter_spec.wire_bytes(S)
            self._rec.record(
                "gradients", "inter", bytes=b, elements=self._inter_elems, baseline_bytes=self._inter_elems * itemsize
            )
