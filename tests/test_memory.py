"""sdpq.memory against the tensors actually alive, on 4 gloo ranks: what a run with sdpq keeps
beyond the same run without it (same torch AdamW, same data) is exactly what the report
attributes to sdpq; on one node and with HSDP that is no weight reference at all."""

import pytest
import torch

from sdpq.config import Config
from sdpq.memory import KINDS, MemoryReport, report
from sdpq.plan import Arm, rank_memory
from sdpq.plan.shapes import from_config
from sdpq.train.model import GPTConfig

WORLD = 4
# torch's AdamW in both arms: the difference between them is sdpq's collectives alone.
BLOCK = {"weights": {"mode": "diff"}, "gradients": {"mode": "two_level"}, "optimizer": {"enabled": False}}
# A fixed overhead the live count sees in the sdpq arm and the report does not own: the
# Hadamard sign vectors cached per (block, seed) and small bookkeeping tensors.
SLACK = 64 * 1024


@pytest.fixture
def dist(dist):
    dist.discard(WORLD)  # device meshes of an earlier run must not be found again
    return dist


MODEL = GPTConfig(n_layer=2, n_head=4, d_model=128, seq_len=32)


def _spec(ctx, block, backend="fsdp2", **kw):
    from sdpq.train.run import RunSpec

    base = dict(
        backend=backend,
        model=MODEL,
        sdpq=block,
        steps=2,
        micro_batch=2,
        warmup=1,
        lr=1e-3,
        eval_batches=0,
        log_every=0,
        ranks_per_node=ctx.ranks_per_node,
        measure_memory=True,
    )
    return RunSpec(**{**base, **kw})


def _fsdp_arms(ctx, hsdp: bool):
    from torch.distributed.device_mesh import init_device_mesh

    from sdpq.train.fsdp_backend import train

    out = []
    for block in (None, BLOCK):
        kw = {}
        if hsdp:
            mesh = init_device_mesh("cpu", (WORLD // ctx.ranks_per_node, ctx.ranks_per_node), mesh_dim_names=("r", "s"))
            kw = {"mesh": mesh} if block is None else {"mesh": mesh["s"], "replicate": mesh["r"]}
        out.append(train(_spec(ctx, block, mixed_precision="bf16"), **kw).extra["memory"])
    return out


def _zero3_arm(ctx, block):
    import logging

    from benchmarks.zeropp.groups import reset_deepspeed_groups
    from sdpq.train.deepspeed_backend import train

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    reset_deepspeed_groups()  # DeepSpeed caches the process groups the harness destroyed
    return train(_spec(ctx, block, "deepspeed", bf16=True)).extra["memory"]


def _check_plan(measured: list[dict], framework: str, nodes: int, per_node: int, block) -> None:
    """`sdpq plan`'s figures for this layout: every kind within 5% of the measured one, per rank."""
    arm = Arm("x", None if block is None else Config.from_dict(block))
    units = from_config(MODEL).units
    for rank, m in enumerate(measured):
        got = m["report"]["bytes"]
        want = rank_memory(units, framework, nodes, per_node, arm, rank=rank)
        for kind, planned in want.items():
            assert abs(planned - got[kind]) <= 0.05 * max(got[kind], 1), (rank, kind, planned, got[kind])


def _check_against_live(plain: dict, with_sdpq: dict) -> MemoryReport:
    rep = MemoryReport(with_sdpq["report"]["bytes"], with_sdpq["report"]["model_numel"])
    base = MemoryReport(plain["report"]["bytes"], plain["report"]["model_numel"])
    extra = with_sdpq["live_bytes"] - plain["live_bytes"]
    # The framework's own kinds are the same in both arms; all the live difference is sdpq's.
    assert {k: base.bytes[k] for k in KINDS[:4]} == {k: rep.bytes[k] for k in KINDS[:4]}
    assert rep.sdpq_bytes <= extra <= rep.sdpq_bytes + SLACK, (extra, rep.bytes)
    return rep


@pytest.mark.parametrize("rpn", [2, 4], ids=["2x2", "1x4"])  # every layout: benchmarks/plan_check.py
def test_fsdp2_memory_is_the_live_tensors(dist, rpn):
    res = dist.run(_fsdp_arms, WORLD, rpn, False, timeout=120)
    nodes = WORLD // rpn
    _check_plan([r[0] for r in res], "fsdp2", nodes, rpn, None)
    _check_plan([r[1] for r in res], "fsdp2", nodes, rpn, BLOCK)
    for plain, with_sdpq in res:
        rep = _check_against_live(plain, with_sdpq)
        ref = rep.per_param["weight_reference"]
        if nodes == 1:
            assert ref == 0  # nothing crosses nodes: no reference
        else:
            # bf16 (the compute dtype) R_l: 2 bytes x nodes shards of 1/N of the model each = 2/L,
            # above it only by the padding of FSDP2's shards.
            assert 2 / rpn <= ref <= 2 / rpn * 1.02, ref
        assert rep.bytes["parameters"] > 0 and rep.bytes["gradients"] > 0 and rep.bytes["optimizer_states"] > 0
    peaks = res[0][1]["report"]["transient_peaks"]
    assert set(peaks) == {"fsdp2.all_gather", "fsdp2.reduce_scatter"} and min(peaks.values()) > 0


def test_hsdp_keeps_no_reference(dist):
    res = dist.run(_fsdp_arms, WORLD, 2, True, timeout=120)
    _check_plan([r[0] for r in res], "hsdp", 2, 2, None)  # FSDP2's own (2-D mesh) HSDP
    _check_plan([r[1] for r in res], "hsdp", 2, 2, BLOCK)
    for plain, with_sdpq in res:
        rep = _check_against_live(plain, with_sdpq)
        assert rep.bytes["weight_reference"] == 0 and rep.bytes["error_feedback"] == 0


def test_zero3_memory_is_the_live_tensors(dist):
    # Note: each arm in fresh workers: an engine stays reachable from DeepSpeed's globals after
    # the run, so a second engine's process would still hold the first one's tensors.
    plains = dist.run(_zero3_arm, WORLD, 2, None, timeout=180)
    dist.discard(WORLD)
    sdpqs = dist.run(_zero3_arm, WORLD, 2, BLOCK, timeout=180)
    _check_plan(plains, "zero3", 2, 2, None)
    _check_plan(sdpqs, "zero3", 2, 2, BLOCK)
    for plain, with_sdpq in zip(plains, sdpqs):
        rep = _check_against_live(plain, with_sdpq)
        assert 2 / 2 <= rep.per_param["weight_reference"] <= 1.05
        assert rep.bytes["master"] > 0  # ZeRO-3's fp32 partitions


def test_report_refuses_other_objects():
    with pytest.raises(TypeError, match="neither a model"):
        report(torch.zeros(3))
