"""Weight all-gather of one flat bucket (docs/architecture.md).

The bucket of `numel` elements is split into N equal shards of C = ceil(numel / N) (the last
padded with zeros); rank r owns shard r. `gather(shard)` returns the full bucket on every rank.

Modes:
- "diff": rank (n, l) keeps the node-resident reference R_l = shards {n' * L + l} (in the
  compute dtype by default; bf16, fp16, fp32 or int8 by `weights.reference`, see reference.py). Once per weight version
  (`mark_weights_changed(exact=False)`), the owner sends Q4(shard - R_l[n]) over the inter-node
  group and every holder of R_l adds the dequantized differences; every gather is then an
  intra-node all-gather of R_l in the compute dtype. Cross-node traffic: ~4 bits per element
  once per step instead of 16 bits per gather. On one node nothing crosses a slow link and no
  reference is kept: every gather is the exact one (`holds_reference` is False).
- "direct": int8 of the weights themselves, all-gathered over the world on every call (stateless).
- "exact": plain all-gather in the compute dtype.

Note (invariants): compute uses the reconstructed weights on every rank, the owner's own shard
included; R_l is bitwise identical across its holders because every holder, owner included,
applies the same dequantized bytes with the same fp32 arithmetic; differences are taken in fp32
against the reconstruction, so each refresh's error is fed back into the next one (no drift).

Note (hot path): `gather` never reads a device value on the host. What a refresh learns about
the reference (a non-finite weight reached it; verify_every found its holders disagreeing) is
kept as a flag on the device (reference_health.py) and read by the next `mark_weights_changed()`,
outside the hooks, which makes the following refresh exact. Every holder of R_l computes those
flags from the same gathered bytes, so all of them take that decision alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import torch

from ..config import StatsConfig, WeightsConfig
from ..kernels import decode_rows, encode_rows
from ..quant import QuantSpec
from ..quant.groupwise import SCALE_DTYPES, relative_error
from ..quant.rows import wire_nonfinite
from . import timing
from ._exchange import all_gather_rows
from ._rng import generator_state, restore_generator
from .agreement import check_agreement
from .reference import Reference, make_reference, reference_kind
from .reference_health import ReferenceHealth, ReferenceMismatchWarning
from .segments import BucketLayout, Segment, aligned_group_spec
from .stats import CommStats, Recorder
from .topology import Topology

__all__ = ["WeightGather", "ReferenceMismatchWarning"]  # the warning: re-exported from reference_health


class WeightGather:
    """All-gather of one flat bucket. Every rank builds it with the same arguments and calls
    every method collectively (all ranks, same order), like any torch.distributed collective.

    numel: elements of the full bucket. dtype: the compute dtype of the gathered output
    (default fp32). The storage of R_l in diff mode is the config's `reference`.
    stats / record_to: what to record (StatsConfig) and into which CommStats (default: the
    process-wide one, sdpq.stats.of()).
    """

    def __init__(
        self,
        numel: int,
        topology: Topology,
        config: WeightsConfig | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        stats: StatsConfig | None = None,
        record_to: CommStats | None = None,
        segments: Sequence[Segment] | None = None,
    ):
        if numel < 1:
            raise ValueError(f"WeightGather: numel must be positive, got {numel}")
        self.config = config or WeightsConfig()
        self.topology = topology
        self.numel = numel
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        N = topology.world_size
        self.shard_numel = -(-numel // N)
        self.padded_numel = self.shard_numel * N
        # Valid (non-padding) elements of every shard, for honest per-element byte counts.
        self._valid = [max(0, min(self.shard_numel, numel - r * self.shard_numel)) for r in range(N)]
        c = self.config
        self.spec = QuantSpec(
            bits=c.bits if c.mode == "diff" else 8,
            group_size=c.group_size,
            rounding=c.rounding,
            scale_dtype=SCALE_DTYPES[c.scale_dtype],
        )
        self.placement: BucketLayout | None = None  # where the shard's parameters lie on the wire
        if segments is not None and c.mode != "exact":
            self.spec, self.placement = aligned_group_spec(self.spec, segments, self.shard_numel)
        self.reference_kind = reference_kind(c.reference, dtype)  # "auto" resolved
        check_agreement(
            "WeightGather",
            {
                "weights": dataclasses.asdict(c),
                "numel": numel,
                "dtype": str(dtype),
                "reference": self.reference_kind,
                "layout": topology.layout,
                "placement": None if self.placement is None else (self.spec.group_size, self.placement.digest()),
            },
            topology.world_group,
        )
        # Note: a reference only where weights cross nodes; on one node R_l would be the shard itself.
        self.holds_reference = c.mode == "diff" and topology.nodes > 1
        self._store: Reference | None = None  # R_l, made at the first refresh
        self.dirty = True
        self.version = 0  # refreshes done
        self.calls = 0  # gathers done
        self._force_exact = False
        # Set on the device by a refresh, read by mark_weights_changed (see the module docstring).
        self._rec = Recorder(stats, record_to)
        self._health = ReferenceHealth(topology, self.device, self._rec)
        self._gen: torch.Generator | None = None

    # ------------------------------------------------------------------ public API

    def mark_weights_changed(self, *, exact: bool = True) -> None:
        """The weights changed (optimizer step, checkpoint load, a manual edit): the next gather
        refreshes the reference. `exact=True` (default) makes that refresh an exact exchange, right
        for a change of any size; `exact=False` sends a quantized difference, right for the small
        updates of an optimizer step (what the integrations' step hooks pass). Call on every rank,
        outside the hot path: it reads what the last refresh flagged on the device (a non-finite
        weight, a failed verification), which makes the next refresh exact."""
        # Note: one default for every mark_weights_changed (this one, sdpq.fsdp's, the DeepSpeed
        # adapter's): exact. A caller that does not say otherwise cannot know how far the weights
        # moved, and a quantized difference of a large jump (a loaded checkpoint, an edit by hand)
        # is a large error in the next forward; the exact refresh costs one unquantized gather.
        # Only the optimizer-step hooks know their updates are small, and they pass exact=False.
        self._force_exact = self._health.settle() or self._force_exact
        self.dirty = True
        self._force_exact = self._force_exact or exact

    def gather(self, shard: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's shard (any float dtype, <= shard_numel elements) -> the full bucket
        (`numel` elements, or `out`'s, which may hold numel or padded_numel elements)."""
        with timing.span("weights.gather"):
            dtype = out.dtype if out is not None else self.dtype
            mode = self.config.mode
            # Note: a padded, contiguous `out` receives the gathered rows directly (no full-size
            # buffer, no copy afterwards).
            into = None
            if out is not None and out.numel() == self.padded_numel and out.is_contiguous():
                into = out.view(-1)
            # Note: read the shard into a copy before writing `out` (FSDP2 passes a slice of out as
            # the input). fp32 for the quantized modes (differences in fp32), the output dtype for
            # the exact one (bitwise the plain gather, whatever the dtype). A diff gather without a
            # refresh sends the reference only and never reads the shard.
            if mode == "diff":
                if self.holds_reference and self.dirty:
                    self._refresh(self._shard_copy(shard, torch.float32), shard.dtype)
                full = self._gather_node(self._node_payload(shard, dtype), dtype, into)
            elif mode == "direct":
                full = self._gather_direct(self._shard_copy(shard, torch.float32), dtype)
            else:
                full = self._gather_exact(self._shard_copy(shard, dtype), into)
            return self._output(full, out)

    def _check_shard(self, shard: torch.Tensor) -> None:
        if shard.numel() > self.shard_numel:
            raise ValueError(f"shard has {shard.numel()} elements, more than shard_numel {self.shard_numel}")

    def _shard_copy(self, shard: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The shard, zero-padded to shard_numel, as a new tensor of `dtype`."""
        self._check_shard(shard)
        if shard.numel() == self.shard_numel:
            return shard.detach().reshape(-1).to(dtype, copy=True)
        w = torch.zeros(self.shard_numel, dtype=dtype, device=shard.device)
        w[: shard.numel()] = shard.detach().reshape(-1)
        return w

    def _output(self, full: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """The gathered bucket as gather() returns it (`full` copied into `out` where it is not out)."""
        self.calls += 1
        if out is None:
            return full[: self.numel]
        if out.numel() not in (self.numel, self.padded_numel):
            raise ValueError(f"out has {out.numel()} elements; expected {self.numel} or {self.padded_numel}")
        if full.data_ptr() != out.data_ptr():
            out.view(-1).copy_(full[: out.numel()])
        return out

    __call__ = gather

    @property
    def reference(self) -> torch.Tensor | None:
        """The storage of R_l (fp32, bf16 or fp16 [nodes, C]; int8: its 8-bit wire rows), None before
        the first refresh and wherever no reference is kept."""
        return None if self._store is None else self._store.tensor

    @property
    def reference_bytes(self) -> int:
        """Bytes this rank keeps for R_l now (0 before the first refresh and on one node)."""
        return 0 if self._store is None else self._store.nbytes

    def held_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(kind, tensor) of what this rank keeps between gathers (for sdpq.memory)."""
        if self._store is not None:
            yield "weight_reference", self._store.tensor
        for t in self._health.tensors():
            yield "sdpq_buffers", t

    def reconstructed_shard(self) -> torch.Tensor:
        """diff mode across nodes: this rank's own shard as every rank reconstructs it (fp32, C elements)."""
        if self._store is None:
            raise RuntimeError("no reference: gather at least once (one node keeps none)")
        return self._store.own_values(self.topology.node)

    def new_reference(self, device: torch.device | str | None = None) -> Reference:
        """A zero reference of this gather's kind and shape (what the first refresh fills)."""
        return make_reference(
            self.reference_kind, self.topology.nodes, self.shard_numel, self.spec, self.placement,
            device if device is not None else self.device,
        )  # fmt: skip

    def state_dict(self) -> dict:
        """This rank's state for checkpoints (restore it with load_state_dict): the reference and
        its version, the pending refresh (dirty, force_exact), the rounding stream and the call
        count, everything a resumed run needs to continue bitwise."""
        # Note: the generator is created now if it is not yet (same seed as at its first use), so
        # that what is saved does not depend on whether this rank has rounded anything yet.
        gen = self._generator(self.device) if self.config.mode != "exact" else None
        self._force_exact = self._health.settle() or self._force_exact  # a pending exact refresh is state
        return {
            "mode": self.config.mode,
            "layout": self.topology.layout,
            "numel": self.numel,
            "version": self.version,
            "reference": None if self.reference is None else self.reference.detach().clone(),
            "generator": generator_state(gen),
            "force_exact": self._force_exact,
            "calls": self.calls,
            "dirty": self.dirty,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a saved state. A state without "dirty" (older checkpoints, or a caller that
        restored the weights too) leaves the gather dirty: the next gather refreshes with a
        difference against the restored reference, not an exact exchange. Without "generator",
        "force_exact" or "calls" those stay as they are."""
        for key, mine in (("mode", self.config.mode), ("layout", self.topology.layout), ("numel", self.numel)):
            if state.get(key) != mine:
                raise ValueError(f"WeightGather state has {key}={state.get(key)!r}, this gather has {mine!r}")
        ref = state["reference"]
        if not self.holds_reference:
            ref = None  # Note: a checkpoint of the one-node reference (the shard itself): nothing to keep
        self._store = None
        if ref is not None:
            self._store = self.new_reference()
            self._store.load(ref)
        self.version = int(state["version"])
        self.dirty = bool(state.get("dirty", True))
        if "force_exact" in state:
            self._force_exact = bool(state["force_exact"])
        if "calls" in state:
            self.calls = int(state["calls"])
        if "generator" in state:
            self._gen = restore_generator(self._gen, state["generator"], self.device)
        self._health.clear()  # what the replaced reference had flagged no longer applies

    def _generator(self, device: torch.device) -> torch.Generator | None:
        """The stochastic-rounding stream (None with nearest rounding), created at first use."""
        if self.spec.rounding != "stochastic":
            return None
        if self._gen is None:
            self._gen = torch.Generator(device=device).manual_seed(0x5D9 + self.topology.rank)
        return self._gen

    # ------------------------------------------------------------------ diff mode

    def _refresh(self, w: torch.Tensor, wire_dtype: torch.dtype) -> None:
        row = self._refresh_start(w, wire_dtype)
        if row is not None:
            with timing.span("comm.weights"):
                rows, _ = all_gather_rows(row, self.topology.inter_group)
            self._refresh_finish(w, rows)

    # Note: a refresh in two halves around its inter-node all-gather, so that gather_coalesced
    # (weights_coalesced.py) can send the rows of several buckets in one collective.
    def _refresh_start(self, w: torch.Tensor, wire_dtype: torch.dtype) -> torch.Tensor | None:
        """Refreshes the reference when that needs no difference exchange (one node, or an exact
        exchange) and returns None; else returns this rank's encoded row for _refresh_finish."""
        topo, c = self.topology, self.config
        if self._store is None:
            self._store = self.new_reference(w.device)
            self.version = 0
        exact = self.version == 0 or self._force_exact or (c.resync_every > 0 and self.version % c.resync_every == 0)
        if not exact and c.verify_every > 0 and self.version % c.verify_every == 0:
            self._health.verify(self._ref.tensor)
        if not exact:
            # Note: the fp32 difference is taken against the reconstruction R, not the last weights.
            ref, gen = self._ref.placed_row(topo.node), self._generator(w.device)
            with timing.span("weights.encode"):
                row, _, _ = encode_rows(self._placed(w), self.spec, ref=ref, generator=gen)
            return row.view(-1)
        self._exchange_exact(w, wire_dtype)
        self._refresh_done(w)
        return None

    def _refresh_finish(self, w: torch.Tensor, rows: torch.Tensor) -> None:
        """Applies the gathered rows [nodes, row bytes] of every holder of R_l."""
        with timing.span("weights.decode"):
            # Note: the owner adds the dequantized bytes it sent (not d itself): all copies stay equal.
            self._ref.add(rows)
            # An inf/nan weight poisons R_l (its group decodes to NaN: the gathered weights show
            # it); the refresh after the next mark is exact, so that the reference recovers once
            # the weights are finite again.
            self._health.flag_nonfinite(wire_nonfinite(rows, self.spec, self._wire_numel))
        self._record_refresh(rows.shape[1])
        self._refresh_done(w)

    def _refresh_done(self, w: torch.Tensor) -> None:
        if self._rec.sample_due(self.version):
            own = self._ref.own_values(self.topology.node)
            self._rec.record_error("weights", "inter", relative_error(own, w))
        self.version += 1
        self.dirty = False

    @property
    def _wire_numel(self) -> int:
        """Elements of a shard on the wire: with a placement, its parameters on whole groups."""
        return self.shard_numel if self.placement is None else self.placement.padded_chunk

    def _placed(self, shard: torch.Tensor) -> torch.Tensor:
        """A shard as the one row the encoder reads (its parameters placed on whole groups)."""
        if self.placement is None:
            return shard.view(1, -1)
        return self.placement.pack(shard.reshape(-1), self.shard_numel)

    def _decoded(self, rows: torch.Tensor) -> torch.Tensor:
        """Gathered wire rows -> fp32 [rows, shard_numel] (their placement undone)."""
        n = self._wire_numel
        full = decode_rows(rows, self.spec, n, torch.empty((rows.shape[0], n), dtype=torch.float32, device=rows.device))
        return full if self.placement is None else self.placement.unpack(full).view(rows.shape[0], -1)

    @property
    def _ref(self) -> Reference:
        """The node-resident reference R_l (diff mode across nodes, the only case that keeps one)."""
        assert self._store is not None, "only the diff mode across nodes keeps a reference"
        return self._store

    def _exchange_exact(self, w: torch.Tensor, wire_dtype: torch.dtype) -> None:
        topo = self.topology
        # Send the shard in its own dtype: exact, and no more bytes than an ordinary gather.
        row = w.to(wire_dtype).view(torch.uint8)
        with timing.span("comm.weights"):
            rows, _ = all_gather_rows(row, topo.inter_group)
        self._ref.set(rows.view(wire_dtype).float())
        self._force_exact = False
        self._record_refresh(row.numel())

    def _record_refresh(self, row_bytes: int) -> None:
        # Baseline: the same elements crossing the link in the compute dtype (a plain gather).
        peers = self.topology.nodes - 1
        valid = self._valid[self.topology.rank]
        self._rec.record(
            "weights",
            "inter",
            bytes=peers * row_bytes,
            elements=peers * valid,
            baseline_bytes=peers * valid * self.dtype.itemsize,
        )

    def _node_payload(self, shard: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """diff mode: what this rank sends in the node's all-gather (1-D): its R_l, or on one
        node (no reference) its shard in the output dtype."""
        if self.holds_reference:
            return self._ref.payload(dtype)
        self.dirty = False  # every gather reads the shard: there is nothing to refresh
        return self._shard_copy(shard, dtype)

    def _gather_node(self, payload: torch.Tensor, dtype: torch.dtype, into: torch.Tensor | None = None) -> torch.Tensor:
        direct = into if not self.holds_reference and into is not None and into.dtype == dtype else None
        with timing.span("comm.weights"):
            rows, _ = all_gather_rows(payload, self.topology.intra_group, out=direct)  # [L, payload]
        return self._place_gathered(rows, dtype, into)

    def _place_gathered(self, rows: torch.Tensor, dtype: torch.dtype, into: torch.Tensor | None = None) -> torch.Tensor:
        """The node's gathered payloads [L, payload] -> the bucket in global order (into `into`
        when given)."""
        topo = self.topology
        L, nodes, C = topo.ranks_per_node, topo.nodes, self.shard_numel
        if L > 1:
            valid = sum(self._valid[n * L + topo.local_rank] for n in range(nodes))
            self._rec.record(
                "weights",
                "intra",
                bytes=(L - 1) * rows.shape[1] * rows.element_size(),
                elements=(L - 1) * valid,
                baseline_bytes=(L - 1) * valid * dtype.itemsize,
            )
        if not self.holds_reference:  # one node: the shards in rank order already
            if into is not None and rows.data_ptr() == into.data_ptr():
                return into
            full = rows.reshape(-1)
            return full if into is None else into.copy_(full)
        # [L, nodes, C] -> global order [nodes, L, C]: chunk n * L + l.
        ordered = self._ref.unpack_gathered(rows, dtype).transpose(0, 1)
        if into is None:
            return ordered.reshape(-1)
        into.view(nodes, L, C).copy_(ordered)
        return into

    # ------------------------------------------------------------------ direct / exact

    def _record_world(self, row_bytes: int, itemsize: int) -> None:
        topo = self.topology
        self._rec.record_all_gather("weights", topo, row_bytes, self._valid[topo.rank], itemsize)

    def _gather_direct(self, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        topo = self.topology
        with timing.span("weights.encode"):
            row, _, _ = encode_rows(self._placed(w), self.spec, generator=self._generator(w.device))
        with timing.span("comm.weights"):
            rows, _ = all_gather_rows(row.view(-1), topo.world_group)
        with timing.span("weights.decode"):
            # Note: every rank decodes every shard from the same bytes, its own included.
            full = self._decoded(rows)
        self._record_world(row.numel(), dtype.itemsize)
        if self._rec.sample_due(self.calls):
            own = full[topo.rank]
            self._rec.record_error("weights", "inter" if topo.nodes > 1 else "intra", relative_error(own, w))
        return full.to(dtype).reshape(-1)

    def _gather_exact(self, src: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        topo = self.topology
        with timing.span("comm.weights"):
            rows, _ = all_gather_rows(src, topo.world_group, out=into)
        self._record_world(src.numel() * src.element_size(), src.element_size())
        return rows.reshape(-1)
