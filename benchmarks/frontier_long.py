"""Settings of the frontier screen (benchmarks/frontier.py) on the long-run study's protocol:
the Llama-shaped model, 1000 steps, seeds 0-2, FSDP2 and ZeRO-3, 4 gloo ranks as 2 nodes x 2,
the independent byte meter.

The baseline and the default block come from the long-run study's file
(results/convergence_long.json) and are not run again: its protocol (every argument) is
reused, and the baseline arm's code path is deterministic (a fresh baseline run repeats the
stored losses bit for bit until the learning-rate schedules of different lengths part). Only
the named settings run here, each cached next to --out, so an interrupted study resumes.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/frontier_long.py --settings w3-g3   # ~45 min
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # ranks share the cores

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import convergence_long as cl  # noqa: E402
from benchmarks import frontier  # noqa: E402
from benchmarks.provenance import provenance  # noqa: E402

TAG = "[frontier_long]"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", required=True, help="names like w3-g3, comma-separated (see frontier.py)")
    add_study_arguments(ap, "frontier_long.json")
    args = ap.parse_args(argv)
    settings = frontier.parse_settings(args.settings)
    return run_arms({name: arm for name, arm in frontier.arms(settings).items() if name != "baseline"}, args)


def add_study_arguments(ap: argparse.ArgumentParser, out_name: str) -> None:
    ap.add_argument("--frameworks", default="fsdp2,zero3")
    ap.add_argument("--study", default=str(ROOT / "benchmarks" / "results" / "convergence_long.json"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / out_name))
    ap.add_argument("--timeout", type=float, default=2 * 3600)


def run_arms(arms: dict, args: argparse.Namespace) -> int:
    """Run `arms` ({name: (block, bf16 parameters)}) on the study's protocol, next to its baseline
    and default arms; write args.out and print the summary."""
    study = json.loads(Path(args.study).read_text())
    proto = argparse.Namespace(**{**study["args"], "timeout": args.timeout})  # the study's protocol
    fws = [f for f in args.frameworks.split(",") if f]
    out = Path(args.out)
    parts = out.with_suffix(".parts")
    parts.mkdir(parents=True, exist_ok=True)
    runs: dict = {}
    t0 = time.time()
    for fw in fws:
        runs[fw] = {}
        for seed, stored in study["runs"][fw].items():
            runs[fw][seed] = {"baseline": stored["baseline"], "default": stored["sdpq"]}
            for name, arm in arms.items():
                part = parts / f"{fw}_seed{seed}_{proto.steps}steps_{name}.json"
                if not part.exists():
                    t = time.time()
                    res = cl.run_job(proto, fw, int(seed), {name: arm})[name]
                    part.write_text(json.dumps(res))
                    print(
                        f"{TAG} {fw} seed {seed} {name}: final loss {cl.final_loss(res['losses']):.4f} "
                        f"(baseline {cl.final_loss(stored['baseline']['losses']):.4f}), cross-node "
                        f"{res['meter_cross_node_bytes_per_step'] / 1e6:.3f} MB/step ({time.time() - t:.0f} s)",
                        flush=True,
                    )
                runs[fw][seed][name] = json.loads(part.read_text())
    summary = {name: cl.summarize(runs, proto, arm=name) for name in ["default", *arms]}
    protocol = {k: v for k, v in vars(proto).items() if k not in ("out", "timeout", "replot")}
    meta = {"study": Path(args.study).name, "protocol": protocol, "wall_seconds": time.time() - t0, **provenance()}
    shown = {**vars(args), "study": frontier._relative(args.study), "out": frontier._relative(args.out)}
    out.write_text(json.dumps({"args": shown, "meta": meta, "summary": summary, "runs": runs}, indent=1))
    for name, per_fw in summary.items():
        for fw, s in per_fw.items():
            print(
                f"{name:>10} {fw}: bytes {s['bytes_ratio']:.3f} of bf16, final loss {s['diff_percent']:+.2f}% "
                f"({s['diff_in_baseline_sd']:+.2f} sd; paired {', '.join(f'{d:+.4f}' for d in s['paired_diffs'])})"
            )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
