"""Weight differences over full replicas (sdpq.comm.weights_replicated, ZeRO-1/2)."""

import pytest
import torch

from sdpq.comm import CommStats, Topology, reference_health
from sdpq.comm.reference_health import checksum
from sdpq.comm.weights_replicated import ReplicaDiffGather, replicas_agree
from sdpq.config import WeightsConfig


def _steps_case(ctx, P, steps, cfg_kwargs, max_elements):
    """`steps` optimizer steps of a random walk: every rank owns the master of its partition."""
    topo = Topology.build(ctx.ranks_per_node)
    rec = CommStats()
    gather = ReplicaDiffGather(P, topo, WeightsConfig(**cfg_kwargs), max_elements=max_elements, record_to=rec)
    N = ctx.world_size
    g = torch.Generator().manual_seed(0)  # the same masters on every rank: ranks can check each other
    masters = torch.randn(N, P, generator=g)
    flat = masters.reshape(-1).to(torch.bfloat16)  # every rank starts from the same weights
    errs = []
    for _ in range(steps):
        masters += 1e-2 * torch.randn(N, P, generator=g)
        own_old = flat.view(N, P)[ctx.rank].clone()
        flat.view(N, P)[ctx.rank] = masters[ctx.rank].to(torch.bfloat16)  # what DeepSpeed's step writes
        gather.gather(flat, own_old, masters[ctx.rank])
        errs.append(float((flat.float().view(N, P) - masters).abs().max()))
    return {"flat": flat, "errs": errs, "agree": replicas_agree(flat, topo.world_group), "stats": rec.as_dict()}


@pytest.mark.parametrize("nodes,rpn", [(2, 2), (1, 4)], ids=["2x2", "1x4"])
def test_replicas_stay_bitwise_equal_and_track_the_master(dist, nodes, rpn):
    P = 5000  # not a multiple of the group: the last group is short
    res = dist.run(_steps_case, nodes * rpn, rpn, P, 6, {"bits": 4, "group_size": 256}, 1 << 12)
    first = res[0]["flat"]
    assert all(torch.equal(r["flat"], first) for r in res) and all(r["agree"] for r in res)
    # per step the error is at most half a code step of the group's difference (4 bits: 1/14 of
    # its largest value) plus bf16 rounding of weights ~|3|: fed back, it does not grow
    for r in res:
        assert max(r["errs"]) < 0.02, r["errs"]
        assert r["errs"][-1] < 2 * r["errs"][0] + 0.02
    s = res[0]["stats"]["weights"]
    if nodes > 1:  # 4-bit codes + fp32 scale per 256: ~0.27 of bf16
        assert 0.25 < 1 / s["inter"]["compression"] < 0.3


def _exact_case(ctx, P):
    topo = Topology.build(ctx.ranks_per_node)
    gather = ReplicaDiffGather(P, topo, WeightsConfig(), record_to=CommStats())
    flat = torch.zeros(ctx.world_size * P, dtype=torch.bfloat16)
    master = torch.randn(P, generator=torch.Generator().manual_seed(ctx.rank))
    gather.gather(flat, flat.view(ctx.world_size, P)[ctx.rank].clone(), master, exact=True)
    want = torch.cat([torch.randn(P, generator=torch.Generator().manual_seed(r)) for r in range(ctx.world_size)])
    return torch.equal(flat, want.to(torch.bfloat16))


def test_exact_gather_is_the_rounded_master(dist):
    assert all(dist.run(_exact_case, 4, 2, 777))


def test_checksum_sees_one_changed_bit_and_a_swap(monkeypatch):
    x = torch.randn(1001).to(torch.bfloat16)
    y = x.clone()
    y.view(torch.int16)[500] ^= 1
    z = x.clone()
    z[[3, 4]] = z[[4, 3]]
    assert not torch.equal(checksum(x), checksum(y))
    if x[3] != x[4]:
        assert not torch.equal(checksum(x), checksum(z))
    whole = checksum(x)
    monkeypatch.setattr(reference_health, "_CHECKSUM_CHUNK", 7)  # chunks do not change the value
    assert torch.equal(checksum(x), whole)
