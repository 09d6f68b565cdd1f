"""What each Triton kernel issues per element when compiled for an H100 (sm_90), against the
issue budget that 0.8 of the H100's bandwidth leaves (tests/kernels/sass.py): the launches of a
training step at sdpq.config's defaults. No GPU is needed: Triton's own compiler and cuobjdump.

    .venv/bin/python benchmarks/kernel_budget.py      # ~1 min on 2 cores -> results/kernel_budget.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.provenance import provenance  # noqa: E402


def compile_cases() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = ROOT / "tests" / "kernels" / "sm90_compile.py"
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kernel_budget.json"))
    args = ap.parse_args()
    import triton

    cases = [r for r in compile_cases() if r["budget_case"]]
    for r in cases:
        flag = "OVER" if r["per_element"] > r["budget"] else "ok"
        print(f"{r['case']:58s} {r['per_element']:7.2f} / {r['budget']:7.2f} instructions per element  {flag}")
    record = {
        "args": {},
        "meta": {**provenance(), "triton": triton.__version__, "target": "sm_90 (H100), compiled on the CPU"},
        "cases": cases,
    }
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
