"""sdpq plan without ranks: shapes, the memory model's arithmetic at scale, the recommendation
and the command line. (Its figures against live runs: tests/test_memory.py and
benchmarks/plan_check.py.)"""

import json

import pytest

from sdpq.cli import main
from sdpq.config import Config
from sdpq.plan import Arm, Link, arms_for, plan, rank_memory, recommend
from sdpq.plan.shapes import PRESETS, from_config, from_params

GB = 1e9


def test_presets_have_their_published_sizes():
    assert from_config(PRESETS["7b"]).params == pytest.approx(6.74e9, rel=0.01)
    assert from_config(PRESETS["70b"]).params == pytest.approx(68.98e9, rel=0.01)


@pytest.mark.parametrize("nodes,per_node", [(2, 8), (8, 8), (64, 8)])
def test_memory_at_scale_is_the_per_parameter_arithmetic(nodes, per_node):
    """A bare parameter count (no padding): plain ZeRO-3 keeps 16/N bytes per parameter, ZeRO++
    adds 2/L, sdpq's default keeps its optimizer (2 + 2 + 2 + ~2.19)/N plus a bf16 reference of
    2/L, the int8 reference ~1.03/L, and the stateless mode none."""
    model = from_params(7e9)
    P, N, L = model.params, nodes * per_node, per_node
    mem = {a.name: sum(rank_memory(model.units, "zero3", nodes, per_node, a).values()) / P for a in arms_for("zero3")}
    assert mem["bf16"] == pytest.approx(16 / N, rel=1e-3)
    assert mem["ZeRO++ (hpZ+qwZ+qgZ)"] == pytest.approx(16 / N + 2 / L, rel=1e-3)
    optimizer = (2 + 2 + 2 + 2 + 2 * 12 / 128) / N  # bf16 partition, bf16 gradients, MCF low half, FP8 m and v
    assert mem["sdpq"] == pytest.approx(optimizer + 2 / L, rel=1e-3)
    assert mem["sdpq int8 reference"] == pytest.approx(optimizer + (1 + 4 / 128) / L, rel=1e-3)
    assert mem["sdpq stateless (direct)"] == pytest.approx(optimizer, rel=1e-3)
    assert mem["sdpq"] < mem["ZeRO++ (hpZ+qwZ+qgZ)"]  # below ZeRO++ at every shape


@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_memory_and_bytes_are_the_per_parameter_arithmetic(stage):
    """ZeRO-1/2 keep the bf16 weights whole (2 bytes per parameter), the gradients whole (stage 1)
    or partitioned (stage 2), and a partition's fp32 master and moments; sdpq swaps the moments
    for FP8 ones and keeps no reference. Bytes: a 2-bit difference and 4-bit gradients against a
    bf16 all-gather and a bf16 all-reduce."""
    model = from_params(7e9)
    P, N = model.params, 4 * 8
    fw = f"zero{stage}"
    rows = {r.arm: r for r in plan(model, fw, 4, 8, gpu_memory_gb=80, link=Link(400))}
    grads = 2 if stage == 1 else 2 / N
    assert rows["bf16"].total / P == pytest.approx(2 + grads + 12 / N, rel=1e-3)
    assert rows["sdpq"].total / P == pytest.approx(2 + grads + (4 + 2 + 2 * 12 / 128) / N, rel=1e-3)
    assert rows["sdpq"].memory["weight_reference"] == 0 and "ZeRO++ (hpZ+qwZ+qgZ)" not in rows
    assert rows["sdpq"].memory["error_feedback"] == 0
    units = [[(4096, 4096)]]  # opt-in error feedback: each bucket's rows to other nodes, fp32, on every rank
    ef = Arm("ef", Config.from_dict({"gradients": {"error_feedback": True}}))
    assert rank_memory(units, fw, 4, 8, ef)["error_feedback"] == 4 * 4096 * 4096 // 8 * 3 // 4
    assert rank_memory(units, fw, 1, 8, ef)["error_feedback"] == 0  # one node: nothing crosses
    assert rows["sdpq"].cross_node["total"] / rows["bf16"].cross_node["total"] == pytest.approx(
        (2 + 32 / 2048 + 4 + 16 / 128) / 48, rel=1e-6
    )


def test_one_node_and_hsdp_keep_no_reference():
    units = from_params(1e9).units
    for framework, nodes in (("fsdp2", 1), ("zero3", 1), ("hsdp", 4)):
        assert rank_memory(units, framework, nodes, 8, Arm("sdpq", Config()))["weight_reference"] == 0


def test_the_recommendation_is_the_fewest_bytes_that_fit():
    model = from_config(PRESETS["70b"])
    rows = plan(model, "zero3", 2, 8, gpu_memory_gb=80, link=Link(400))
    best = recommend(rows)
    fitting = [r for r in rows if r.fits and r.arm.startswith("sdpq")]
    assert best is not None and best.cross_node["total"] == min(r.cross_node["total"] for r in fitting)
    # 64 GPUs of 24 GB (70% for model state): the bf16 reference (70B x 2/8 = 17 GB) and the int8
    # one (9 GB) no longer fit next to the sharded optimizer (9 GB); the stateless mode does.
    rows = plan(model, "zero3", 8, 8, gpu_memory_gb=24, link=Link(400))
    by = {r.arm: r for r in rows}
    assert not by["sdpq"].fits and not by["sdpq int8 reference"].fits and by["sdpq stateless (direct)"].fits
    assert recommend(rows).arm == "sdpq stateless (direct)"
    # sdpq's cross-node bytes: 2-bit weights once (fp32 scales per 2048) and 4-bit gradients
    # (bf16 scales per 128) vs 2 x 16 + 16 bits.
    assert by["sdpq"].cross_node["total"] / by["bf16"].cross_node["total"] == pytest.approx(
        (2 + 32 / 2048 + 4 + 16 / 128) / 48, rel=1e-6
    )


def test_cli_prints_a_table_and_json(capsys):
    assert main(["plan", "--preset", "7b", "--nodes", "4", "--framework", "fsdp2"]) == 0
    out = capsys.readouterr().out
    assert "sdpq int8 reference" in out and "recommended:" in out
    assert main(["plan", "--model", "llama", "--d-model", "128", "--layers", "2", "--nodes", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["rows"][0]["arm"] == "bf16" and data["recommended"].startswith("sdpq")


def test_hf_config(tmp_path, capsys):
    cfg = {
        "vocab_size": 32000,
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 4,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert main(["plan", "--hf-config", str(path), "--nodes", "2", "--framework", "hsdp"]) == 0
    assert "ZeRO++" not in capsys.readouterr().out  # hpZ is ZeRO-3's
    del cfg["hidden_size"]
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="hidden_size"):
        main(["plan", "--hf-config", str(path), "--nodes", "2"])
