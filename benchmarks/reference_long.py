"""The weight reference's storage on the long-run study's protocol (the Llama-shaped model, 1000
steps, seeds 0-2, FSDP2 and ZeRO-3, 4 gloo ranks as 2 nodes x 2, the independent byte meter):
`weights.reference` "auto" (the compute dtype: bf16 here, the default since the memory work) and
"int8" (8-bit codes, ~1.03/L bytes per parameter), against the study's baseline and its default
arm of the time (an fp32 reference), which are not run again (see frontier_long.py).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/reference_long.py                # ~90 min on 2 cores
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/reference_long.py --references int8
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # ranks share the cores

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import convergence_long as cl  # noqa: E402
from benchmarks import frontier_long  # noqa: E402

KINDS = ("auto", "int8", "bf16", "fp32")


def arms(references: list[str]) -> dict:
    """{"ref-<kind>": (the study's block with weights.reference set, bf16 parameters)}."""
    return {f"ref-{k}": ({**cl.SDPQ, "weights": {"reference": k}}, True) for k in references}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--references", default="auto,int8", help=f"comma-separated, of {', '.join(KINDS)}")
    frontier_long.add_study_arguments(ap, "reference_long.json")
    args = ap.parse_args(argv)
    refs = [r for r in args.references.split(",") if r]
    bad = [r for r in refs if r not in KINDS]
    if bad:
        raise SystemExit(f"--references: {bad[0]!r}; allowed: {', '.join(KINDS)}")
    return frontier_long.run_arms(arms(refs), args)


if __name__ == "__main__":
    raise SystemExit(main())
