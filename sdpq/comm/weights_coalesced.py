"""WeightGather.gather of several buckets with one collective per link instead of one per bucket.

ZeRO-3 fetches a module's parameters together, but each parameter is its own bucket (its own
reference: prefetching changes which parameters travel together, so the parameter is the only
stable unit). Gathered one by one, a fetch of k parameters costs 2k collectives; here the
pending difference rows of all k travel in one inter-node all-gather and their node payloads
(references, or on one node the shards) in one intra-node all-gather. Every byte, every rounding
and every statistic is the one-by-one gather's: only the number of collectives changes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import timing
from ._exchange import all_gather_rows
from .weights import WeightGather

__all__ = ["gather_coalesced"]


def _coalescible(gathers: Sequence[WeightGather], outs: Sequence[torch.Tensor]) -> bool:
    first = gathers[0]
    return (
        len(gathers) > 1
        and all(g.config.mode == "diff" and g.topology is first.topology for g in gathers)
        and all(g.reference_kind == first.reference_kind for g in gathers)
        and all(o.dtype == outs[0].dtype for o in outs)
    )


def gather_coalesced(
    gathers: Sequence[WeightGather], shards: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]
) -> None:
    """``g.gather(shard, out=out)`` for every (g, shard, out), as collectives on every rank with
    the same gathers in the same order. Gathers that share a topology in diff mode (and outputs
    of one dtype) are coalesced; anything else is gathered one by one."""
    if not (len(gathers) == len(shards) == len(outs)):
        raise ValueError(f"gather_coalesced: {len(gathers)} gathers, {len(shards)} shards, {len(outs)} outputs")
    if not gathers:
        return
    if not _coalescible(gathers, outs):
        for g, shard, out in zip(gathers, shards, outs):
            g.gather(shard, out=out)
        return
    topo, dtype = gathers[0].topology, outs[0].dtype
    with timing.span("weights.gather"):
        # Refreshes: exact ones (first use, resync, a failed verification) go one by one inside
        # _refresh_start; the difference rows of the others share one inter-node all-gather. A
        # gather without a refresh sends its reference only and never reads its shard.
        pending = []
        for g, s in zip(gathers, shards):
            if not (g.holds_reference and g.dirty):
                g._check_shard(s)
                continue
            w = g._shard_copy(s, torch.float32)
            row = g._refresh_start(w, s.dtype)
            if row is not None:
                pending.append((g, w, row))
        if pending:
            with timing.span("comm.weights"):
                rows, _ = all_gather_rows(torch.cat([row for _, _, row in pending]), topo.inter_group)
            at = 0
            for g, w, row in pending:
                g._refresh_finish(w, rows[:, at : at + row.numel()])
                at += row.numel()
        # One intra-node all-gather of every bucket's payload (its R_l, or its shard on one node).
        payloads = [g._node_payload(s, dtype) for g, s in zip(gathers, shards)]
        sizes = [p.numel() for p in payloads]
        with timing.span("comm.weights"):
            rows, _ = all_gather_rows(torch.cat(payloads), topo.intra_group)
        at = 0
        for g, n, out in zip(gathers, sizes, outs):
            direct = out.numel() == g.padded_numel and out.is_contiguous()
            full = g._place_gathered(rows[:, at : at + n], dtype, out.view(-1) if direct else None)
            g._output(full, out)
            at += n
