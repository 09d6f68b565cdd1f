"""sdpq demo end to end (tiny: 3 steps, 2 ranks as 2 nodes x 1, the two FSDP2 arms): table, JSON
records and the plot; the arm definitions and the ratio lines (fp32 context arms included); the
model every arm trains (--model)."""

import argparse
import json
import re

import pytest
from rich.console import Console

from sdpq.cli import main
from sdpq.demo import ARMS, DEFAULT_ARMS, _table, add_arguments, arm_command


def test_default_arms_are_bf16_baselines_and_their_sdpq_arms():
    assert DEFAULT_ARMS == ["fsdp2", "fsdp2+sdpq", "zero3", "zero3+sdpq"]
    for name in DEFAULT_ARMS:  # same bf16 compute policy in every default arm
        assert ARMS[name].mixed_precision == "bf16", name
        assert "--mixed-precision" in ARMS[name].train_args()
    assert not ARMS["fsdp2"].bf16 and not ARMS["zero3"].bf16  # fp32 parameters, bf16 compute: what users run
    assert ARMS["fsdp2+sdpq"].bf16 and ARMS["zero3+sdpq"].bf16  # MCF master keeps bf16 parameters
    for name in ("fsdp2-fp32", "zero3-fp32"):
        assert name not in DEFAULT_ARMS and ARMS[name].train_args() == []
        assert ARMS[name].precision == "fp32 (context)"


def test_ratios_are_against_the_bf16_baseline_and_fp32_only_as_context():
    def rec(arm, loss, nbytes, opt, s):
        return dict(
            arm=arm,
            precision=ARMS[arm].precision,
            final_loss=loss,
            val_loss=loss,
            cross_node_bytes_per_step=nbytes,
            optimizer_bytes_per_param=opt,
            step_seconds=s,
            losses=[loss],
        )

    console = Console(record=True, width=200)
    _table(
        [
            rec("zero3", 2.0, 100.0, 14.0, 1.0),
            rec("zero3+sdpq", 2.0, 10.0, 6.2, 1.5),
            rec("zero3-fp32", 2.0, 200.0, 16.0, 0.5),
        ],
        console,
    )
    out = console.export_text()
    assert "fp32 (context)" in out and "bf16 mixed" in out
    assert (
        "zero3+sdpq vs zero3 (bf16 mixed precision): final loss ratio 1.0000, val loss ratio 1.0000, "
        "cross-node bytes ratio 0.100, step time ratio 1.50, optimizer bytes/param 6.20 vs 14.00"
    ) in out
    assert (
        "zero3+sdpq vs zero3-fp32 (fp32, context only): cross-node bytes ratio 0.050, step time ratio 3.00, "
        "optimizer bytes/param 6.20 vs 16.00"
    ) in out


def test_demo_writes_records_and_plot(tmp_path, capsys):
    rc = main(
        [
            "demo",
            "--out",
            str(tmp_path),
            "--steps",
            "3",
            "--d-model",
            "64",
            "--n-layer",
            "2",
            "--ranks",
            "2",
            "--ranks-per-node",
            "1",
            "--arms",
            "fsdp2",
            "fsdp2+sdpq",
            "--tail",
            "2",
        ]
    )
    assert rc == 0
    records = json.loads((tmp_path / "results.json").read_text())
    assert [r["arm"] for r in records] == ["fsdp2", "fsdp2+sdpq"]
    assert [r["precision"] for r in records] == ["bf16 mixed", "bf16 + sdpq"]
    for r in records:
        for key in ("final_loss", "val_loss", "cross_node_bytes_per_step", "optimizer_bytes_per_param", "step_seconds"):
            assert isinstance(r[key], float), key
        assert len(r["losses"]) == 3
    base, ours = records
    assert 0 < ours["cross_node_bytes_per_step"] < base["cross_node_bytes_per_step"] / 3
    assert ours["optimizer_bytes_per_param"] < 6.5 < base["optimizer_bytes_per_param"]
    # the baseline gathers bf16 weights (FSDP2 MixedPrecisionPolicy) and reduces fp32 gradients
    spec = json.loads((tmp_path / "fsdp2.json").read_text())
    assert spec["extra"]["layout"] == "2x1" and spec["extra"]["cross_node_counter"] == "sdpq.stats"  # 2 nodes x 1
    assert spec["extra"]["mp_policy"]["param_dtype"] == "torch.bfloat16"
    assert spec["extra"]["mp_policy"]["reduce_dtype"] == "torch.float32"
    comm = spec["comm"]["total"]
    assert comm["weights"]["inter"]["bits_per_element"] == 16 and comm["gradients"]["inter"]["bits_per_element"] == 32
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert "fsdp2+sdpq vs fsdp2 (bf16 mixed precision): final loss ratio" in capsys.readouterr().out


def test_every_arm_trains_the_model_asked_for(tmp_path, capsys):
    p = argparse.ArgumentParser()
    add_arguments(p)
    for argv, kind in (([], "gpt"), (["--model", "llama"], "llama")):
        for name in ARMS:
            cmd = arm_command(name, p.parse_args(argv), tmp_path)
            assert cmd[cmd.index("-m", cmd.index("torch.distributed.run")) + 1] == "sdpq.train"
            assert cmd[cmd.index("--model") + 1] == kind, name
    with pytest.raises(SystemExit):
        main(["demo", "--model", "foo"])
    # argparse quotes the choices on Python < 3.12.8 / 3.13.1 and not after.
    assert re.search(
        r"argument --model: invalid choice: 'foo' \(choose from '?gpt'?, '?llama'?\)", capsys.readouterr().err
    )


def test_zero2_arm_counts_with_the_meter(tmp_path):
    """ZeRO-2 with the block (2 ranks as 2 nodes x 1, 3 steps): its bytes, like those of the plain
    ZeRO-2 arm (DeepSpeed's own collectives, which sdpq's statistics never see), come from the
    process-group meter (the ratio of the two: tests/integrations/test_deepspeed_zero12.py)."""
    from sdpq.train.run import METER

    argv = ["demo", "--out", str(tmp_path), "--steps", "3", "--d-model", "64", "--n-layer", "2"]
    assert main(argv + ["--ranks", "2", "--ranks-per-node", "1", "--arms", "zero2+sdpq", "--tail", "2"]) == 0
    (rec,) = json.loads((tmp_path / "results.json").read_text())
    run = json.loads((tmp_path / "zero2+sdpq.json").read_text())
    assert run["extra"]["cross_node_counter"] == METER and run["extra"]["sdpq"] is not None
    assert run["extra"]["ds_config"]["zero_optimization"]["stage"] == 2
    meter = run["comm"]["meter"]
    assert rec["cross_node_bytes_per_step"] == sum(v["inter"]["bytes"] for v in meter.values() if "inter" in v) / 3
    assert meter["gradients"]["inter"]["bytes"] > 0 and meter["weights"]["inter"]["bytes"] > 0
    cmd = arm_command("zero2", argparse.Namespace(**{**vars(_demo_args()), "out": str(tmp_path)}), tmp_path)
    assert cmd[cmd.index("--count-bytes") + 1] == "meter"
    assert "sdpq" not in json.loads((tmp_path / "zero2.ds.json").read_text())


def _demo_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args([])


def test_results_need_no_matplotlib(tmp_path, monkeypatch):
    """matplotlib is the optional `plot` extra: without it the demo writes no plot and says so."""
    import sys

    from sdpq.demo import _plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    assert _plot([{"arm": "fsdp2", "losses": [1.0, 0.5]}], tmp_path / "loss.png") is False
    assert not (tmp_path / "loss.png").exists()
