"""sdpq.comm.link_bytes: the process-group meter, summed over real gloo ranks, gives every
collective's closed form (least cross-node traffic, NCCL's ring as context) on 2x2, 4x1, 1x4, 3x2
and 2x4 layouts, for world groups and sub-groups, whatever name the caller used."""

from __future__ import annotations

import pytest
import torch

from sdpq.comm.link_bytes import LinkBytes, sum_over_ranks

TIMEOUT = 120
LAYOUTS = [(2, 2), (4, 1), (1, 4), (3, 2), (2, 4)]  # (nodes, ranks per node)


def _collectives(ctx):
    import torch.distributed as tdist

    k, L, r = ctx.world_size, ctx.ranks_per_node, ctx.rank
    # One member of every node (the same local index): sdpq's inter-node groups.
    across = [tdist.new_group(list(range(l, k, L))) for l in range(L)]
    counter = LinkBytes(L)
    with counter:
        tdist.all_gather_into_tensor(torch.empty(3 * k), torch.ones(3))  # a 12-byte piece each
        tdist._all_gather_base(torch.empty(3 * k), torch.ones(3))  # the deprecated name: counted once
        tdist.reduce_scatter_tensor(torch.empty(6, dtype=torch.bfloat16), torch.ones(6 * k, dtype=torch.bfloat16))
        tdist.all_reduce(torch.ones(2 * k))  # 8 k bytes
        # Uneven all-to-all: rank i sends i + j + 1 fp32 elements to rank j.
        splits = [r + j + 1 for j in range(k)]
        recv = [i + r + 1 for i in range(k)]
        tdist.all_to_all_single(torch.empty(sum(recv)), torch.ones(sum(splits)), recv, splits)
        tdist.broadcast(torch.ones(10), src=k - 1)  # 40 bytes from the last rank
        tdist.all_gather_into_tensor(
            torch.empty(5 * (k // L), dtype=torch.int8), torch.ones(5, dtype=torch.int8), group=across[r % L]
        )
        counter.snapshot()
        counter.enabled = False
        tdist.all_reduce(torch.ones(1000))  # outside the window
    tdist.all_reduce(torch.ones(1000))  # after removal
    return counter.as_dict()


@pytest.mark.parametrize("n,L", LAYOUTS, ids=[f"{n}x{L}" for n, L in LAYOUTS])
def test_meter_sums_to_the_closed_forms(dist, n, L):
    k = n * L
    total = sum_over_ranks(dist.run(_collectives, k, L, timeout=TIMEOUT))
    ring = n if n > 1 else 0  # cross-node hops of a ring laid out node by node

    def got(path, link):
        return total["total"].get(path, {}).get(link, {}).get("bytes", 0)

    # Weights: two world all-gathers of 12-byte pieces, one over the inter-node groups (5 bytes).
    assert got("weights", "inter") == 2 * (n - 1) * k * 12 + L * (n - 1) * n * 5
    assert got("weights", "inter_ring") == 2 * ring * (k - 1) * 12 + L * (n * (n - 1) * 5 if n > 1 else 0)
    # Gradients: a reduce-scatter (12-byte chunks) and the uneven all-to-all (each row distinct).
    foreign = sum(4 * (i + j + 1) for i in range(k) for j in range(k) if i // L != j // L)
    assert got("gradients", "inter") == (n - 1) * k * 12 + foreign
    assert got("gradients", "inter_ring") == ring * (k - 1) * 12 + foreign
    # Other: the all-reduce of 8 k bytes (twice a reduce-scatter) and the broadcast (each node once).
    assert got("other", "inter") == 2 * (n - 1) * 8 * k + (n - 1) * 40
    assert got("other", "inter_ring") == 2 * ring * (k - 1) * 8 + (n - 1) * 40
    assert total["steps"][0]["weights"].get("inter", 0) == got("weights", "inter")  # the snapshot
    if n == 1:
        assert all("inter" not in links for links in total["total"].values())
