"""gloo carries an accelerator's buffers through the host (sdpq.comm._exchange._through_host):
the staged all-gather, all-to-all and reduce-scatter give exactly what the direct ones give.

There is no GPU here, so the staged path is forced on CPU tensors; what it adds (a host copy
there and back, a synchronous collective) is device-independent."""

import torch
import torch.distributed as torch_dist

from sdpq.comm import GradReduceScatter, Topology, WeightGather, _exchange
from sdpq.config import GradientsConfig, WeightsConfig


def _staged_or_not(fn, ctx, staged: bool):
    original = _exchange._through_host
    if staged:
        _exchange._through_host = lambda t, group: True
    try:
        return fn(ctx)
    finally:  # the worker pool outlives this test
        _exchange._through_host = original


def _three_collectives(ctx, staged: bool):
    return _staged_or_not(_run, ctx, staged)


def _run(ctx):
    g = torch.Generator().manual_seed(ctx.rank)
    row = torch.randn(5, generator=g)
    gathered, work = _exchange.all_gather_rows(row, torch_dist.group.WORLD, async_op=True)
    if work is not None:
        work.wait()
    into = torch.empty(4 * 5)
    _exchange.all_gather_rows(row, torch_dist.group.WORLD, out=into)
    rows = torch.randn(4, 3, generator=g)
    swapped, work = _exchange.all_to_all_rows(rows, torch_dist.group.WORLD, async_op=True)
    if work is not None:
        work.wait()
    flat = torch.randn(8, generator=g)
    out = torch.empty(2)
    _exchange.reduce_scatter_flat(out, flat, torch_dist.group.WORLD)
    everyone = torch.empty(4 * 3)
    _exchange.all_gather_flat(everyone, row[:3].clone(), torch_dist.group.WORLD)
    return gathered.clone(), into.clone(), swapped.clone(), out.clone(), everyone


def test_staged_collectives_equal_direct_ones(dist):
    direct = dist.run(_three_collectives, 4, 2, False, timeout=30)
    staged = dist.run(_three_collectives, 4, 2, True, timeout=30)
    for d, s in zip(direct, staged):
        assert all(torch.equal(a, b) for a, b in zip(d, s))
    assert torch.equal(direct[0][0], direct[0][1].view(4, 5))  # every rank's row, in rank order


def _sdpq_collectives(ctx):
    """The two-level gradient reduce-scatter (its exchanges in flight while the next is
    prepared: a staged one hands back no handle) and the weight gather."""
    topo = Topology.build(ctx.ranks_per_node)
    g = torch.Generator().manual_seed(10 + ctx.rank)
    rs = GradReduceScatter(4 * 1024, topo, GradientsConfig(pipeline_chunks=2))
    grads = rs(torch.randn(4 * 1024, generator=g))
    wg = WeightGather(4 * 512, topo, WeightsConfig())
    shard = torch.randn(512, generator=g).to(torch.bfloat16)
    return grads, wg.gather(shard).clone()


def _sdpq_staged_or_not(ctx, staged: bool):
    return _staged_or_not(_sdpq_collectives, ctx, staged)


def test_sdpq_collectives_staged_equal_direct(dist):
    """Two nodes of two: the staged exchanges (several ranks sharing one GPU over gloo) give
    bitwise what the direct ones give."""
    direct = dist.run(_sdpq_staged_or_not, 4, 2, False, timeout=60)
    staged = dist.run(_sdpq_staged_or_not, 4, 2, True, timeout=60)
    for d, s in zip(direct, staged):
        assert all(torch.equal(a, b) for a, b in zip(d, s))
