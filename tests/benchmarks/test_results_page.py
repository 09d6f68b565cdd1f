"""benchmarks/RESULTS.md against the results files, the README against RESULTS.md, and the
documentation free of work-history talk.

- The headline table of RESULTS.md is exactly what benchmarks/results_page.py generates from
  benchmarks/results/*.json (a hand edit of a figure, or a changed results file, fails).
- Every measured figure in README.md (a decimal, a multiple "Nx" or a percentage outside code)
  carries a `<!-- h:KEY -->` marker and appears in the headline row KEY; a few numbers that are
  not measurements (torch versions, a bound) are listed below with the reason.
- benchmarks/*.md, benchmarks/log/*.md, docs/*.md and README.md name no work items ("#12"),
  sessions or rounds of work.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None, name
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


results_page = _module("results_page")

# Numbers in the README that are not measurements, each with why.
NOT_MEASURED = {
    "2.11.0": "a tested torch version",
    "2.13.0": "a tested torch version (and the pinned one)",
    "2.14.1": "a tested torch version",
    "2.15.0": "a tested torch version",
    "0.25": "the lower bound of a 4-bit all-reduce against a bf16 one (4 / 16), not a measurement",
}
FIGURE = re.compile(
    r"(?<![\w.+-])([+-]?\d+(?:\.\d+)+%?|[+-]?\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?(?:%|x\b)"  # 0.065, 2.13.0, +0.10%, 7-15x
    r"|\d+(?:-\d+)?[ -](?:s|min|minutes?|seconds?|hours?)\b)"  # durations: "15-25 s", "about 15 minutes"
)
MARKER = re.compile(r"\s*<!--\s*h:([\w-]+)\s*-->")


def _prose(text: str) -> str:
    """`text` without fenced code blocks and inline code spans (commands, not figures)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def test_headline_table_matches_the_results_files():
    page = results_page.PAGE.read_text()
    assert results_page.BEGIN in page and results_page.END in page
    expected = results_page.render(page)
    assert page == expected, (
        "benchmarks/RESULTS.md's headline table differs from benchmarks/results/*.json; "
        "run .venv/bin/python benchmarks/results_page.py"
    )
    assert results_page.main(["--check"]) == 0


def test_check_fails_on_a_hand_edited_figure(tmp_path, monkeypatch):
    page = results_page.PAGE.read_text()
    row = results_page.parse_table(page)["bytes-fsdp2"]
    edited = page.replace(f"| {row['sdpq / baseline']} |", "| 0.001 |", 1)
    assert edited != page
    copy = tmp_path / "RESULTS.md"
    copy.write_text(edited)
    monkeypatch.setattr(results_page, "PAGE", copy)
    assert results_page.main(["--check"]) == 1
    assert results_page.main([]) == 0  # regenerating restores the page
    assert copy.read_text() == page


def test_headline_rows_carry_their_provenance():
    rows = results_page.parse_table(results_page.PAGE.read_text())
    for key in (
        "bytes-fsdp2",
        "bytes-zero3",
        "bytes-hsdp",
        "bytes-zeropp",
        "loss-fsdp2",
        "step-loopback-fsdp2",
        "step-200mbit-fsdp2",
        "optimizer-zero3",
        "kernels-vs-copy",
        "gpu-loss-fsdp2",
        "gpu-kernels-vs-copy",
        "nccl",
        "loss-long-fsdp2",
    ):
        assert key in rows, key
    for key, row in rows.items():
        for col in ("command", "date", "commit", "machine"):
            assert row[col], (key, col)
    # Older files record no commit (the emulated-cluster ones a date only); the long-run study's
    # records all three (benchmarks/provenance.py).
    assert rows["step-200mbit-fsdp2"]["date"] == "2026-11-24"
    assert rows["bytes-fsdp2"]["date"] == results_page.NOT_RECORDED
    assert rows["bytes-fsdp2"]["commit"] == results_page.NOT_RECORDED
    assert all(rows["loss-long-fsdp2"][c] != results_page.NOT_RECORDED for c in ("date", "commit", "machine"))


def test_long_run_rows_from_convergence_long_summary(tmp_path):
    """When benchmarks/convergence_long.py's results land, their rows come from its summarize()."""
    convergence_long = _module("convergence_long")
    runs: dict = {"fsdp2": {}, "zero3": {}}
    for fw in runs:
        for seed, (b, s) in enumerate([(2.50, 2.51), (2.52, 2.52), (2.54, 2.53)]):
            runs[fw][str(seed)] = {
                arm: {
                    "losses": [loss] * 60,
                    "val_loss": loss + 0.02,
                    "params": 1000,
                    "optimizer": "x",
                    "meter_cross_node_bytes_per_step": nbytes,
                    "optimizer_bytes_per_param": obpp,
                    "step_seconds": 1.0,
                }
                for arm, loss, nbytes, obpp in (("baseline", b, 3.0e7, 12.0), ("sdpq", s, 2.0e6, 6.25))
            }
    summary = convergence_long.summarize(runs, None)
    results = tmp_path / "results"
    # Without benchmarks/long_bytes.py's file the byte rows are the study's own.
    ignore = shutil.ignore_patterns("convergence_long.*", "long_bytes.json")
    shutil.copytree(results_page.RESULTS_DIR, results, ignore=ignore)
    (results / "convergence_long.json").write_text(
        json.dumps({"args": {"steps": 60, "seeds": "0,1,2"}, "meta": {}, "summary": summary, "runs": runs})
    )
    rows = {r.key: r for r in results_page.rows(results)}
    assert (
        rows["loss-long-fsdp2"].ratio == f"{summary['fsdp2']['diff_percent']:+.2f}% "
        f"({summary['fsdp2']['diff_in_baseline_sd']:+.2f} sd)"
    )
    assert math.isclose(summary["zero3"]["bytes_ratio"], 2.0e6 / 3.0e7)
    assert rows["bytes-long-zero3"].ratio == "0.067"
    assert rows["optimizer-long-fsdp2"].sdpq == "6.25"
    assert "not yet run" not in rows["loss-long-zero3"].sdpq
    # Without the file, the rows say it has not run.
    (results / "convergence_long.json").unlink()
    rows = {r.key: r for r in results_page.rows(results)}
    assert rows["loss-long-fsdp2"].sdpq == "not yet run"


def test_readme_figures_match_the_headline_table():
    rows = results_page.parse_table(results_page.PAGE.read_text())
    prose = _prose((ROOT / "README.md").read_text())
    checked, unmarked = 0, []
    for m in FIGURE.finditer(prose):
        figure = m.group(1)
        marker = MARKER.match(prose, m.end())
        if marker is None:
            if figure not in NOT_MEASURED:
                line = prose[: m.start()].count("\n") + 1
                unmarked.append(f"README line ~{line}: {figure!r}")
            continue
        key = marker.group(1)
        assert key in rows, f"README cites headline row {key!r}, which RESULTS.md does not have"
        cells = " ".join(rows[key][c] for c in ("sdpq", "baseline", "sdpq / baseline"))
        assert re.search(rf"(?<![\w.]){re.escape(figure)}(?![\w.])", cells), (
            f"README quotes {figure} for {key!r}; the headline row says {cells!r}"
        )
        checked += 1
    assert not unmarked, "figures in the README that are not in the headline table: " + "; ".join(unmarked)
    assert checked >= 10, f"only {checked} README figures are tied to the headline table"


def test_readme_says_what_has_not_been_measured():
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"Not yet measured: NCCL, real links, real nodes", readme)
    assert "ranks over gloo" in readme  # the GPU figures say how the ranks talked


WORK_HISTORY = [
    (re.compile(r"(?<![\w&/])#\d+\b"), "a work-item number"),
    (re.compile(r"\bsessions?\b", re.I), "'session'"),
    (re.compile(r"\brounds? of (work|tuning)\b", re.I), "'round(s) of work'"),
    (re.compile(r"\b(first|second|third|fourth|fifth|sixth|this|next|previous|last) round\b", re.I), "a round"),
]
# Legitimate matches, by file and text: none today. Add (path, matched text) with a reason.
ALLOWED: set[tuple[str, str]] = set()


def _history_files() -> list[Path]:
    files = [
        ROOT / "README.md",
        *sorted((ROOT / "benchmarks").glob("*.md")),
        *sorted((ROOT / "benchmarks" / "log").glob("*.md")),
        *sorted((ROOT / "docs").glob("*.md")),
    ]
    return [f for f in files if f.exists()]


@pytest.mark.parametrize("path", _history_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_work_history_talk(path):
    text = path.read_text()
    rel = str(path.relative_to(ROOT))
    found = [
        f"line {text[: m.start()].count(chr(10)) + 1}: {m.group(0)!r} ({what})"
        for pattern, what in WORK_HISTORY
        for m in pattern.finditer(text)
        if (rel, m.group(0)) not in ALLOWED
    ]
    assert not found, f"{rel} talks about the work's history: " + "; ".join(found)


def test_patterns_catch_what_they_should():
    assert [m.group(1) for m in FIGURE.finditer("7-15x, 0.97 / 0.96, 15-25 s, about 15 minutes, +0.10%")] == [
        "7-15x",
        "0.97",
        "0.96",
        "15-25 s",
        "15 minutes",
        "+0.10%",
    ]
    samples = ["see #12", "(issue #14)", "this session", "Session 3", "two rounds of work", "the third round"]
    for s in samples:
        assert any(p.search(s) for p, _ in WORK_HISTORY), s
    for s in ["rounding", "rounded up", "[GPU](#gpu)", "`C#`", "a round trip"]:
        assert not any(p.search(s) for p, _ in WORK_HISTORY), s


def test_long_run_byte_rows_come_from_the_steady_recount():
    """benchmarks/long_bytes.py's least-traffic recount replaces the long-run studies' own byte
    counts (counted per member) for every arm it has, and only those."""
    steady = json.loads((results_page.RESULTS_DIR / "long_bytes.json").read_text())["steady"]
    rows = {r.key: r for r in results_page.rows()}
    for key, fw, arm in (("bytes-long-fsdp2", "fsdp2", "sdpq"), ("bytes-w2-g4-zero3", "zero3", "w2-g4")):
        assert rows[key].file == "`long_bytes.json`"
        assert rows[key].ratio == f"{steady[fw][arm] / steady[fw]['baseline']:.3f}"
        assert "counted per member" not in rows[key].what
    assert set(steady["fsdp2"]) == {"baseline", "sdpq", "w2-g4", "ref-auto"}
    assert rows["bytes-zero1"].file != "`long_bytes.json`"  # a study long_bytes.py does not count


def test_study_byte_rows_come_from_the_recount(tmp_path):
    """benchmarks/recount_bytes.py's least-traffic recount replaces the DDP, ZeRO-1/2 and ZeRO++
    studies' own byte counts (counted per member) for every arm it has; without its file the rows
    are the studies' own, labelled as counted per member."""
    studies = json.loads((results_page.RESULTS_DIR / "recount_bytes.json").read_text())["studies"]
    rows = {r.key: r for r in results_page.rows()}
    zeropp = "zeropp_peer_lr1e-3_seed0.json"
    for key, name, group, arm, base in (
        ("bytes-ddp", "ddp_seeds.json", "ddp", "sdpq", "ddp"),
        ("bytes-ddp-fp16", "ddp_seeds.json", "ddp", "fp16", "ddp"),
        ("bytes-ddp-powersgd", "ddp_seeds.json", "ddp", "powersgd", "ddp"),
        ("bytes-zero1", "deepspeed_zero12.json", "1", "sdpq", "plain"),
        ("bytes-zero2", "deepspeed_zero12.json", "2", "sdpq", "plain"),
        ("bytes-zero1-fp32", "deepspeed_zero12_fp32_accum.json", "1-fp32", "sdpq", "plain"),
        ("bytes-zero1-2bit", "deepspeed_zero12_low_bits.json", "1", "sdpq2", "plain"),
        ("bytes-zero2-3bit", "deepspeed_zero12_low_bits.json", "2", "sdpq3", "plain"),
        ("bytes-zero2-ef", "deepspeed_zero12_ef.json", "2", "sdpq-ef", "plain"),
        ("bytes-zeropp", zeropp, "zero3", "sdpq", "zeropp"),
        ("bytes-zero3-meter", zeropp, "zero3", "sdpq", "zero3"),
    ):
        steady = studies[name]["steady"][group]
        assert rows[key].file == "`recount_bytes.json`", key
        assert rows[key].ratio == f"{steady[arm] / steady[base]:.3f}", key
        assert rows[key].sdpq == f"{steady[arm] / 1e6:.2f} MB", key
        assert "counted per member" not in rows[key].what, key
    assert studies[zeropp]["also_for"] == ["zeropp_peer_lr1e-3_seed1.json", "zeropp_peer_lr1e-3_seed2.json"]
    assert not [k for k, r in rows.items() if "counted per member" in r.what]  # every byte row: least traffic
    assert rows["loss-ddp"].file == "`ddp_seeds.json`" and rows["loss-zero3-seeds"].file.startswith("`zeropp_peer")
    results = tmp_path / "results"
    shutil.copytree(results_page.RESULTS_DIR, results, ignore=shutil.ignore_patterns("recount_bytes.json"))
    rows = {r.key: r for r in results_page.rows(results)}
    for key, file in (("bytes-ddp", "`ddp_seeds.json`"), ("bytes-zero2-ef", "`deepspeed_zero12_ef.json`")):
        assert rows[key].file == file and "counted per member" in rows[key].what, key
    assert rows["bytes-zeropp"].file.startswith("`zeropp_peer_lr1e-3_seed0.json") and "counted per member" in (
        rows["bytes-zeropp"].what
    )
