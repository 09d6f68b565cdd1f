"""Runs the steps of the GPU check, each in its own process with its own time limit, and writes
the report.

Note: every step runs in a fresh interpreter (`python -m sdpq.check.step NAME`). A step that
hangs, crashes the process or poisons the CUDA context (an illegal address is sticky) is
killed or fails alone; the steps after it still run, and the report says which step did what.
The whole check keeps to a budget: a step is skipped, and said so, when the time left is
shorter than its limit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import pack
from .report import passed, write_report
from .steps import STEPS

__all__ = ["add_arguments", "run"]

GPU_BUDGET_S = 360.0  # 6 minutes: a second run still fits in a 15-minute lease (an H200 took 106 s)
REHEARSAL_BUDGET_S = 900.0  # 2 shared cores and Triton's interpreter


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=os.environ.get("OUT", "runs/gpu_check"), help="report folder ($OUT if set)")
    p.add_argument(
        "--rehearse", action="store_true", help="the same steps on the CPU: Triton's interpreter, small sizes"
    )
    p.add_argument(
        "--budget-s",
        type=float,
        help=f"time for the whole check (default {GPU_BUDGET_S:.0f}, rehearsal {REHEARSAL_BUDGET_S:.0f})",
    )
    p.add_argument("--only", nargs="+", choices=list(STEPS), help="run only these steps")


def step_env(rehearse: bool) -> dict[str, str]:
    """The environment of every step process. Rehearsal: Triton kernels run in the interpreter
    on CPU tensors (TRITON_INTERPRET must be set before triton is imported: hence a process)."""
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("OMP_NUM_THREADS", "1" if rehearse else "4")
    if not rehearse:
        # The CPU runs the GPU's results are compared with use the PyTorch reference: no C++
        # build (tens of seconds per library) inside a step's time limit.
        env.setdefault("SDPQ_CPP", "0")
    if rehearse:
        env["TRITON_INTERPRET"] = "1"
        env["SDPQ_TRITON"] = "interpret"
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _run_step(name: str, rehearse: bool, limit_s: float) -> dict:
    """One step in its own process group, killed after limit_s (a hung step is reported)."""
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "sdpq.check.step", name, "--result", str(result_path)]
        if rehearse:
            cmd.append("--rehearse")
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            cmd, env=step_env(rehearse), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            out, _ = proc.communicate(timeout=limit_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the step's own ranks too
            out, _ = proc.communicate()
            timed_out = True
        seconds = time.perf_counter() - t0
        tail = out.decode(errors="replace")[-4000:]
        if result_path.exists():
            rec = json.loads(result_path.read_text())
        elif timed_out:
            rec = {"status": "timeout", "error": f"no result after {limit_s:.0f} s: killed"}
        else:
            rec = {"status": "fail", "error": f"the step's process exited with {proc.returncode} and no result"}
    rec.update(name=name, seconds=round(seconds, 2), limit_s=limit_s, log_tail=tail)
    return rec


def run(args: argparse.Namespace) -> list[dict]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    given = {"rehearse": bool(args.rehearse), "budget_s": args.budget_s, "only": args.only}  # as typed
    if args.budget_s is None:
        args.budget_s = REHEARSAL_BUDGET_S if args.rehearse else GPU_BUDGET_S
    start = time.perf_counter()
    names = args.only or list(STEPS)
    records: list[dict] = []
    for name in names:
        step = STEPS[name]
        limit = step.limit_s(args.rehearse)
        left = args.budget_s - (time.perf_counter() - start)
        if left < min(limit, 20.0):
            records.append({"name": name, "status": "skipped", "error": f"budget: {left:.0f} s left", "seconds": 0.0})
            continue
        print(f"[sdpq check] {name}: {step.title} (limit {min(limit, left):.0f} s)", flush=True)
        rec = _run_step(name, args.rehearse, min(limit, left))
        print(f"[sdpq check] {name}: {rec['status']} in {rec['seconds']:.1f} s", flush=True)
        if rec["status"] not in ("pass", "skip"):
            print(rec.get("error", ""), "\n", rec.get("log_tail", "")[-1500:], flush=True)
        records.append(rec)
    meta = {
        "rehearsal": bool(args.rehearse),
        "budget_s": args.budget_s,
        "total_s": round(time.perf_counter() - start, 1),
        "host": platform.node(),
        "cpu": _cpu_model(),
        "python": sys.version.split()[0],
        "started_unix": int(time.time() - (time.perf_counter() - start)),
        **_provenance(records),
        "args": given,
    }
    paths = write_report(out, meta, records)
    print(f"[sdpq check] report: {', '.join(str(p) for p in paths)}", flush=True)
    return records


def _provenance(records: list[dict]) -> dict:
    """date (UTC), commit and machine for benchmarks/results_page.py. The GPU machine gets a
    copy of the tree without .git: the commit is then the one `sdpq check pack` recorded."""
    # Note: the GPU machine's copy of the tree may carry a stale .git, so a manifest packed from
    # exactly these sources (equal digests) names the commit before git does.
    digest = pack.tree_digest(Path.cwd())
    try:
        manifest = json.loads((Path(pack.CARRY_DIR) / "manifest.json").read_text())
    except (OSError, ValueError):
        manifest = {}
    commit = pack.git_commit(Path.cwd())
    if manifest.get("commit") and manifest.get("tree_sha256") == digest:
        commit = manifest["commit"] + " (as packed)"
    elif commit is None and manifest.get("commit"):
        commit = manifest["commit"] + " (as packed; sdpq/ changed since)"
    env = next((r for r in records if r["name"] == "env"), {})
    device = env.get("figures", {}).get("device")
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "tree_sha256": digest,  # names the sources that ran, whatever the commit says
        "commit": commit,
        "machine": f"{device}, host {_cpu_model()}" if device else _cpu_model(),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def exit_code(records: list[dict]) -> int:
    """0 when every step passed or was skipped for a stated reason, 1 otherwise."""
    return 0 if passed(records) else 1
