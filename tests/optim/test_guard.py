"""sdpq.optim.guard: the skip-step decision on 4 gloo ranks, with its flag checked against the
group's communication device (tests/collective_devices.py: the group reported as NCCL, the
parameters on the host as with DeepSpeed's offload_optimizer or FSDP2's CPU offload)."""

from __future__ import annotations

import torch
import torch.distributed as torch_dist
from collective_devices import nccl_devices, on_standin

from sdpq.optim import AdamW, guard


def _params(rank: int, bad_rank: int | None):
    """Three host parameters with gradients; on `bad_rank` the second gradient has an inf."""
    ps = [torch.nn.Parameter(torch.randn(n)) for n in (5, 300, 7)]
    for p in ps:
        p.grad = torch.randn_like(p)
    if rank == bad_rank:
        ps[1].grad[17] = float("inf")
    return ps


def _plain(ctx, bad_rank):
    ps = _params(ctx.rank, bad_rank)
    with nccl_devices() as report:
        which = guard.nonfinite_index(ps, ps, torch_dist.group.WORLD)
    return which, report.checked, all(not on_standin(p) and not on_standin(p.grad) for p in ps)


def test_host_parameters_on_an_nccl_group_agree(dist):
    for bad_rank in (None, 2):
        res = dist.run(_plain, 4, 2, bad_rank, timeout=30)
        for rank, (which, checked, host) in enumerate(res):
            assert checked == 1 and host  # one checked all-reduce; the parameters stayed on the host
            assert which == (None if bad_rank is None else (1 if rank == bad_rank else -1)), (rank, which)


def _mesh(ctx):
    """DTensor parameters on a 2 x 2 CPU mesh (FSDP2 with CPU offload keeps its shards there):
    the flag is reduced over both mesh dimensions' groups."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2))
    ps = []
    for n in (8, 12):
        p = torch.nn.Parameter(distribute_tensor(torch.zeros(n, 4), mesh, [Shard(0), Shard(0)]))
        g = torch.randn(n, 4)
        if ctx.rank == 3 and n == 12:
            g[-1, 0] = float("nan")  # only rank 3's shard holds it
        torch_dist.broadcast(g, src=3)
        p.grad = distribute_tensor(g, mesh, [Shard(0), Shard(0)])
        ps.append(p)
    with nccl_devices() as report:
        which = guard.nonfinite_index(ps, ps)
    return which, report.checked


def test_dtensor_parameters_on_a_cpu_mesh_agree(dist):
    res = dist.run(_mesh, 4, 2, timeout=60)
    assert [r[0] for r in res] == [-1, -1, -1, 1]  # rank 3 names its parameter, the others follow
    assert all(r[1] == 2 for r in res)  # both mesh dimensions


def _adamw(ctx):
    ps = _params(ctx.rank, bad_rank=1)
    before = [p.detach().clone() for p in ps]
    opt = AdamW(ps, lr=1e-2, states="fp32", master="native", sync_group=torch_dist.group.WORLD)
    with nccl_devices() as report:
        opt.step()  # skipped on every rank
        for p in ps:
            p.grad = torch.ones_like(p)
        opt.step()  # taken on every rank
    return opt.skipped_steps, report.checked, [not torch.equal(a, p) for a, p in zip(before, ps)]


def test_adamw_with_offloaded_parameters_skips_on_every_rank(dist):
    for skipped, checked, changed in dist.run(_adamw, 4, 2, timeout=60):
        assert skipped == 1 and checked == 2 and all(changed)
