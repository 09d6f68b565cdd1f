"""sdpq.comm.link_bytes: the process-group byte meter's accounting model and the simulated node
boundary (4 gloo ranks as 2 nodes x 2)."""

from __future__ import annotations

import torch

from sdpq.comm.link_bytes import LinkBytes

TIMEOUT = 120


def _collectives(ctx):
    import torch.distributed as tdist

    inter_groups = [tdist.new_group([0, 2]), tdist.new_group([1, 3])]  # same local index
    counter = LinkBytes(ctx.ranks_per_node)
    with counter:
        out = torch.empty(40)
        tdist.all_gather_into_tensor(out, torch.ones(10))  # 40 B to each of 3 peers
        tdist.reduce_scatter_tensor(torch.empty(6, dtype=torch.bfloat16), torch.ones(24, dtype=torch.bfloat16))
        tdist.all_reduce(torch.ones(8))  # modelled as reduce-scatter + all-gather: 2 * 32 / 4 B per peer
        mine = inter_groups[ctx.local_rank]
        tdist.all_gather_into_tensor(torch.empty(20, dtype=torch.int8), torch.ones(10, dtype=torch.int8), group=mine)
        tdist.broadcast(torch.ones(4), src=0)  # only the root sends
        counter.enabled = False
        tdist.all_reduce(torch.ones(1000))  # outside the window
    tdist.all_reduce(torch.ones(1000))  # after removal
    return counter.as_dict()["total"]


def test_link_bytes_model_and_node_boundary(dist):
    res = dist.run(_collectives, 4, 2, timeout=TIMEOUT)
    for rank, t in enumerate(res):
        root = rank == 0
        assert t["weights"] == {"intra": {"bytes": 40, "calls": 1}, "inter": {"bytes": 80 + 10, "calls": 2}}
        assert t["gradients"] == {"intra": {"bytes": 12, "calls": 1}, "inter": {"bytes": 24, "calls": 1}}
        assert t["other"]["intra"]["bytes"] == 16 + (16 if root else 0)
        assert t["other"]["inter"]["bytes"] == 32 + (32 if root else 0)
