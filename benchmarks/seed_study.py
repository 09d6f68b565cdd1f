"""What the multi-arm seed studies share (benchmarks/ddp_seeds.py, benchmarks/deepspeed_zero12.py):
every seed is one job of WORLD ranks that trains every arm on the same data (the protocol of
benchmarks/convergence_long.py); the summary compares each arm with the baseline arm seed by seed."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterable
from pathlib import Path

from benchmarks import convergence_long as cl
from benchmarks.provenance import provenance

__all__ = ["add_arguments", "against_baseline", "write"]

RESULTS = Path(__file__).resolve().parent / "results"


def add_arguments(ap: argparse.ArgumentParser, *, steps: int, arms: Iterable[str], out: str) -> None:
    """--worker (the job's ranks), --steps, --seeds, --arms, the protocol's model options,
    --timeout (per seed), --out (a file name under benchmarks/results by default)."""
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--arms", default=",".join(arms))
    cl.add_model_arguments(ap)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out", default=str(RESULTS / out))


def against_baseline(arm_runs: list[dict], base_runs: list[dict]) -> dict:
    """One arm's runs over seeds against the baseline arm's on the same seeds (runs holding
    "losses", "meter_cross_node_bytes_per_step", "replicas_equal_every_step"): final loss mean and
    sd, paired differences (%), the difference in the baseline's sd, bytes per step and their ratio,
    replicas bitwise equal at every step of every seed."""
    base = [cl.final_loss(r["losses"]) for r in base_runs]
    finals = [cl.final_loss(r["losses"]) for r in arm_runs]
    base_bytes = statistics.mean(r["meter_cross_node_bytes_per_step"] for r in base_runs)
    nbytes = statistics.mean(r["meter_cross_node_bytes_per_step"] for r in arm_runs)
    return {
        "final_loss_mean": statistics.mean(finals),
        "final_loss_sd": statistics.stdev(finals) if len(finals) > 1 else 0.0,
        "paired_diff_percent": [100 * (f - b) / b for f, b in zip(finals, base)],
        "diff_in_baseline_sd": (statistics.mean(finals) - statistics.mean(base)) / statistics.stdev(base)
        if len(base) > 1
        else float("nan"),
        "bytes_per_step": nbytes,
        "bytes_ratio": nbytes / base_bytes,
        "replicas_equal_every_step": all(r["replicas_equal_every_step"] for r in arm_runs),
    }


def write(args: argparse.Namespace, started: float, summary: dict, runs: dict) -> None:
    """args.out: the options (--worker left out), provenance and wall time, summary, every run."""
    shown = {k: v for k, v in vars(args).items() if k != "worker"}
    meta = {"wall_seconds": time.time() - started, **provenance()}
    Path(args.out).write_text(json.dumps({"args": shown, "meta": meta, "summary": summary, "runs": runs}, indent=1))
