"""The GPU check (sdpq/check): its CPU rehearsal runs every step and writes both reports; a hung
step is killed at its limit and reported; the packing step's command is the one documented."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sdpq.check import pack, runner
from sdpq.check.steps import STEPS

ROOT = Path(__file__).resolve().parents[2]


# Note: CI's rehearsal runs the steps that check correctness and leaves out, to keep CI inside its
# time: train_zero3 (about a minute of 4 ranks running DeepSpeed on interpreted Triton kernels;
# its device-mode ZeRO-3 collectives are tests/integrations/test_deepspeed_devices.py's) and the
# timing steps (throughput, adamw_speed, step_share: their times mean nothing in the interpreter,
# and on the GPU a failing step is reported while the others still run). `./run gpu-check
# --rehearse` still runs every step.
TIMING = {"throughput", "adamw_speed", "step_share"}
REHEARSED = [name for name in STEPS if name != "train_zero3" and name not in TIMING]


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    """One rehearsal of the check as a developer runs it (`./run gpu-check --rehearse`), but for
    the steps named above."""
    out = tmp_path_factory.mktemp("gpu_check")
    env = dict(os.environ, SDPQ_PYTHON=sys.executable)
    proc = subprocess.run(
        [str(ROOT / "run"), "gpu-check", "--rehearse", "--out", str(out), "--only", *REHEARSED],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    return proc, out


@pytest.mark.timeout(960)
def test_rehearsal_passes_and_writes_both_reports(rehearsal):
    proc, out = rehearsal
    doc = json.loads((out / "gpu_report.json").read_text())
    md = (out / "gpu_report.md").read_text()
    statuses = {s["name"]: s["status"] for s in doc["steps"]}
    assert list(statuses) == REHEARSED, "the JSON names every step run, in order"
    failed = {n: s for n, s in statuses.items() if s != "pass"}
    assert not failed, f"{failed}\n{proc.stdout[-4000:]}"
    assert proc.returncode == 0 and doc["passed"] and doc["meta"]["rehearsal"]
    for name in REHEARSED:
        assert f"| {name} | pass |" in md
    fsdp = next(s for s in doc["steps"] if s["name"] == "train_fsdp")
    # the interpreted Triton kernels train as the C++ kernels do (nearest rounding is bitwise;
    # the AdamW kernel within its bound), so losses agree far inside the check's tolerance
    assert fsdp["figures"]["loss_max_rel_diff_vs_cpu"] < 0.005


def test_a_hung_step_is_killed_and_reported():
    """A limit shorter than the step needs (importing torch alone takes longer) must end in a
    "timeout" record, with the step's process group killed, not in a hang."""
    rec = runner._run_step("env", rehearse=True, limit_s=0.3)
    assert rec["status"] == "timeout" and rec["seconds"] < 10 and "killed" in rec["error"]


def test_budget_skips_steps_and_says_so(tmp_path):
    args = runner.argparse.Namespace(out=str(tmp_path), rehearse=True, budget_s=1.0, only=["env", "codec"])
    records = runner.run(args)
    assert [r["status"] for r in records] == ["skipped", "skipped"]
    assert all("budget" in r["error"] for r in records)
    assert runner.exit_code(records) == 1
    assert json.loads((tmp_path / "gpu_report.json").read_text())["passed"] is False


def test_limits_fit_the_gpu_budget():
    """The GPU limits add up to the check's budget at most: a second run fits in a 15-minute lease."""
    assert sum(s.gpu_limit_s for s in STEPS.values()) <= runner.GPU_BUDGET_S
    assert runner.GPU_BUDGET_S + 60 <= pack.DEVICE_TIMEOUT_S <= 600


def test_device_command_installs_only_what_is_carried():
    cmd = pack.device_command()
    assert (
        "--no-index" in cmd
        and "--target /tmp/site" in cmd
        and cmd.endswith('./run gpu-check --out "${OUT:-runs/gpu_check}"')
    )
    assert len(cmd) < 2000  # the device tool's limit on one command
