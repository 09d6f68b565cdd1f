"""Topology (sdpq.comm.topology) and statistics (sdpq.comm.stats) on real gloo ranks."""

import os

import pytest
import torch
import torch.distributed as torch_dist

from sdpq.comm import CommStats, GradReduceScatter, Topology, TopologyError, WeightGather, stats
from sdpq.config import GradientsConfig, StatsConfig, TopologyConfig, WeightsConfig


def _groups(ctx, spec):
    topo = Topology.build(spec)
    out = {"layout": topo.layout, "node": topo.node, "local_rank": topo.local_rank}
    for name in ("intra", "inter"):
        g = getattr(topo, f"{name}_group")
        if g is None:
            out[name] = None
            continue
        t = torch.tensor([float(ctx.rank)])
        torch_dist.all_reduce(t, group=g)
        out[name] = (t.item(), torch_dist.get_process_group_ranks(g))
    return out


@pytest.mark.parametrize("nodes,rpn", [(1, 4), (4, 1), (2, 2), (3, 2), (2, 4)])
def test_groups_match_layout(dist, nodes, rpn):
    N = nodes * rpn
    for spec in (rpn, "auto", TopologyConfig(ranks_per_node=rpn)):  # auto: LOCAL_WORLD_SIZE
        for r, res in enumerate(dist.run(_groups, N, rpn, spec)):
            n, l = r // rpn, r % rpn
            assert res["layout"] == f"{nodes}x{rpn}" and (res["node"], res["local_rank"]) == (n, l)
            intra = [n * rpn + k for k in range(rpn)]
            inter = [m * rpn + l for m in range(nodes)]
            assert res["intra"] == (None if rpn == 1 else (float(sum(intra)), intra))
            assert res["inter"] == (None if nodes == 1 else (float(sum(inter)), inter))


def _build_error(ctx, case):
    try:
        if case == "indivisible":
            Topology.build(4)
        elif case == "disagree":
            Topology.build(2 if ctx.rank == 0 else 3)
        elif case == "subset":
            g = torch_dist.new_group([0, 1])
            Topology.build(2, group=g)
        elif case == "no_env":
            del os.environ["LOCAL_WORLD_SIZE"]
            Topology.build("auto")
        elif case == "foreign_group":
            topo = Topology.build(2)
            topo.check_group(torch_dist.new_group([0, 1]))
    except TopologyError as e:
        return str(e)
    return None


@pytest.mark.parametrize(
    "case,needle",
    [
        ("indivisible", "not divisible"),
        ("disagree", "disagree"),
        ("subset", "whole world"),
        ("no_env", "LOCAL_WORLD_SIZE"),
        ("foreign_group", "sub-group"),
    ],
)
def test_clear_errors_on_every_rank(dist, case, needle):
    msgs = dist.run(_build_error, 6, 2, case, timeout=20)
    if case in ("subset", "foreign_group"):
        msgs = msgs[:2]  # only the members of the partial group hold it
    assert all(m is not None and needle in m for m in msgs), msgs


def _stats_default(ctx):
    stats.reset()
    topo = Topology.build(ctx.ranks_per_node)
    wg = WeightGather(4 * 4096, topo, WeightsConfig())  # the process-wide counters
    rs = GradReduceScatter(4 * 4096, topo, GradientsConfig(), stats=StatsConfig(error_sample_every=1))
    x = torch.randn(4 * 4096)
    for _ in range(3):
        wg.mark_weights_changed(exact=False)
        wg(x[ctx.rank * 4096 : (ctx.rank + 1) * 4096])
        rs(x)
    off = CommStats()
    GradReduceScatter(4096, topo, GradientsConfig(), stats=StatsConfig(enabled=False), record_to=off)(x[:4096])
    table, data = stats.summary()
    return table, data, off.as_dict()


def test_stats_summary(dist):
    table, data, off = dist.run(_stats_default, 4, 2)[0]
    assert off == {}  # a disabled StatsConfig records nothing
    for path in ("weights", "gradients"):
        for link in ("intra", "inter"):
            assert data[path][link]["calls"] > 0 and data[path][link]["bytes"] > 0
            assert path in table
    g = data["gradients"]
    assert g["intra"]["calls"] == 3 and g["inter"]["calls"] == 3
    assert g["inter"]["error_samples"] == 3 and 0 < g["inter"]["relative_error_mean"] < 0.5
    # the default bf16 scales: 16 bits per group of 128
    assert abs(g["inter"]["bits_per_element"] - 4.125) < 1e-9 and abs(g["intra"]["bits_per_element"] - 8.125) < 1e-9
    assert g["inter"]["compression"] == pytest.approx(32 / 4.125)
    print("\n" + table)


@pytest.mark.parametrize(
    "var", ["LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"]
)
def test_auto_ranks_per_node_reads_every_launcher(monkeypatch, var):
    """ranks_per_node "auto" (FSDP2 and DeepSpeed alike) reads what each launcher sets."""
    from sdpq.comm.topology import LOCAL_SIZE_VARIABLES, _resolve_ranks_per_node, ranks_per_node_from_env

    for v in LOCAL_SIZE_VARIABLES:
        monkeypatch.delenv(v, raising=False)
    assert ranks_per_node_from_env() is None
    with pytest.raises(TopologyError, match="found no launcher variable.*" + var):
        _resolve_ranks_per_node(TopologyConfig())
    monkeypatch.setenv(var, "8")
    assert _resolve_ranks_per_node(TopologyConfig()) == 8 == _resolve_ranks_per_node("auto")
    assert _resolve_ranks_per_node(TopologyConfig(ranks_per_node=2)) == 2
    monkeypatch.setenv(var, "eight")
    with pytest.raises(TopologyError, match=f"{var}='eight' is not a positive integer"):
        _resolve_ranks_per_node("auto")
