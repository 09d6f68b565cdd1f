"""DeepSpeed ZeRO-1 and ZeRO-2 with the "sdpq" block against the same config without it: bf16,
4 gloo ranks as 2 nodes x 2, gradient accumulation 2, three seeds, the Llama-shaped model of the
long-run study (sdpq.train.llama), DeepSpeed's own loop (engine.backward / engine.step).

Arms (same data and initialisation per seed):
  plain   the config without the block (DeepSpeed's AdamW, bf16 all-reduce / reduce of the
          gradient buckets, bf16 all-gather of the updated partitions)
  sdpq    the default block: 4-bit weight differences, two-level 8/4-bit gradients, FP8 AdamW
  sdpq3   weights.bits 3, gradients.inter_bits 3
  sdpq2   weights.bits 2, gradients.inter_bits 2
  sdpq-ef the default block with gradients.error_feedback

Stages: 1, 2, and 1-fp32 (ZeRO-1 with data_types.grad_accum_dtype fp32, where DeepSpeed runs its
BF16_Optimizer).

Cross-node bytes come from the independent process-group meter (sdpq/comm/link_bytes.py),
during the training steps only. After every step each rank's flat bf16 weights are checksummed;
the result says whether the replicas were bitwise equal at every step. live_bytes: the tensors
alive on rank 0 after training (the engine, its optimizer and sdpq's state).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/deepspeed_zero12.py     # ~30 min on 2 cores
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # ranks share the cores

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import convergence_long as cl  # noqa: E402
from benchmarks import seed_study  # noqa: E402
from sdpq.launch.local import run_local  # noqa: E402

WORLD, RPN, ACCUM = 4, 2, 2
TAG = "[deepspeed_zero12]"
ARMS = {
    "plain": None,
    "sdpq": {"weights": {"mode": "diff"}},
    "sdpq3": {"weights": {"bits": 3}, "gradients": {"inter_bits": 3}},
    "sdpq2": {"weights": {"bits": 2}, "gradients": {"inter_bits": 2}},
    "sdpq-ef": {"weights": {"mode": "diff"}, "gradients": {"error_feedback": True}},
}


def ds_config(args, stage: str, block: dict | None) -> dict:
    ds = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": int(stage.split("-")[0])},
        "bf16": {"enabled": True},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "torch_adam": True},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"warmup_max_lr": args.lr, "warmup_num_steps": args.warmup, "total_num_steps": args.steps},
        },
        "steps_per_print": 1 << 30,
    }
    if stage.endswith("-fp32"):
        ds["data_types"] = {"grad_accum_dtype": "fp32"}
    if block is not None:  # the simulated nodes: torchrun says 4 ranks on one machine
        ds["sdpq"] = {**block, "topology": {"ranks_per_node": RPN}}
    return ds


def run_arm(args, stage: str, arm: str, seed: int) -> dict:
    import gc

    import torch
    import torch.distributed as dist

    import sdpq
    from benchmarks.zeropp.groups import reset_deepspeed_groups
    from sdpq.comm.link_bytes import LinkBytes, sum_over_ranks
    from sdpq.comm.weights_replicated import replicas_agree
    from sdpq.memory import live_tensor_bytes
    from sdpq.train.data import TokenData
    from sdpq.train.llama import Llama, LlamaConfig

    reset_deepspeed_groups()
    torch.manual_seed(seed)
    cfg = LlamaConfig(seq_len=args.seq_len, n_layer=args.layers, n_head=args.heads, d_model=args.d_model)
    model = Llama(cfg)
    engine, *_ = sdpq.deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config(args, stage, ARMS[arm])
    )
    opt = engine.optimizer
    flats = opt.bf16_groups_flat if type(opt).__name__ == "BF16_Optimizer" else opt.bit16_groups_flat
    data, rank = TokenData.stdlib(), dist.get_rank()
    losses, equal, t0 = [], True, time.time()
    counter = LinkBytes(RPN)
    with counter:
        for step in range(args.steps):
            counter.enabled = True
            total = 0.0
            for micro in range(ACCUM):
                x, y = data.batch(step * ACCUM + micro, rank, args.micro_batch, args.seq_len, seed=seed)
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                total += float(loss) / ACCUM
            counter.enabled = False
            t = torch.tensor([total])
            dist.all_reduce(t)
            losses.append(float(t) / WORLD)
            equal &= all(replicas_agree(f, None) for f in flats)
    seconds = time.time() - t0
    per_rank: list = [None] * WORLD
    dist.all_gather_object(per_rank, counter.as_dict())
    link = sum_over_ranks(per_rank)
    inter = sum(links.get("inter", {}).get("bytes", 0) for links in link["total"].values())
    gc.collect()
    live = live_tensor_bytes()
    engine.destroy()
    return {
        "losses": losses,
        "meter_cross_node_bytes_per_step": inter / args.steps,
        "replicas_equal_every_step": equal,
        "live_bytes_rank0": live,
        "seconds": seconds,
    }


def worker(job_file: str, out_file: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    job = json.loads(Path(job_file).read_text())
    args = argparse.Namespace(**job["args"])
    dist.init_process_group("gloo")
    out: dict = {}
    for stage in job["stages"]:
        out[str(stage)] = {arm: run_arm(args, stage, arm, job["seed"]) for arm in job["arms"]}
    if dist.get_rank() == 0:
        Path(out_file).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def run_seed(args, seed: int, stages: list[str], arms: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="sdpq-zero12-") as tmp:
        job, out, log = Path(tmp) / "job.json", Path(tmp) / "out.json", Path(tmp) / "run.log"
        shown = {k: v for k, v in vars(args).items() if k not in ("worker",)}
        job.write_text(json.dumps({"args": shown, "seed": seed, "stages": stages, "arms": arms}))
        code = run_local(
            [str(Path(__file__).resolve()), "--worker", str(job), str(out)], WORLD, log=log, timeout=args.timeout
        )
        if code != 0 or not out.exists():
            raise RuntimeError(f"seed {seed} failed (exit code {code}):\n{log.read_text()[-4000:]}")
        return json.loads(out.read_text())


def summarize(runs: dict) -> dict:
    """Per stage and arm: final loss (mean of the last 50 steps) over seeds, the paired difference
    to plain's, bytes per step and their ratio to plain's, replicas, live bytes."""
    seeds = sorted(runs)
    out: dict = {}
    for stage in runs[seeds[0]]:
        base = [runs[s][stage]["plain"] for s in seeds]
        out[stage] = {}
        for arm in runs[seeds[0]][stage]:
            r = [runs[s][stage][arm] for s in seeds]
            out[stage][arm] = {
                **seed_study.against_baseline(r, base),
                "live_bytes_rank0": statistics.mean(x["live_bytes_rank0"] for x in r),
                "seconds_per_step": statistics.mean(x["seconds"] for x in r) / len(r[0]["losses"]),
            }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    seed_study.add_arguments(ap, steps=200, arms=ARMS, out="deepspeed_zero12.json")
    ap.add_argument("--stages", default="1,2")
    args = ap.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    arms = [a for a in args.arms.split(",") if a]
    stages = [s for s in args.stages.split(",") if s]
    if set(stages) - {"1", "2", "1-fp32"}:
        ap.error(f"--stages: {args.stages!r}; allowed: 1, 2, 1-fp32 (comma-separated)")
    runs, t0 = {}, time.time()
    for seed in (int(s) for s in args.seeds.split(",")):
        t = time.time()
        runs[seed] = run_seed(args, seed, stages, arms)
        for stage, arms_out in runs[seed].items():
            line = ", ".join(f"{a} {cl.final_loss(r['losses']):.4f}" for a, r in arms_out.items())
            print(f"{TAG} seed {seed} ZeRO-{stage}: final loss {line} ({time.time() - t:.0f} s)", flush=True)
    summary = summarize(runs)
    seed_study.write(args, t0, summary, runs)
    for stage, arms_out in summary.items():
        for arm, s in arms_out.items():
            mb, sd = s["bytes_per_step"] / 1e6, s["diff_in_baseline_sd"]
            print(
                f"ZeRO-{stage} {arm:>6}: bytes {s['bytes_ratio']:.3f} of plain ({mb:.3f} MB/step), final loss "
                f"{s['final_loss_mean']:.4f} (sd {s['final_loss_sd']:.4f}, {sd:+.2f} sd of plain's), replicas "
                f"bitwise equal every step: {s['replicas_equal_every_step']}, live {s['live_bytes_rank0'] / 1e6:.2f} MB"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
