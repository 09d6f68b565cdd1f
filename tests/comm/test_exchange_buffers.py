"""sdpq.comm._exchange's gather into a caller's buffer: the same rows, and no full-size buffer
allocated on the way (the exact weight gather can then write straight into its output bucket)."""

import pytest
import torch

from sdpq.comm import Topology
from sdpq.comm._exchange import all_gather_rows


def _allocated(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(max(0, e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")


def _gather_into(ctx, n):
    topo = Topology.build(ctx.ranks_per_node)
    row = torch.arange(n, dtype=torch.float32) + 1000 * ctx.rank
    want, _ = all_gather_rows(row, topo.world_group)
    buf = torch.full((ctx.world_size * n,), -1.0)
    got, _ = all_gather_rows(row, topo.world_group, out=buf)
    # Bytes allocated by one gather, without and with the buffer (gloo's own staging included).
    plain = _allocated(lambda: all_gather_rows(row, topo.world_group))
    into = _allocated(lambda: all_gather_rows(row, topo.world_group, out=buf))
    return torch.equal(got, want), got.data_ptr() == buf.data_ptr(), plain - into


def test_gather_into_a_buffer_allocates_no_bucket(dist):
    n = 1 << 16
    for same, in_place, saved in dist.run(_gather_into, 4, 2, n):
        assert same and in_place
        assert saved >= 4 * 4 * n  # the bucket of 4 fp32 rows is no longer allocated


def test_a_buffer_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError, match="out must be a contiguous torch.float32 buffer of 8 elements"):
        all_gather_rows(torch.zeros(8), None, out=torch.zeros(9))
    row = torch.arange(8.0)
    got, work = all_gather_rows(row, None, out=torch.zeros(8))
    assert work is None and torch.equal(got, row.view(1, -1))
