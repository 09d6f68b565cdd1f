"""The frontier screen's pure parts (benchmarks/frontier.py): the settings it sweeps, the blocks
they become (valid sdpq configs), the summary against the baseline and the Pareto front."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import frontier  # noqa: E402
from sdpq import Config  # noqa: E402


def test_all_settings_are_the_full_grid_of_valid_blocks():
    settings = frontier.parse_settings("all")
    assert len(settings) == 18 and len(set(settings)) == 18
    for w, g, ef in settings:
        cfg = Config.from_dict(frontier.block(w, g, ef))
        assert (cfg.weights.bits, cfg.gradients.inter_bits, cfg.gradients.error_feedback) == (w, g, ef)
        assert cfg.gradients.intra_bits == 8  # the intra-node stage keeps its default width


def test_named_settings_and_a_clear_error():
    assert frontier.parse_settings("w3-g2-ef, w4-g4") == [(3, 2, True), (4, 4, False)]
    with pytest.raises(SystemExit, match="w5-g4"):
        frontier.parse_settings("w5-g4")


def _run(loss_tail: float, val: float, nbytes: float) -> dict:
    return {"losses": [9.0] * 10 + [loss_tail] * 50, "val_loss": val, "meter_cross_node_bytes_per_step": nbytes}


def test_summary_and_pareto_front():
    results = {
        "baseline": _run(2.0, 2.1, 100.0),
        "w4-g4": _run(2.01, 2.1, 10.0),
        "w3-g3": _run(2.02, 2.1, 8.0),
        "w2-g2": _run(2.20, 2.3, 6.0),
        "w3-g2": _run(2.30, 2.4, 7.0),  # beaten by w2-g2 on both
    }
    rows = frontier.summarize(results)
    by = {r["setting"]: r for r in rows}
    assert [r["setting"] for r in rows] == ["w2-g2", "w3-g2", "w3-g3", "w4-g4", "baseline"]  # by bytes
    assert by["w3-g3"]["bytes_ratio"] == pytest.approx(0.08)
    assert by["w3-g3"]["loss_diff_percent"] == pytest.approx(1.0)
    assert by["baseline"]["loss_diff_percent"] == 0.0
    assert frontier.pareto(rows) == ["w2-g2", "w3-g3", "w4-g4"]
