"""DistributedDataParallel with sdpq's comm hook against DDP's own all-reduce and torch's hooks:
the Llama-shaped model of the long-run study on fp32 parameters with bf16 autocast (so DDP
all-reduces fp32 gradients), 4 gloo ranks as 2 nodes x 2, three seeds, the framework's AdamW in
every arm (only the gradient exchange differs).

Arms (same data and initialisation per seed):
  ddp       DDP's averaging all-reduce in fp32 (torch's allreduce_hook: what DDP does without a
            hook, through the Python-level collective the meter sees)
  fp16      torch's fp16_compress_hook (bf16_compress_hook needs NCCL)
  powersgd  torch's PowerSGD, rank 4, error feedback, plain all-reduce for the first 2 iterations
  sdpq      sdpq.ddp with the default gradient settings (8-bit inside the node, 4-bit across)

Cross-node bytes come from the independent process-group meter (sdpq/comm/link_bytes.py),
during the training steps only. Every arm records a digest of every rank's parameters after
every step; the result says whether the replicas were bitwise equal at every step.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ddp_seeds.py        # ~40 min on 2 cores
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # ranks share the cores

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import convergence_long as cl  # noqa: E402
from benchmarks import seed_study  # noqa: E402
from sdpq.launch.local import run_local  # noqa: E402

WORLD, RPN = 4, 2
TAG = "[ddp_seeds]"
SDPQ = {"gradients": {}, "optimizer": {"enabled": False}}  # the default gradient path; torch's AdamW
ARMS = {"ddp": ("allreduce", None), "fp16": ("fp16", None), "powersgd": ("powersgd", None), "sdpq": (None, SDPQ)}


def spec_for(args, arm: str, seed: int):
    from sdpq.train.llama import LlamaConfig
    from sdpq.train.run import RunSpec

    return RunSpec(
        backend="ddp",
        model=LlamaConfig(seq_len=args.seq_len, n_layer=args.layers, n_head=args.heads, d_model=args.d_model),
        sdpq=ARMS[arm][1],
        mixed_precision="bf16",
        steps=args.steps,
        micro_batch=args.micro_batch,
        lr=args.lr,
        warmup=args.warmup,
        seed=seed,
        ranks_per_node=RPN,
        log_every=0,
        eval_batches=args.eval_batches,
    )


def run_arm(spec, hook: str | None) -> dict:
    import torch.distributed as dist

    from sdpq.comm.link_bytes import LinkBytes, sum_over_ranks
    from sdpq.train import ddp_backend

    with LinkBytes(RPN) as counter, cl.step_window(counter, ddp_backend):
        r = ddp_backend.train(spec, checks=True, comm_hook=hook)
    per_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, counter.as_dict())
    digests: list = [None] * dist.get_world_size()
    dist.all_gather_object(digests, r.extra["param_digests"])
    link = sum_over_ranks(per_rank)
    inter = sum(links.get("inter", {}).get("bytes", 0) for links in link["total"].values())
    return {
        "losses": r.losses,
        "val_loss": r.val_loss,
        "step_seconds": r.step_seconds,
        "meter_cross_node_bytes_per_step": inter / spec.steps,
        "replicas_equal_every_step": all(d == digests[0] for d in digests),
    }


def worker(job_file: str, out_file: str) -> None:
    import torch
    import torch.distributed as dist

    from sdpq.train.run import RunSpec

    torch.set_num_threads(1)
    job = json.loads(Path(job_file).read_text())
    dist.init_process_group("gloo")
    out = {}
    for arm in job["arms"]:
        out[arm] = run_arm(RunSpec.from_dict(job["specs"][arm]), ARMS[arm][0])
    if dist.get_rank() == 0:
        Path(out_file).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def run_seed(args, seed: int, arms: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="sdpq-ddp-") as tmp:
        job, out, log = Path(tmp) / "job.json", Path(tmp) / "out.json", Path(tmp) / "run.log"
        specs = {arm: dataclasses.asdict(spec_for(args, arm, seed)) for arm in arms}
        job.write_text(json.dumps({"arms": arms, "specs": specs}))
        code = run_local(
            [str(Path(__file__).resolve()), "--worker", str(job), str(out)], WORLD, log=log, timeout=args.timeout
        )
        if code != 0 or not out.exists():
            raise RuntimeError(f"seed {seed} failed (exit code {code}):\n{log.read_text()[-4000:]}")
        return json.loads(out.read_text())


def summarize(runs: dict) -> dict:
    """Per arm: final loss (mean of the last 50 steps) mean and sd over seeds, the paired
    difference to DDP's, bytes per step and their ratio to DDP's fp32 all-reduce."""
    seeds = sorted(runs)
    return {
        arm: seed_study.against_baseline([runs[s][arm] for s in seeds], [runs[s]["ddp"] for s in seeds])
        for arm in runs[seeds[0]]
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    seed_study.add_arguments(ap, steps=300, arms=ARMS, out="ddp_seeds.json")
    args = ap.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    arms = [a for a in args.arms.split(",") if a]
    runs, t0 = {}, time.time()
    for seed in (int(s) for s in args.seeds.split(",")):
        t = time.time()
        runs[seed] = run_seed(args, seed, arms)
        line = ", ".join(f"{a} {cl.final_loss(r['losses']):.4f}" for a, r in runs[seed].items())
        print(f"{TAG} seed {seed}: final loss {line} ({time.time() - t:.0f} s)", flush=True)
    summary = summarize(runs)
    seed_study.write(args, t0, summary, runs)
    for arm, s in summary.items():
        mb = s["bytes_per_step"] / 1e6
        print(
            f"{arm:>9}: bytes {s['bytes_ratio']:.3f} of DDP's fp32 all-reduce ({mb:.3f} MB/step), final loss "
            f"{s['final_loss_mean']:.4f} (sd {s['final_loss_sd']:.4f}, {s['diff_in_baseline_sd']:+.2f} sd of DDP's), "
            f"replicas bitwise equal every step: {s['replicas_equal_every_step']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
