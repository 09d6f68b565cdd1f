"""Cross-node bytes per steady step of the long-run study's arms, by the least-traffic meter.

The long-run study (convergence_long.py: the bf16 baselines and sdpq's default block, FSDP2 and
ZeRO-3), its below-four-bits setting (frontier_long.py, `w2-g4`) and its weight-reference arm
(reference_long.py, `ref-auto`) counted their bytes with the process-group meter of the time,
which counted a collective as if every rank sent its piece to every other member. Their losses
stand; their bytes are counted again here with the one byte model (sdpq/comm/traffic.py, the
least cross-node traffic): every arm on the study's model and protocol (seed 0), trained for
`--steps` and for twice as many in one launch per framework, the meter counting the training
steps only; the steady bytes per step are the difference divided by the extra steps (no first
exact refresh; bytes per step do not depend on the run's length after it).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/long_bytes.py      # ~10 min on 2 cores
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # ranks share the cores

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import convergence_long as cl  # noqa: E402
import frontier  # noqa: E402
import reference_long  # noqa: E402

from benchmarks.provenance import provenance  # noqa: E402
from benchmarks.steady_bytes import short_protocol, steady_and_start  # noqa: E402

TAG = "[long_bytes]"


def study_arms() -> dict:
    """{name: (sdpq block or None, bf16 parameters)}: the baseline, the default block and the
    long-run settings whose bytes the results page reports."""
    below = {k: v for k, v in frontier.arms(frontier.parse_settings("w2-g4")).items() if k != "baseline"}
    return {**cl.ARMS, **below, **reference_long.arms(["auto"])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2, help="steps of the shorter run (the longer runs twice as many)")
    ap.add_argument("--frameworks", default="fsdp2,zero3")
    ap.add_argument("--study", default=str(ROOT / "benchmarks" / "results" / "convergence_long.json"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "long_bytes.json"))
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args(argv)
    study = json.loads(Path(args.study).read_text())["args"]
    arms = study_arms()
    steady: dict = {}
    for fw in args.frameworks.split(","):
        totals = {}
        for n in (args.steps, 2 * args.steps):
            # The study's model, data and optimizer; a schedule that fits the short run.
            res = cl.run_job(short_protocol(study, n, args.timeout), fw, 0, arms)
            totals[n] = {arm: r["meter_cross_node_bytes_per_step"] * n for arm, r in res.items()}
        steady[fw] = steady_and_start(totals[args.steps], totals[2 * args.steps], args.steps)[0]
        for arm, b in steady[fw].items():
            print(f"{TAG} {fw} {arm:9}: {b / 1e6:.4f} MB a steady step, {b / steady[fw]['baseline']:.3f} of bf16")
    ratios = {fw: {arm: b / per["baseline"] for arm, b in per.items()} for fw, per in steady.items()}
    shown = {k: v for k, v in vars(args).items() if k != "out"}
    record = {"args": shown, "meta": provenance(), "protocol": study, "steady": steady, "ratios": ratios}
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(f"{TAG} wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
