"""Quantized all-reduce across a group (sdpq.comm.allreduce), on real gloo ranks: the replicate
groups of 4 ranks as 2 nodes x 2 ({0, 2} and {1, 3}: one rank per node), or the whole world."""

import math

import pytest
import torch
import torch.distributed as torch_dist
from comm_reference import all_inputs

from sdpq.comm import CommStats, GradAllReduce, GradReduceScatter, Topology
from sdpq.config import GradientsConfig
from sdpq.quant import hadamard


def _replicate_group(ctx, across_nodes: bool):
    """This rank's group: one rank per node ({l, l + L, ...}), or the whole world."""
    world = Topology.build(ctx.ranks_per_node)
    if not across_nodes:
        return world, list(range(ctx.world_size))
    groups = [list(range(l, ctx.world_size, ctx.ranks_per_node)) for l in range(ctx.ranks_per_node)]
    pgs = [torch_dist.new_group(g) for g in groups]
    me = ctx.rank % ctx.ranks_per_node
    return Topology.for_group(pgs[me], world), groups[me]


def _all_reduce_case(ctx, numel, cfg_kwargs, across_nodes, dtype, kind):
    topo, members = _replicate_group(ctx, across_nodes)
    cfg = GradientsConfig(**cfg_kwargs)
    rec = CommStats()
    ar = GradAllReduce(numel, topo, cfg, record_to=rec)
    inputs = all_inputs(ctx.world_size, numel, "normal" if kind == "inf" else kind, 5)
    if kind == "inf":  # one member of every group holds an inf
        inputs[members[-1], numel // 3] = math.inf
    x = inputs[ctx.rank].to(dtype).clone()
    out = ar(x)
    exact = inputs[members].to(dtype).double().sum(0)
    res = {"out": out.clone(), "exact": exact, "members": members, "layout": topo.layout, "stats": rec.as_dict()}
    if cfg.mode == "two_level" and cfg.rounding == "nearest":
        # Phase 1 again (nearest rounding: deterministic), every member's reduced chunk exactly.
        rs = GradReduceScatter(numel, topo, cfg, record_to=CommStats())
        chunk = torch.empty(rs.chunk_numel)
        rs(inputs[ctx.rank].to(dtype).clone(), out=chunk)
        chunks = [torch.empty_like(chunk) for _ in members]
        torch_dist.all_gather(chunks, chunk, group=topo.world_group)
        res["phase1"] = torch.stack(chunks)
        res["block"], res["padded"] = rs.hadamard_block, rs.padded_chunk
    return res


def _phase2_bound(p1: torch.Tensor, block: int, padded: int, seed: int) -> torch.Tensor:
    """Per Hadamard block of every chunk: nearest 4-bit rounding moves each transformed value by
    at most s / 2 (s = the group's absmax / 7, group = block = 128 here); the inverse transform
    D H multiplies L2 norms by sqrt(B), so ||error of the block||_2 <= sqrt(B) sqrt(B) s / 2."""
    rows = torch.zeros(p1.shape[0], padded)
    rows[:, : p1.shape[1]] = p1
    h = hadamard(rows, block, seed).view(p1.shape[0], -1, block)
    s = h.abs().amax(-1) / 7
    return block * s / 2 * (1 + 1e-5) + 1e-30


@pytest.mark.parametrize("across_nodes", [True, False], ids=["replicate-2x1", "world-2x2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_same_bits_everywhere_and_within_the_quantizer_bound(dist, across_nodes, dtype):
    numel = 3 * 4096 + 77  # not a multiple of anything
    res = dist.run(_all_reduce_case, 4, 2, numel, {"rounding": "nearest"}, across_nodes, dtype, "outliers")
    for group in {tuple(r["members"]) for r in res}:
        outs = [res[m]["out"] for m in group]
        assert all(
            torch.equal(
                o.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                outs[0].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
            )
            for o in outs
        )  # bitwise
        r = res[group[0]]
        assert r["layout"] == ("2x1" if across_nodes else "2x2")
        # Phase 2 against the exact phase-1 sums: within the rounding bound, block by block.
        p1 = r["phase1"]
        got = r["out"].float()
        n_chunk = p1.shape[1]
        padded = torch.zeros(p1.shape[0] * n_chunk)
        padded[:numel] = got
        err = torch.zeros(p1.shape[0], r["padded"])
        err[:, :n_chunk] = padded.view(p1.shape[0], n_chunk) - p1
        err_blocks = err.view(p1.shape[0], -1, r["block"]).norm(dim=-1)
        bound = _phase2_bound(p1, r["block"], r["padded"], 0)
        if dtype == torch.float32:
            assert (err_blocks <= bound).all(), float((err_blocks / bound).max())
        # Overall: two 4-bit roundings of Hadamard-smoothed values.
        rel = float((got.double() - r["exact"]).norm() / r["exact"].norm())
        assert rel < 0.15, rel
        print(
            f"{r['layout']} {dtype}: rel err {rel:.4f}, phase-2 err / bound max {float((err_blocks / bound).max()):.3f}"
        )


def test_stochastic_default_and_bytes(dist):
    numel = 8192
    res = dist.run(_all_reduce_case, 4, 2, numel, {}, True, torch.bfloat16, "normal")
    for r in res:
        assert torch.equal(r["out"], res[r["members"][0]]["out"])
        # Stochastic rounding: each of the two roundings adds variance <= s^2 / 4, s = absmax / 7 of
        # a Hadamard block (~0.4 sigma for Gaussian values): ~0.2 relative in all (0.08 nearest).
        rel = float((r["out"].double() - r["exact"]).norm() / r["exact"].norm())
        assert rel < 0.3, rel
        inter = r["stats"]["gradients"]["inter"]
        # Two phases of R - 1 = 1 chunk of 4096 elements: 4-bit codes + one bf16 scale per 128.
        assert inter["bytes"] == 2 * (4096 // 2 + 4096 // 128 * 2)
        # against a bf16 ring all-reduce (2 (R - 1) / R * numel elements of 16 bits): 4.125 / 16
        assert inter["elements"] == 2 * 4096 and inter["compression"] == pytest.approx(16 / 4.125)
        assert "intra" not in r["stats"]["gradients"]


def test_nonfinite_anywhere_is_nan_on_every_member(dist):
    for cfg in ({}, {"mode": "exact"}):
        res = dist.run(_all_reduce_case, 4, 2, 4096, cfg, True, torch.float32, "inf")
        for r in res:
            assert r["out"].isnan().all(), cfg


def test_exact_mode_is_the_plain_all_reduce(dist):
    res = dist.run(_all_reduce_case, 4, 2, 1000, {"mode": "exact"}, True, torch.float32, "integer")
    for r in res:
        assert torch.equal(r["out"].double(), r["exact"])  # integers: exact in fp32
        assert r["stats"]["gradients"]["inter"]["bytes"] == 1000 * 4
