"""Entry point of one check step's process: `python -m sdpq.check.step NAME --result FILE`.

Writes the step's result as JSON to FILE; an exception becomes a "fail" result with its
traceback, so the runner always learns why.
"""

from __future__ import annotations

import argparse
import json
import traceback
from pathlib import Path

from .steps import STEPS, Ctx


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m sdpq.check.step")
    p.add_argument("name", choices=list(STEPS))
    p.add_argument("--result", required=True)
    p.add_argument("--rehearse", action="store_true")
    args = p.parse_args()
    ctx = Ctx(rehearse=args.rehearse)
    try:
        if not ctx.rehearse:
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError("no CUDA device visible to torch (pass --rehearse to run on the CPU)")
        rec = STEPS[args.name].fn()(ctx)
    except Exception as e:  # noqa: BLE001 - the report carries every failure
        tb = traceback.format_exc()
        print(tb, flush=True)
        # A rank's failure arrives as one long message: its last line says what went wrong.
        last = [line for line in str(e).splitlines() if line.strip()]
        rec = {"status": "fail", "error": f"{type(e).__name__}: {last[-1] if last else ''}", "traceback": tb[-3000:]}
    Path(args.result).write_text(json.dumps(rec, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
