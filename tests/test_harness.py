"""Tests of the multi-rank harness itself (tests/harness.py)."""

import os
import time
from datetime import timedelta

import harness
import pytest
import torch
import torch.distributed as dist_


def _identity(ctx, scale):
    t = torch.tensor([float(ctx.rank + 1)])
    dist_.all_reduce(t)
    return {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "ranks_per_node": ctx.ranks_per_node,
        "local_rank": ctx.local_rank,
        "node": ctx.node,
        "nodes": ctx.nodes,
        "env": (os.environ["LOCAL_WORLD_SIZE"], os.environ["LOCAL_RANK"]),
        "pg": (dist_.get_rank(), dist_.get_world_size(), dist_.get_backend()),
        "sum": t.item() * scale,
    }


@pytest.mark.parametrize("world_size,ranks_per_node", [(2, 1), (2, 2), (4, 2), (6, 3), (6, 2), (8, 4), (8, 2)])
def test_results_per_rank(dist, world_size, ranks_per_node):
    out = dist.run(_identity, world_size, ranks_per_node, 2.0)
    assert len(out) == world_size
    expected_sum = 2.0 * world_size * (world_size + 1) / 2
    for r, res in enumerate(out):
        assert res["rank"] == r and res["world_size"] == world_size
        assert res["ranks_per_node"] == ranks_per_node
        assert res["local_rank"] == r % ranks_per_node and res["node"] == r // ranks_per_node
        assert res["nodes"] == world_size // ranks_per_node
        assert res["env"] == (str(ranks_per_node), str(r % ranks_per_node))
        assert res["pg"] == (r, world_size, "gloo")
        assert res["sum"] == expected_sum


def _tensor_result(ctx):
    return torch.full((3,), float(ctx.rank)), torch.initial_seed()


def test_tensors_and_seed_per_rank(dist):
    out = dist.run(_tensor_result, 4, 2)
    for r, (t, seed) in enumerate(out):
        assert torch.equal(t, torch.full((3,), float(r)))
        assert seed == dist.seed + r  # each run starts from a fixed, per-rank seed


def _raise_on_rank_1(ctx):
    if ctx.rank == 1:
        raise ValueError("boom from rank 1")
    return ctx.rank


def test_raising_rank_fails_with_traceback_then_fresh_pool(dist):
    dist.run(_identity, 4, 2, 1.0)  # warm pool
    started = dist.pools_started
    with pytest.raises(harness.DistTestError) as info:
        dist.run(_raise_on_rank_1, 4, 2, timeout=10)
    assert info.value.rank == 1
    assert "ValueError: boom from rank 1" in info.value.remote_traceback
    assert "_raise_on_rank_1" in str(info.value)  # the rank's own frame is in the message
    assert 4 not in dist._pools  # discarded
    out = dist.run(_identity, 4, 2, 1.0)
    assert dist.pools_started == started + 1  # the next run got a fresh pool
    assert [o["sum"] for o in out] == [10.0] * 4


def _unmatched_collective(ctx):
    if ctx.rank == 0:
        dist_.all_reduce(torch.ones(1))  # rank 1 never joins: gloo must time out
    return ctx.rank


def test_hanging_collective_times_out_and_recovers(dist):
    with pytest.raises(harness.DistTestError) as info:
        dist.run(_unmatched_collective, 2, 1, timeout=1.5)
    # The process group's own timeout fired (an exception raised in the rank), not the parent's
    # kill of a hung rank (DistTimeoutError).
    assert not isinstance(info.value, harness.DistTimeoutError)
    assert info.value.rank == 0
    out = dist.run(_identity, 2, 1, 1.0)
    assert [o["sum"] for o in out] == [3.0, 3.0]


def _sleep_on_rank_0(ctx):
    if ctx.rank == 0:
        time.sleep(60)
    return ctx.rank


def test_hanging_rank_is_killed_with_stack(dist):
    with pytest.raises(harness.DistTimeoutError) as info:
        dist.run(_sleep_on_rank_0, 2, 2, timeout=1)  # would take 60 s unless the harness kills it
    assert info.value.hung == [0]
    assert "_sleep_on_rank_0" in info.value.stacks[0]
    assert dist.run(_identity, 2, 2, 1.0)[1]["sum"] == 3.0


def _die(ctx):
    if ctx.rank == 2:
        os._exit(3)
    return ctx.rank


def test_dead_rank_is_reported(dist):
    with pytest.raises(harness.DistTestError, match="died"):
        dist.run(_die, 4, 4, timeout=10)


def _subgroup_timeout(ctx):
    from torch.distributed import distributed_c10d as c10d

    g = dist_.new_group([0, 1])
    t = torch.ones(1)
    dist_.all_reduce(t, group=g)
    return c10d.default_pg_timeout, t.item()


def test_run_timeout_is_default_for_new_groups(dist):
    out = dist.run(_subgroup_timeout, 2, 1, timeout=7)
    assert out[0] == (timedelta(seconds=7), 2.0)
    out = dist.run(_subgroup_timeout, 2, 1, timeout=9)  # subgroups of the last run were dropped
    assert out[1] == (timedelta(seconds=9), 2.0)


def _pid(ctx):
    return os.getpid()


def _noop(ctx):
    t = torch.ones(4)
    dist_.all_reduce(t)
    return t[0].item()


def test_pool_is_reused(dist):
    dist.run(_noop, 4, 2)
    started = dist.pools_started
    pids = dist.run(_pid, 4, 2)
    for _ in range(20):
        assert dist.run(_noop, 4, 2) == [4.0] * 4
    assert dist.pools_started == started  # no new processes (and so no new process group)
    assert dist.run(_pid, 4, 2) == pids


def _print(ctx):
    print(f"hello from rank {ctx.rank}")


def test_rank_output_is_shown(dist, capsys):
    dist.run(_print, 2, 1)
    out = capsys.readouterr().out
    assert "hello from rank 0" in out and "hello from rank 1" in out


def test_bad_arguments(dist):
    with pytest.raises(ValueError):
        dist.run(_noop, 6, 4)
    try:
        import cloudpickle  # noqa: F401
    except ImportError:
        with pytest.raises(TypeError, match="module-level"):
            dist.run(lambda ctx: 0, 2, 1)


def test_shutdown_kills_every_worker():
    h = harness.DistHarness()
    assert h.run(_noop, 2, 1) == [2.0, 2.0]
    procs = list(h._pools[2].procs)
    h.shutdown()
    for p in procs:
        assert not p.is_alive()
