"""``sdpq bench step``: where a training step's time goes, for an sdpq arm next to its bf16 baseline.

Per backend (FSDP2 and/or ZeRO-3) it trains the demo's GPT on the demo's data twice, each a
``torchrun`` job of ``python -m sdpq.train --timing`` (the demo's arms, see sdpq/demo.py): the
bf16 mixed-precision baseline and the sdpq arm (library defaults, bf16 + MCF). The timing spans
(sdpq/comm/timing.py) split every step of every rank into, in seconds per step:

  fwd_bwd     forward + backward outside every span below: the model's compute plus the
              framework's own work in those phases (FSDP2's all-gather copy-in/out and gradient
              copy-in, ZeRO-3's partition bookkeeping)
  w_encode    sdpq weight path: quantizing the weight difference (or int8 weights)
  w_decode    sdpq weight path: dequantizing into the node-resident reference
  g_encode    sdpq gradient path: Hadamard + 8-bit quantization (+ non-finite poisoning)
  g_reduce    sdpq gradient path: decode + sum (+ 4-bit re-encode for the inter-node stage,
              + inverse Hadamard at the end)
  comm_wait   time inside collective calls and their work.wait(): sdpq's all-to-all / all-gather
              and the framework's own collectives (FSDP2 through torch.distributed, ZeRO-3
              through deepspeed.comm; the loss all-reduce too). On one machine this is mostly
              waiting for the slowest rank, not bandwidth
  optimizer   optimizer step, gradient clipping included (FSDP2's clipping norm all-reduce runs
              as a DTensor collective and is counted here, not in comm_wait)
  rest        total minus the above: Python, sdpq's own buffer copies around its collectives,
              batch loading, the loss readout
  total       the step's wall time

Aggregation: per step, the mean over ranks of each column; then, after ``--warmup`` steps, the
mean over the middle half of the steps ranked by total (an interquartile mean: as robust to a
slow step as the median, and unlike per-column medians its columns add up to the total).
``step_median`` is the plain median step time. The baseline of ``--baseline plain`` (default) is
the framework alone: it has no sdpq spans, so its codec columns are 0 and its comm_wait is what
the framework's collectives took; ``--baseline exact`` runs the demo's baseline (sdpq's exact
collectives, bitwise the plain framework's) instead. ``vs_baseline`` = total / baseline total.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["add_arguments", "run", "COLUMNS", "TITLE", "breakdown", "aggregate"]

COLUMNS = [
    "backend",
    "arm",
    "fwd_bwd",
    "w_encode",
    "w_decode",
    "g_encode",
    "g_reduce",
    "comm_wait",
    "optimizer",
    "rest",
    "total",
    "vs_baseline",
]
TITLE = "sdpq bench step (seconds per step; mean over ranks, interquartile mean over steps)"
PARTS = ["fwd_bwd", "w_encode", "w_decode", "g_encode", "g_reduce", "comm_wait", "optimizer"]
# column -> span labels whose self time it sums
_LABELS = {
    "fwd_bwd": ("train.fwd_bwd",),
    "w_encode": ("weights.encode",),
    "w_decode": ("weights.decode",),
    "g_encode": ("grads.encode",),
    "g_reduce": ("grads.reduce",),
    "comm_weights": ("comm.weights",),
    "comm_grads": ("comm.grads",),
    "comm_other": ("comm.other",),
    "optimizer": ("train.optim",),
}
# backend -> (baseline arm, sdpq arm) of sdpq.demo.ARMS
_ARMS = {"fsdp2": ("fsdp2", "fsdp2+sdpq"), "deepspeed": ("zero3", "zero3+sdpq")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backends", nargs="+", choices=list(_ARMS), default=list(_ARMS))
    p.add_argument("--steps", type=int, default=16, help="training steps per arm")
    p.add_argument("--warmup", type=int, default=4, help="first steps left out of the figures")
    from ..demo import add_job_arguments

    add_job_arguments(p)
    p.add_argument(
        "--baseline",
        choices=["plain", "exact"],
        default="plain",
        help="plain: the framework alone; exact: sdpq's exact collectives (the demo's baseline)",
    )
    p.add_argument("--out", default=None, help="keep each arm's result JSON and log here (default: a temp dir)")


def breakdown(spans: dict) -> dict:
    """One rank's step, {label: [inclusive s, self s, calls]} -> the columns (seconds)."""

    def own(labels):
        return sum(spans[k][1] for k in labels if k in spans)

    row = {col: own(labels) for col, labels in _LABELS.items()}
    row["comm_wait"] = row["comm_weights"] + row["comm_grads"] + row["comm_other"]
    row["total"] = spans["train.step"][0] if "train.step" in spans else float("nan")
    row["rest"] = row["total"] - sum(row[c] for c in PARTS)
    return row


def aggregate(timing: list[list[dict]], warmup: int) -> dict:
    """Every rank's per-step spans (RunResult.extra["timing"]) -> one row of columns: mean over
    ranks per step, then the mean over the middle half of the post-warm-up steps by total."""
    steps = min(len(per_step) for per_step in timing)
    keys = list(_LABELS) + ["comm_wait", "total", "rest"]
    per_step = []
    for s in range(steps):
        rows = [breakdown(per_rank[s]) for per_rank in timing]
        per_step.append({k: sum(r[k] for r in rows) / len(rows) for k in keys})
    kept = per_step[min(warmup, steps - 1) :]
    ranked = sorted(kept, key=lambda r: r["total"])
    cut = len(ranked) // 4
    mid = ranked[cut : len(ranked) - cut]
    out = {k: sum(r[k] for r in mid) / len(mid) for k in keys}
    out.update(step_median=statistics.median(r["total"] for r in kept), steps_used=len(mid), steps_measured=len(kept))
    return out


def _run_arm(name: str, backend: str, kind: str, args: argparse.Namespace, out: Path) -> dict:
    from ..demo import EXACT, arm_command

    block = "arm" if kind == "sdpq" else (EXACT if kind == "exact" else None)
    cmd = arm_command(name, args, out, block=block, extra=["--timing", "--eval-batches", "0", "--log-every", "0"])
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
    print(
        f"sdpq bench step: {name} ({kind}), {args.steps} steps on {args.ranks} ranks ...", file=sys.stderr, flush=True
    )
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    (out / f"{name}.log").write_text(proc.stdout)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-20:])
        raise SystemExit(f"sdpq bench step: arm {name} failed (exit {proc.returncode}):\n{tail}")
    result = json.loads((out / f"{name}.json").read_text())
    row = aggregate(result["extra"]["timing"], args.warmup)
    return dict(
        backend=backend,
        arm=name,
        kind=kind,
        **row,
        step_seconds=result["step_seconds"],
        ranks=args.ranks,
        ranks_per_node=args.ranks_per_node,
        d_model=args.d_model,
        n_layer=args.n_layer,
        aggregation="mean over ranks; interquartile mean over steps after warm-up",
    )


def run(args: argparse.Namespace) -> list[dict]:
    if args.steps <= args.warmup:
        raise SystemExit(f"sdpq bench step: --steps ({args.steps}) must exceed --warmup ({args.warmup})")
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="sdpq-bench-step-"))
    out.mkdir(parents=True, exist_ok=True)
    records = []
    try:
        for backend in args.backends:
            base_name, sdpq_name = _ARMS[backend]
            base = _run_arm(base_name, backend, args.baseline, args, out)
            ours = _run_arm(sdpq_name, backend, "sdpq", args, out)
            base["vs_baseline"] = 1.0
            ours["vs_baseline"] = ours["total"] / base["total"] if base["total"] else float("nan")
            records += [base, ours]
    finally:
        if not args.out:
            shutil.rmtree(out, ignore_errors=True)
    return records
