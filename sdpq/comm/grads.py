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

import torch

from ..config import GradientsConfig, StatsConfig
from ..quant import QuantSpec
from ..quant.fused import decode_rows, encode_rows, poison_scales_, reduce_rows
from ..quant.groupwise import SCALE_DTYPES, relative_error
from ..quant.hadamard import hadamard as _hadamard
from ..quant.hadamard import inverse_hadamard as _inverse_hadamard
from . import timing
from ._exchange import all_to_all_rows, reduce_scatter_flat
from ._rng import generator_state, restore_generator
from .agreement import check_agreement
from .stats import CommStats, Recorder
from .topology import Topology

__all__ = ["GradReduceScatter"]

_NAN = float("nan")


class GradReduceScatter:
    """Reduce-scatter (SUM) of one flat bucket. Every rank builds it with the same arguments
    and calls it collectively.

    numel: elements of the full input bucket; each rank gets `chunk_numel` = ceil(numel / N)
    (elements past the end of the bucket, on the last ranks, are returned as zeros).
    stats / record_to: what to record (StatsConfig) and into which CommStats (default: the
    process-wide one, sdpq.stats.of()).
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
    ):
        if numel < 1:
            raise ValueError(f"GradReduceScatter: numel must be positive, got {numel}")
        self.config = c = config or GradientsConfig()
        self.topology = topo = topology
        self.numel = numel
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        N, L, nodes = topo.world_size, topo.ranks_per_node, topo.nodes
        self.chunk_numel = -(-numel // N)
        cn = self.chunk_numel
        valid = [max(0, min(cn, numel - r * cn)) for r in range(N)]
        groups = max(c.intra_group_size if L > 1 else 1, c.inter_group_size if nodes > 1 else 1)
        # Note: a Hadamard block larger than the chunk would pad every chunk up to the block (a
        # 65536 block on 1024-element chunks sends ~64x the bytes); it is clamped to the chunk
        # rounded up to a power of two (never below the groups). Every rank derives the same block.
        self.hadamard_block = min(c.hadamard_block, max(groups, 1 << max(0, cn - 1).bit_length())) if c.hadamard else 1
        align = max(groups, self.hadamard_block)
        # Fewer slices for small buckets: each slice must hold at least one aligned block.
        self.slices = max(1, min(c.pipeline_chunks, -(-cn // align)))
        step = align * self.slices
        self.padded_chunk = -(-cn // step) * step if c.mode == "two_level" else cn
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
        l, n = topo.local_rank, topo.node
        # Bucket elements that leave this rank on each link per call (padding excluded).
        self._intra_elems = sum(valid[m * L + k] for m in range(nodes) for k in range(L) if k != l)
        self._inter_elems = sum(valid[m * L + l] for m in range(nodes) if m != n)
        self._world_elems = {
            "intra": sum(valid[n * L + k] for k in range(L) if k != l),
            "inter": sum(valid[r] for r in range(N) if r // L != n),
        }
        self._valid_own = valid[topo.rank]
        check_agreement(
            "GradReduceScatter",
            {"gradients": dataclasses.asdict(c), "numel": numel, "layout": topo.layout},
            topo.world_group,
        )
        self.residual: torch.Tensor | None = None  # error feedback of the inter-node stage
        self.calls = 0
        self._rec = Recorder(stats, record_to)
        self._gen: torch.Generator | None = None

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

    # ------------------------------------------------------------------ exact

    def _exact(self, x: torch.Tensor) -> torch.Tensor:
        topo = self.topology
        N, cn = topo.world_size, self.chunk_numel
        buf = x
        if N * cn != self.numel:
            buf = torch.zeros(N * cn, dtype=x.dtype, device=x.device)
            buf[: self.numel] = x
        # A plain reduce-scatter would only bring an inf to the rank owning it: a rank holding a
        # non-finite value sends NaN everywhere instead (finite inputs travel unchanged, so the
        # result is bitwise the plain collective's).
        buf = torch.where(torch.isfinite(x).all(), buf, _NAN)
        if N == 1:
            return buf
        res = torch.empty(cn, dtype=x.dtype, device=x.device)
        with timing.span("comm.grads"):
            reduce_scatter_flat(res, buf, topo.world_group)
        item = x.element_size()
        for link, elems in self._world_elems.items():
            if elems:
                self._rec.record("gradients", link, bytes=elems * item, elements=elems, baseline_bytes=elems * item)
        return res

    # ------------------------------------------------------------------ two-level

    def _generator(self, device: torch.device) -> torch.Generator | None:
        if self.config.rounding != "stochastic":
            return None
        if self._gen is None:
            # Independent streams per rank: rounding errors of different ranks then cancel.
            self._gen = torch.Generator(device=device).manual_seed(
                self.config.seed * 1_000_003 + self.topology.rank + 1
            )
        return self._gen

    def _two_level(self, x: torch.Tensor) -> torch.Tensor:
        topo, c = self.topology, self.config
        N, L, nodes = topo.world_size, topo.ranks_per_node, topo.nodes
        l, node = topo.local_rank, topo.node
        cn, C, S = self.chunk_numel, self.padded_chunk, self.slice_numel
        flat = torch.zeros(N * cn, dtype=torch.float32, device=x.device)
        flat[: self.numel] = x
        X = torch.zeros((N, C), dtype=torch.float32, device=x.device)
        X[:, :cn] = flat.view(N, cn)
        del flat
        if c.error_feedback and nodes > 1 and self.residual is None:
            self.residual = torch.zeros((nodes, C), dtype=torch.float32, device=x.device)
        sample = self._rec.sample_due(self.calls)
        gen = self._generator(x.device)
        had = (self.hadamard_block, c.seed) if c.hadamard else None
        # The fused path re-quantizes the intra-node sum inside the reduction; error feedback and
        # error sampling need the node partial itself, so they take the unfused inter stage.
        fused_inter = self.residual is None and not sample
        result = torch.empty(C, dtype=torch.float32, device=x.device)

        def issue_intra(j: int):
            Xj = X[:, j * S : (j + 1) * S]
            if L == 1:  # no intra stage: the "node partial" is the rank's own (transformed) rows
                with timing.span("grads.encode"):
                    return (_hadamard(Xj, *had) if had else Xj), None, None, None
            # Wire row l' = chunks {n' * L + l'} of this slice (segments of one row, in node order).
            with timing.span("grads.encode"):
                wire, own, bad = encode_rows(
                    Xj, self.intra_spec, segments=nodes, hadamard=had, own_row=l, generator=gen
                )
                poison_scales_(wire, self.intra_spec, nodes * S, bad)
            if sample:
                seg = (_hadamard(Xj, *had) if had else Xj).reshape(nodes, L, S).transpose(0, 1)
                got = decode_rows(wire, self.intra_spec, nodes * S, torch.empty(L, nodes * S, device=x.device))
                others = [k for k in range(L) if k != l]
                self._rec.record_error(
                    "gradients", "intra", relative_error(got[others], seg[others].reshape(L - 1, nodes * S))
                )
            with timing.span("comm.grads"):
                recv, work = all_to_all_rows(wire, topo.intra_group, async_op=True)
            return own, recv, work, bad

        def finish_intra(state):
            """-> (node partial [nodes, S] or None, inter wire or None, own inter row, bad)."""
            own, recv, work, bad = state
            if recv is None:
                return own, None, None, None
            with timing.span("comm.grads"):
                work.wait()
            with timing.span("grads.reduce"):  # decode + sum (+ re-encode for the inter stage)
                if nodes > 1 and fused_inter:
                    wire, own_p, bad2 = reduce_rows(
                        recv,
                        self.intra_spec,
                        nodes * S,
                        own,
                        l,
                        bad,
                        encode_spec=self.inter_spec,
                        encode_numel=S,
                        own_seg=node,
                        generator=gen,
                    )
                    return None, wire, own_p, bad2
                P = reduce_rows(recv, self.intra_spec, nodes * S, own, l, bad, hadamard=had if nodes == 1 else None)
            return P.view(nodes, S), None, None, None

        def issue_inter(j: int, state):
            P, wire, own_p, bad = state
            if nodes == 1:
                return P, None, None, None
            if wire is None:  # unfused: error feedback / error sampling / no intra stage
                with timing.span("grads.encode"):
                    if self.residual is not None:
                        P = P + self.residual[:, j * S : (j + 1) * S]
                    wire, own, bad = encode_rows(P, self.inter_spec, own_row=node, generator=gen)
                    own_p = own[0]
                    if self.residual is not None or sample:
                        deq = decode_rows(wire, self.inter_spec, S, torch.empty(nodes, S, device=x.device))
                        deq = torch.where(bad, _NAN, deq)
                        if sample:
                            others = [m for m in range(nodes) if m != node]
                            self._rec.record_error("gradients", "inter", relative_error(deq[others], P[others]))
                        if self.residual is not None:
                            res = P - deq
                            res[node] = 0  # own row is summed exactly
                            # Note: an overflowing step is skipped by the caller; do not carry NaN forward.
                            self.residual[:, j * S : (j + 1) * S] = torch.where(bad, 0.0, res)
            with timing.span("grads.encode"):
                poison_scales_(wire, self.inter_spec, S, bad)
            with timing.span("comm.grads"):
                recv, work = all_to_all_rows(wire, topo.inter_group, async_op=True)
            return own_p, recv, work, bad

        def finish_inter(j: int, state) -> None:
            own_p, recv, work, bad = state
            if recv is None:  # one node: own_p is the node partial (already inverse-transformed if L > 1)
                y = own_p[0]
                with timing.span("grads.reduce"):
                    result[j * S : (j + 1) * S] = _inverse_hadamard(y, *had) if had and L == 1 else y
                return
            with timing.span("comm.grads"):
                work.wait()
            with timing.span("grads.reduce"):  # decode + sum + inverse Hadamard
                result[j * S : (j + 1) * S] = reduce_rows(recv, self.inter_spec, S, own_p, node, bad, hadamard=had)

        # Software pipeline: inter(j) is in flight while intra(j+1) is prepared and exchanged.
        intra_state = issue_intra(0)
        for j in range(self.slices):
            inter_state = issue_inter(j, finish_intra(intra_state))
            if j + 1 < self.slices:
                intra_state = issue_intra(j + 1)
            finish_inter(j, inter_state)
        self._record_two_level(x.element_size())
        result[self._valid_own :] = 0  # padding and past-the-end positions
        return result[:cn]

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
