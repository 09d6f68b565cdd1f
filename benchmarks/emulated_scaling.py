"""Step time of sdpq vs the baseline on an emulated cluster: 2 nodes x 2 ranks, a shaped link.

For each inter-node bandwidth (default 200 Mbit/s, 1 Gbit/s, 5 Gbit/s) one emulated cluster is
built (``sdpq.launch.netns.EmulatedNodes``: a network namespace per node, tbf on the link) and,
for each backend (FSDP2, ZeRO-3), two jobs run in it back to back, each one torchrun per node
inside its namespace (``sdpq.launch.emulated.run_job``), exactly as on a real cluster:

  baseline  plain FSDP2 / ZeRO-3 (no sdpq block), bf16 parameters, the framework's AdamW
  sdpq      the full sdpq block (4-bit weight differences, 8/4-bit gradients with Hadamard,
            fp8 states + MCF master), bf16 parameters

The baseline is bf16, not fp32: it moves half the bytes of an fp32 run, the stricter baseline.
Reported per job: the median step time after warm-up (``RunResult.step_seconds``), the bytes the
link carried (the namespaces' interface counters: every packet, TCP/IP headers, rendezvous and
start-up included, divided by the step count) and, per bandwidth, the ratios sdpq/baseline
measured side by side. The link's TCP throughput is measured first at each bandwidth.

First, per backend, the baseline runs on loopback (all ranks on the host, no shaped link): the
compute floor, printed as its own row; ``sdpq_vs_floor`` is the sdpq step time over it.

Note: on this 2-core CPU machine the 4 ranks share 2 cores, so compute is far slower relative to
the network than on GPUs; the ratios show where the link is the bottleneck here, and
``sdpq bench scaling`` models GPU clusters. How slow depends on the CPU: without bf16 arithmetic
(AVX2 only) a bf16 step of the default job takes ~9 s, and the baseline hides its 200 Mbit/s
traffic behind that compute. ``--micro-batch 1 --seq-len 16`` (the same GPT, the same bytes per
step, 1/32 of the tokens) brings the compute floor back to ~0.4-0.45 of the baseline's 200 Mbit/s
step, the proportion of the first table in benchmarks/RESULTS.md (measured where bf16 was fast).

    .venv/bin/python benchmarks/emulated_scaling.py                    # ~15 min on 2 cores, needs root
    .venv/bin/python benchmarks/emulated_scaling.py --steps 20 --micro-batch 1 --seq-len 16   # ~7 min
    .venv/bin/python benchmarks/emulated_scaling.py --steps 4 --bandwidths 1gbit --d-model 64   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from sdpq.bench.report import print_table
from sdpq.launch.emulated import measure_link, run_job
from sdpq.launch.local import run_local
from sdpq.launch.netns import EmulatedNodes

ROOT = Path(__file__).resolve().parents[1]

NODES, RPN = 2, 2
FULL = {section: {} for section in ("weights", "gradients", "optimizer")}  # the library's defaults
BACKENDS = {"fsdp2": "FSDP2", "deepspeed": "ZeRO-3"}


def _job(cluster: EmulatedNodes, backend: str, block: dict | None, args, work: Path, port: int) -> dict:
    name = f"{backend}-{'sdpq' if block else 'baseline'}-{cluster.bandwidth}"
    out = work / f"{name}.json"
    cmd = [
        "-m",
        "sdpq.train",
        "--backend",
        backend,
        "--bf16",
        "--steps",
        str(args.steps),
        "--d-model",
        str(args.d_model),
        "--n-layer",
        str(args.n_layer),
        "--micro-batch",
        str(args.micro_batch),
        "--seq-len",
        str(args.seq_len),
        "--log-every",
        "0",
        "--eval-batches",
        "0",
        "--out",
        str(out),
    ]
    if block is not None:
        cfg = work / f"{name}.sdpq.json"
        cfg.write_text(json.dumps(block))
        cmd += ["--config", str(cfg)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    logs = None if args.verbose else work / name
    before, t0 = cluster.link_bytes(), time.monotonic()
    rc = run_job(cluster, cmd, RPN, port=port, timeout=args.timeout, env=env, logs=logs)
    wall = time.monotonic() - t0
    if rc != 0:
        tail = (
            ""
            if logs is None
            else "\n".join(
                f"--- {f.name}:\n" + "\n".join(f.read_text().splitlines()[-15:]) for f in sorted(logs.glob("*.log"))
            )
        )
        raise RuntimeError(f"{name} failed (exit {rc})\n{tail}")
    r = json.loads(out.read_text())
    return {
        "bandwidth": cluster.bandwidth,
        "backend": BACKENDS[backend],
        "arm": "sdpq" if block else "baseline",
        "step_seconds": r["step_seconds"],
        "link_MB_per_step": (cluster.link_bytes() - before) / args.steps / 1e6,
        "final_loss": r["losses"][-1],
        "job_seconds": wall,
    }


def _loopback_floor(backend: str, args, work: Path) -> dict:
    """The compute floor: the baseline's step time with every rank on one host (loopback, no
    shaped link), the same job otherwise. No link can make a step faster than this."""
    out = work / f"{backend}-baseline-loopback.json"
    argv = [
        "-m",
        "sdpq.train",
        "--backend",
        backend,
        "--bf16",
        "--steps",
        str(args.steps),
        "--d-model",
        str(args.d_model),
        "--n-layer",
        str(args.n_layer),
        "--micro-batch",
        str(args.micro_batch),
        "--seq-len",
        str(args.seq_len),
        "--ranks-per-node",
        str(RPN),
        "--log-every",
        "0",
        "--eval-batches",
        "0",
        "--out",
        str(out),
    ]
    t0 = time.monotonic()
    log = work / f"{backend}-baseline-loopback.log"
    code = run_local(argv, NODES * RPN, log=log, timeout=args.timeout)
    if code != 0:
        raise RuntimeError(f"loopback {backend} failed (exit {code})\n{log.read_text()[-2000:]}")
    r = json.loads(out.read_text())
    return {
        "bandwidth": "loopback",
        "backend": BACKENDS[backend],
        "arm": "baseline (compute floor)",
        "step_seconds": r["step_seconds"],
        "final_loss": r["losses"][-1],
        "job_seconds": time.monotonic() - t0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bandwidths", default="200mbit,1gbit,5gbit")
    ap.add_argument("--backends", default="fsdp2,deepspeed")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=1200, help="per job, seconds")
    ap.add_argument("--verbose", action="store_true", help="show the ranks' output")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "emulated_scaling.json"))
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("emulated_scaling: network namespaces need root")
    backends = [b for b in args.backends.split(",") if b]
    for b in backends:
        if b not in BACKENDS:
            ap.error(f"--backends: {b!r}; allowed: {', '.join(BACKENDS)}")

    records, ratios, links, floor = [], [], {}, {}
    port = 29400
    with tempfile.TemporaryDirectory(prefix="sdpq-scaling-") as tmp:
        for backend in backends:
            rec = _loopback_floor(backend, args, Path(tmp))
            floor[BACKENDS[backend]] = rec["step_seconds"]
            records.append(rec)
            print(
                f"[{time.strftime('%H:%M:%S')}] loopback {BACKENDS[backend]:<7} baseline (compute floor) "
                f"{rec['step_seconds']:.3f} s/step",
                flush=True,
            )
        for bw in [b for b in args.bandwidths.split(",") if b]:
            with EmulatedNodes(NODES, bw) as cluster:
                links[bw] = measure_link(cluster, megabytes=64)
                print(f"[{time.strftime('%H:%M:%S')}] link {bw}: TCP {links[bw]:.0f} Mbit/s", flush=True)
                for backend in backends:
                    pair = {}
                    for arm, block in (("baseline", None), ("sdpq", FULL)):
                        for attempt in (1, 2):  # one retry: a rendezvous can fail for reasons not ours
                            port += 1  # a fresh rendezvous port per job (no TIME_WAIT collisions)
                            try:
                                rec = _job(cluster, backend, block, args, Path(tmp), port)
                                break
                            except RuntimeError as e:
                                print(f"    attempt {attempt}: {e}", flush=True)
                                if attempt == 2:
                                    raise SystemExit(1) from e
                        rec["attempts"] = attempt
                        print(
                            f"    {BACKENDS[backend]:<7} {arm:<8} {rec['step_seconds']:.3f} s/step  "
                            f"link {rec['link_MB_per_step']:.2f} MB/step",
                            flush=True,
                        )
                        records.append(rec)
                        pair[arm] = rec
                    ratios.append(
                        {
                            "bandwidth": bw,
                            "link_Mbit_s": links[bw],
                            "backend": BACKENDS[backend],
                            "baseline_s": pair["baseline"]["step_seconds"],
                            "sdpq_s": pair["sdpq"]["step_seconds"],
                            "step_time_ratio": pair["sdpq"]["step_seconds"] / pair["baseline"]["step_seconds"],
                            "sdpq_vs_floor": pair["sdpq"]["step_seconds"] / floor[BACKENDS[backend]],
                            "link_bytes_ratio": pair["sdpq"]["link_MB_per_step"] / pair["baseline"]["link_MB_per_step"],
                        }
                    )
    print_table(
        ratios,
        f"Emulated cluster {NODES} nodes x {RPN} ranks, bf16 GPT {args.n_layer}x{args.d_model}, "
        f"{args.steps} steps: sdpq / baseline (< 1 = sdpq faster)",
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    print_table(
        [{"backend": b, "loopback_baseline_s": t} for b, t in floor.items()],
        "Compute floor: the baseline on loopback (no shaped link)",
    )
    out.write_text(
        json.dumps(
            {
                "args": vars(args),
                "date": time.strftime("%Y-%m-%d"),
                "link_Mbit_s": links,
                "compute_floor_s": floor,
                "ratios": ratios,
                "runs": records,
            },
            indent=1,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
