"""`sdpq plan`'s cross-node bytes per step against what live runs count: FSDP2 (bf16 mixed
precision, fp32 reduce), ZeRO-3 (bf16, parameters re-gathered in the backward as at scale), ZeRO-2
and ZeRO-1 (bf16), each plain and with sdpq's default block, on the CPU layouts 2x2 and 2x4 (gloo
ranks as nodes x ranks per node).

Both sides use the one byte model (sdpq/comm/traffic.py): the least cross-node traffic of each
collective. FSDP2 is counted by sdpq's statistics (the plain arm through sdpq's exact collectives,
bitwise FSDP2's own), DeepSpeed by the process-group meter (every collective of every caller, so
DeepSpeed's own algorithms decide what the baseline moves). A run's first step is not a steady
one (the first weight refresh is exact), so each configuration trains twice in one launch, for
`--steps` and for twice as many, and the steady bytes per step are the difference divided by the
extra steps. The plan gives one node's link per step; the runs' totals over all ranks are
divided by the node count.

ZeRO-3 runs with `stage3_max_reuse_distance`, `stage3_param_persistence_threshold` and
`stage3_prefetch_bucket_size` 0: at scale a block's parameters are far above the persistence
threshold (1e5 elements) and the prefetch and reuse windows (5e7 and 1e9 elements by default) hold
a few blocks of a model of hundreds, so nearly every block is gathered again in the backward. On
this small model the defaults keep the whole model gathered from the forward to the backward,
which no large job sees.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/plan_bytes_check.py     # ~20 min on 2 cores

Runs already in --out are kept and not run again (delete the file to measure everything anew).
Exits 1 when a run's planned bytes differ from the measured ones by more than --tolerance.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # ranks share the cores

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.provenance import provenance  # noqa: E402
from sdpq.launch.local import run_local  # noqa: E402

LAYOUTS = [(2, 2), (2, 4)]
FRAMEWORKS = ("fsdp2", "zero3", "zero2", "zero1")
ARMS = ("plain", "sdpq")
ZERO3_AT_SCALE = {
    "stage3_max_reuse_distance": 0,
    "stage3_param_persistence_threshold": 0,
    "stage3_prefetch_bucket_size": 0,
}
TAG = "[plan_bytes_check]"


def spec_for(framework: str, per_node: int, arm: str, steps: int):
    from sdpq.train.llama import LlamaConfig
    from sdpq.train.run import RunSpec

    fsdp = framework == "fsdp2"
    return RunSpec(
        backend="fsdp2" if fsdp else "deepspeed",
        model=LlamaConfig(seq_len=64, n_layer=2, n_head=4, d_model=256),
        sdpq=None if arm == "plain" else {"weights": {"mode": "diff"}},
        bf16=not fsdp or arm != "plain",  # DeepSpeed: bf16; FSDP2: bf16 parameters under sdpq
        mixed_precision="bf16" if fsdp else None,
        steps=steps,
        micro_batch=2,
        warmup=1,
        lr=1e-3,
        eval_batches=0,
        log_every=0,
        ranks_per_node=per_node,
        count_bytes="exact" if fsdp else "meter",
    )


def ds_overrides(framework: str) -> dict:
    stage = int(framework[-1])
    zero: dict = {"stage": stage, **(ZERO3_AT_SCALE if stage == 3 else {})}
    return {"zero_optimization": zero}


def worker(job_file: str, out_file: str) -> None:
    """One launch: train the job's configuration for `steps` and for 2 x `steps`; rank 0 writes
    the bytes all ranks sent across nodes in each."""
    import logging
    import warnings

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    job = json.loads(Path(job_file).read_text())
    framework, per_node, arm, steps = job["framework"], job["per_node"], job["arm"], job["steps"]
    if framework == "fsdp2":
        from sdpq.train.fsdp_backend import train

        dist.init_process_group("gloo")
        run = lambda spec: train(spec)  # noqa: E731
    else:
        import sdpq.integrations.deepspeed as sds
        from sdpq.train.deepspeed_backend import train as ds_train

        sds.init_distributed(dist_backend="gloo")
        run = lambda spec: ds_train(spec, ds_overrides=ds_overrides(framework))  # noqa: E731
    totals = {}
    for n in (steps, 2 * steps):
        result = run(spec_for(framework, per_node, arm, n))
        totals[n] = result.cross_node_bytes_per_step * n
    if dist.get_rank() == 0:
        Path(out_file).write_text(json.dumps({"totals": totals, "params": result.extra.get("params")}))
    dist.destroy_process_group()


def measure(framework: str, nodes: int, per_node: int, arm: str, steps: int, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="sdpq-plan-bytes-") as tmp:
        job, out, log = Path(tmp) / "job.json", Path(tmp) / "out.json", Path(tmp) / "run.log"
        job.write_text(json.dumps({"framework": framework, "per_node": per_node, "arm": arm, "steps": steps}))
        code = run_local(
            [str(Path(__file__).resolve()), "--worker", str(job), str(out)],
            nodes * per_node,
            launcher="torchrun" if framework == "fsdp2" else "deepspeed",
            log=log,
            timeout=timeout,
        )
        if code != 0 or not out.exists():
            raise RuntimeError(f"{framework} {nodes}x{per_node} {arm} failed ({code}):\n{log.read_text()[-3000:]}")
        got = json.loads(out.read_text())
    totals = {int(k): v for k, v in got["totals"].items()}
    steady = (totals[2 * steps] - totals[steps]) / steps
    return {"per_node_per_step": steady / nodes, "totals": totals}


def planned(framework: str, nodes: int, per_node: int, arm: str) -> dict:
    from sdpq.plan import arms_for
    from sdpq.plan.shapes import from_config
    from sdpq.plan.traffic import cross_node_bytes

    model = from_config(spec_for(framework, per_node, arm, 1).model)
    plan_arm = next(a for a in arms_for(framework) if a.name == ("bf16" if arm == "plain" else "sdpq"))
    return cross_node_bytes(model, framework, nodes, per_node, plan_arm)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs=2, metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # the deepspeed launcher's
    ap.add_argument("--steps", type=int, default=2, help="steps of the shorter run (the longer runs twice as many)")
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--layouts", default=",".join(f"{n}x{l}" for n, l in LAYOUTS))
    ap.add_argument("--tolerance", type=float, default=0.05)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "plan_bytes_check.json"))
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    out = Path(args.out)
    rows = json.loads(out.read_text())["rows"] if out.exists() else []
    done = {(r["framework"], r["layout"], r["arm"]) for r in rows}
    for framework in args.frameworks.split(","):
        for layout in args.layouts.split(","):
            nodes, per_node = (int(x) for x in layout.split("x"))
            for arm in args.arms.split(","):
                if (framework, layout, arm) in done:
                    continue
                got = measure(framework, nodes, per_node, arm, args.steps, args.timeout)
                want = planned(framework, nodes, per_node, arm)
                rel = (want["total"] - got["per_node_per_step"]) / got["per_node_per_step"]
                rows.append(
                    {
                        "framework": framework,
                        "layout": layout,
                        "arm": arm,
                        "measured_per_node_per_step": got["per_node_per_step"],
                        "planned": want,
                        "relative_difference": rel,
                        "totals": got["totals"],
                    }
                )
                shown = {k: v for k, v in vars(args).items() if k not in ("worker", "local_rank")}
                out.write_text(json.dumps({"args": shown, "meta": provenance(), "rows": rows}, indent=1))
                print(
                    f"{TAG} {framework:5} {layout} {arm:5}: measured {got['per_node_per_step'] / 1e6:.4f} MB per "
                    f"node and step, planned {want['total'] / 1e6:.4f} ({100 * rel:+.2f}%)",
                    flush=True,
                )
    for framework in args.frameworks.split(","):
        for layout in args.layouts.split(","):
            by_arm = {r["arm"]: r for r in rows if r["framework"] == framework and r["layout"] == layout}
            if {"plain", "sdpq"} <= set(by_arm):
                m = by_arm["sdpq"]["measured_per_node_per_step"] / by_arm["plain"]["measured_per_node_per_step"]
                p = by_arm["sdpq"]["planned"]["total"] / by_arm["plain"]["planned"]["total"]
                print(f"{TAG} {framework:5} {layout} ratio sdpq / plain: measured {m:.3f}, planned {p:.3f}")
    worst = max(abs(r["relative_difference"]) for r in rows)
    print(f"{TAG} worst planned vs measured: {100 * worst:.2f}% (wrote {out})")
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    raise SystemExit(main())
