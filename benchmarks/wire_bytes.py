"""The wire as ground truth: the bytes an emulated cluster's link really carried, next to the byte
model's least-traffic and ring figures, for FSDP2, ZeRO-3 and DDP, baseline and sdpq.

One emulated cluster (``sdpq.launch.netns.EmulatedNodes``: 2 nodes x 2 ranks, a network namespace
per node, a shaped link) runs every job as on a real cluster (one torchrun per node, gloo). Each
job runs twice, with ``--short`` and ``--long`` steps; a figure per step is the difference of the
two runs over the extra steps, which removes start-up, rendezvous and the first step's exact
weight exchange from the wire and the model alike. Per job and step (and the long run's median
step time after its warm-up steps, `step_seconds`: run it on an otherwise idle machine):

- ``wire``: the link interface's byte counters (both directions; TCP/IP headers and
  acknowledgements included);
- ``least``: the byte model's least cross-node traffic (sdpq/comm/traffic.py, as sdpq.stats
  records it from the run's collectives: sdpq's own, or its exact ones that are bitwise the
  framework's, so that the baseline's collectives are the same calls);
- ``ring``: the same collectives as NCCL's ring would carry them.

Gloo's own algorithms decide what is really sent: its all-gather and reduce-scatter are rings
over the group, its all-reduce a ring or a halving-doubling exchange. The wire/least and
wire/ring columns say which model a baseline's traffic follows; sdpq's cross-node collectives run
over groups with one rank per node, where the two models agree.

    .venv/bin/python benchmarks/wire_bytes.py                 # ~6 min on 2 cores, needs root
    .venv/bin/python benchmarks/wire_bytes.py --backends ddp --short 2 --long 4   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sdpq.bench.report import print_table
from sdpq.launch.emulated import run_job
from sdpq.launch.netns import EmulatedNodes

ROOT = Path(__file__).resolve().parents[1]
NODES, RPN = 2, 2
DEFAULT = {section: {} for section in ("weights", "gradients", "optimizer")}  # the library's defaults
BACKENDS = {"fsdp2": "FSDP2", "deepspeed": "ZeRO-3", "ddp": "DDP"}


def _run(cluster: EmulatedNodes, backend: str, block: dict | None, steps: int, args, work: Path, port: int) -> dict:
    """One job: the link's bytes and the model's figures (job totals)."""
    name = f"{backend}-{'sdpq' if block else 'baseline'}-{steps}"
    out = work / f"{name}.json"
    cmd = ["-m", "sdpq.train", "--backend", backend, "--steps", str(steps), "--d-model", str(args.d_model)]
    cmd += ["--n-layer", str(args.n_layer), "--micro-batch", "1", "--seq-len", "16", "--log-every", "0"]
    cmd += ["--eval-batches", "0", "--count-bytes", "exact", "--out", str(out)]
    # Baselines as users run them: FSDP2 and DDP bf16 compute on fp32 parameters (FSDP2 reduces in
    # fp32, DDP all-reduces fp32 gradients), ZeRO-3 bf16. sdpq's arms keep bf16 parameters, which
    # its default MCF master needs (the demo's arms are paired the same way).
    cmd += ["--mixed-precision", "bf16"] if block is None and backend != "deepspeed" else ["--bf16"]
    if block is not None:
        cfg = work / f"{name}.sdpq.json"
        cfg.write_text(json.dumps(block))
        cmd += ["--config", str(cfg)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    before = cluster.link_bytes()
    rc = run_job(cluster, cmd, RPN, port=port, timeout=args.timeout, env=env, logs=work / name)
    if rc != 0:
        logs = "\n".join(f.read_text()[-1500:] for f in sorted((work / name).glob("*.log")))
        raise RuntimeError(f"{name} failed (exit {rc})\n{logs}")
    r = json.loads(out.read_text())
    inter = [links["inter"] for links in r["comm"]["total"].values() if "inter" in links]
    return {
        "wire": cluster.link_bytes() - before,
        "least": sum(c["bytes"] for c in inter),
        "ring": sum(c["ring_bytes"] for c in inter),
        "final_loss": r["losses"][-1],
        "step_seconds": r["step_seconds"],  # median after the warm-up steps (sdpq.train)
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bandwidth", default="1gbit")
    ap.add_argument("--backends", default="fsdp2,deepspeed,ddp")
    ap.add_argument("--short", type=int, default=3, help="steps of the first run of each job")
    ap.add_argument("--long", type=int, default=9, help="steps of the second run of each job")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=900, help="per job, seconds")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "wire_bytes.json"))
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("wire_bytes: network namespaces need root")
    if not 0 < args.short < args.long:
        ap.error(f"--short {args.short} and --long {args.long}: allowed 0 < short < long")
    backends = [b for b in args.backends.split(",") if b]
    for b in backends:
        if b not in BACKENDS:
            ap.error(f"--backends: {b!r}; allowed: {', '.join(BACKENDS)}")

    rows, port, extra = [], 29500, args.long - args.short
    with tempfile.TemporaryDirectory(prefix="sdpq-wire-") as tmp, EmulatedNodes(NODES, args.bandwidth) as cluster:
        for backend in backends:
            for arm, block in (("baseline", None), ("sdpq", DEFAULT)):
                runs = []
                for steps in (args.short, args.long):
                    port += 1  # a fresh rendezvous port per job (no TIME_WAIT collisions)
                    runs.append(_run(cluster, backend, block, steps, args, Path(tmp), port))
                per_step = {k: (runs[1][k] - runs[0][k]) / extra for k in ("wire", "least", "ring")}
                rows.append(
                    {
                        "backend": BACKENDS[backend],
                        "arm": arm,
                        **per_step,
                        "final_loss": runs[1]["final_loss"],
                        "step_seconds": runs[1]["step_seconds"],
                    }
                )
                print(f"[{time.strftime('%H:%M:%S')}] {rows[-1]}", flush=True)
    by = {(r["backend"], r["arm"]): r for r in rows}
    table = []
    for r in rows:
        base = by[(r["backend"], "baseline")]
        table.append(
            {
                "framework": r["backend"],
                "arm": r["arm"],
                "wire MB/step": f"{r['wire'] / 1e6:.3f}",
                "least MB": f"{r['least'] / 1e6:.3f}",
                "ring MB": f"{r['ring'] / 1e6:.3f}",
                "wire/least": f"{r['wire'] / r['least']:.2f}",
                "wire/ring": f"{r['wire'] / r['ring']:.2f}",
                "wire ratio": f"{r['wire'] / base['wire']:.3f}",
                "least ratio": f"{r['least'] / base['least']:.3f}",
                "step s": f"{r['step_seconds']:.3f}",
                "step ratio": f"{r['step_seconds'] / base['step_seconds']:.3f}",
            }
        )
    print_table(table, f"cross-node bytes per step, {NODES}x{RPN}, {args.bandwidth} link")
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next(
        (line.split(":", 1)[1].strip() for line in cpu.splitlines() if "Model name" in line), platform.processor()
    )
    record = {
        "arguments": {k: v for k, v in vars(args).items() if k != "out"},
        "layout": f"{NODES}x{RPN}",
        "cpu": model,
        "date": time.strftime("%Y-%m-%d"),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip(),
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
