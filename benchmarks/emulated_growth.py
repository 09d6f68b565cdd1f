"""Growth with nodes: the same GPT on 2, 3 and 4 emulated nodes, FSDP2 without and with sdpq,
measured next to the scaling model's prediction (``sdpq.bench.scaling_model``).

Layouts: 2x1, 3x1, 4x1 and 2x2 (nodes x ranks per node; at most 4 ranks on this 2-core machine).
Per layout and arm, one job on emulated nodes (``sdpq.launch.netns``: a network namespace per
node, a shaped link) and the same job on loopback (its compute floor):

- bytes: every rank counts what it puts on the inter-node links at the process-group level
  (sdpq/comm/link_bytes.py; not sdpq's statistics), per optimizer step; the mean of steps 2..
  summed over ranks must EQUAL ``fsdp_cross_node_bytes`` (the model's byte formula for this GPT,
  world and layout), path by path;
- time: predicted step = the loopback step (compute, intra-node traffic, kernels) + the busiest
  node's cross-node bytes per step / the link's measured TCP throughput; measured = the median
  step time of the emulated job.

fp32 parameters and gradients (FSDP2 without a mixed-precision policy): this CPU has no fast
bf16 arithmetic, and the formula takes the dtypes as inputs either way.

    sudo .venv/bin/python benchmarks/emulated_growth.py [--bandwidth 1gbit] [--steps 12]   # ~15 min
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from sdpq.bench.report import print_table
from sdpq.bench.scaling_model import fsdp_cross_node_bytes
from sdpq.launch.emulated import measure_link, run_job
from sdpq.launch.local import run_local
from sdpq.launch.netns import EmulatedNodes

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = [(2, 1), (3, 1), (4, 1), (2, 2)]
QUANT = {"weights": {"mode": "diff"}, "gradients": {"mode": "two_level"}, "optimizer": {"enabled": False}}
PATHS = ("weights", "gradients")


def worker(job_file: str, out_file: str) -> None:
    """One rank: train, count link bytes per step, rank 0 writes every rank's counts."""
    import torch
    import torch.distributed as dist
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from sdpq.comm.link_bytes import LinkBytes
    from sdpq.train.fsdp_backend import train
    from sdpq.train.run import RunSpec

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    job = json.loads(Path(job_file).read_text())
    counter = LinkBytes(job["ranks_per_node"])
    hook = register_optimizer_step_post_hook(lambda *_: counter.snapshot())
    with counter:
        r = train(RunSpec.from_dict(job["spec"]))
    hook.remove()
    per_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, counter.as_dict()["steps"])
    if dist.get_rank() == 0:
        Path(out_file).write_text(
            json.dumps({"link_steps": per_rank, "step_seconds": r.step_seconds, "losses": r.losses})
        )
    dist.barrier()  # every rank done with gloo before any tears it down (else: terminate called ...)
    dist.destroy_process_group()


def gpt_modules(d_model: int, n_layer: int) -> list[tuple[list[tuple[int, ...]], int]]:
    """(parameter shapes, gathers per step) of each FSDP module of sdpq.train's GPT, in order:
    the blocks, then the root; sdpq.train shards every module with reshard_after_forward=True,
    which torch 2.13 honours for the root too: each is gathered in forward and again in backward."""
    from sdpq.train.model import GPT, GPTConfig

    model = GPT(GPTConfig(d_model=d_model, n_layer=n_layer))
    in_blocks = {id(p) for p in model.blocks.parameters()}
    blocks = [([tuple(p.shape) for p in b.parameters()], 2) for b in model.blocks]
    root = [tuple(p.shape) for p in model.parameters() if id(p) not in in_blocks]  # tied head: once
    return blocks + [(root, 2)]


def measured_bytes(res: dict) -> dict[str, float]:
    steps = list(zip(*res["link_steps"]))[1:]  # per step, every rank's {path: {link: bytes}}
    return {p: statistics.fmean(sum(r.get(p, {}).get("inter", 0) for r in s) for s in steps) for p in PATHS}


def _run(cluster, nodes: int, rpn: int, spec: dict, work: Path, name: str, timeout: float) -> dict:
    job, out = work / f"{name}.job.json", work / f"{name}.json"
    job.write_text(json.dumps({"spec": spec, "ranks_per_node": rpn}))
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    argv = [str(Path(__file__).resolve()), "--worker", str(job), str(out)]
    if cluster is None:
        code = run_local(
            argv, nodes * rpn, log=work / f"{name}.log", timeout=timeout, env={"PYTHONPATH": env["PYTHONPATH"]}
        )
    else:
        code = run_job(cluster, argv, rpn, timeout=timeout, env=env, logs=work / name)
    if code != 0 or not out.exists():
        raise RuntimeError(f"{name} failed (exit {code}); logs in {work}")
    return json.loads(out.read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bandwidth", default="1gbit")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--layouts", default=",".join(f"{n}x{l}" for n, l in LAYOUTS))
    ap.add_argument("--loopback-only", action="store_true", help="bytes only (no root, no namespaces)")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "emulated_growth.json"))
    args = ap.parse_args(argv)
    from sdpq.config import Config

    modules = gpt_modules(args.d_model, args.n_layer)
    records = []
    with tempfile.TemporaryDirectory(prefix="sdpq-growth-") as tmp:
        for layout in args.layouts.split(","):
            nodes, rpn = (int(v) for v in layout.split("x"))
            for arm, block in (("baseline", None), ("sdpq", QUANT)):
                spec = {
                    "backend": "fsdp2",
                    "model": {"d_model": args.d_model, "n_layer": args.n_layer},
                    "steps": args.steps,
                    "micro_batch": 4,
                    "ranks_per_node": rpn,
                    "log_every": 0,
                    "eval_batches": 0,
                    "sdpq": block,
                }
                name = f"{layout}-{arm}"
                floor = _run(None, nodes, rpn, spec, Path(tmp), name + "-loopback", args.timeout)
                formula = fsdp_cross_node_bytes(
                    modules, nodes * rpn, rpn, None if block is None else Config.from_dict(block)
                )
                rec = {"layout": layout, "arm": arm, "loopback_s": floor["step_seconds"]}
                got = measured_bytes(floor)
                rec.update({f"{p}_bytes": got[p] for p in PATHS}, **{f"{p}_formula": formula[p] for p in PATHS})
                rec["bytes_exact"] = all(got[p] == formula[p] for p in PATHS)
                if not args.loopback_only:
                    with EmulatedNodes(nodes, args.bandwidth) as cluster:
                        mbit = measure_link(cluster, megabytes=32)
                        emu = _run(cluster, nodes, rpn, spec, Path(tmp), name, args.timeout)
                    per_node = sum(formula.values()) / nodes  # bytes each node's link carries out per step
                    rec.update(
                        link_mbit=mbit,
                        measured_s=emu["step_seconds"],
                        predicted_s=floor["step_seconds"] + per_node * 8 / (mbit * 1e6),
                    )
                    rec["error"] = rec["measured_s"] / rec["predicted_s"] - 1
                    rec["emulated_bytes_exact"] = measured_bytes(emu) == {p: formula[p] for p in PATHS}
                records.append(rec)
                print(json.dumps(rec), flush=True)
    print_table(records, f"FSDP2 growth with nodes ({args.bandwidth})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "records": records}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(*sys.argv[2:4])
        sys.exit(0)
    sys.exit(main())
