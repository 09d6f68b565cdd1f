"""sdpq demo end to end (tiny: 3 steps, two FSDP2 arms): table, JSON records and the plot."""

import json
import sys

from sdpq.cli import main


def test_demo_writes_records_and_plot(tmp_path, monkeypatch, capsys):
    rc = main(["demo", "--out", str(tmp_path), "--steps", "3", "--d-model", "64", "--n-layer", "2",
               "--arms", "fsdp2", "fsdp2+sdpq", "--tail", "2"])
    assert rc == 0
    records = json.loads((tmp_path / "results.json").read_text())
    assert [r["arm"] for r in records] == ["fsdp2", "fsdp2+sdpq"]
    for r in records:
        for key in ("final_loss", "val_loss", "cross_node_bytes_per_step", "optimizer_bytes_per_param", "step_seconds"):
            assert isinstance(r[key], float), key
        assert len(r["losses"]) == 3
    base, ours = records
    assert 0 < ours["cross_node_bytes_per_step"] < base["cross_node_bytes_per_step"] / 3
    assert ours["optimizer_bytes_per_param"] < 6.5 < base["optimizer_bytes_per_param"]
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert "fsdp2+sdpq: final loss ratio" in capsys.readouterr().out
