"""``python -m sdpq.train``: train the small GPT under any launcher, with FSDP2 or DeepSpeed.

    torchrun --nproc-per-node 4 -m sdpq.train --backend fsdp2 --config ds_configs/zero3_sdpq.json
    deepspeed --hostfile launchers/hostfile -m sdpq.train --backend deepspeed ...
    mpirun -np 4 python -m sdpq.train ...      srun python -m sdpq.train ...

``--config`` takes a DeepSpeed JSON config (its "sdpq" block is used; no block = baseline) or a
file holding just the sdpq block. Rank 0 prints progress and writes the result as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from .model import GPTConfig
from .run import RunResult, RunSpec

__all__ = ["add_arguments", "spec_from_args", "main"]


def _sdpq_block(path: str | None) -> dict | None:
    if path is None:
        return None
    with open(path) as f:
        cfg = json.load(f)
    from ..config import Config

    if "sdpq" in cfg or "zero_optimization" in cfg or "train_batch_size" in cfg:
        block = Config.from_deepspeed(cfg)  # validates; None when the DeepSpeed config has no block
        return None if block is None else cfg["sdpq"]
    Config.from_dict(cfg)  # a bare sdpq block: validate it now, with key paths in the error
    return cfg or None  # empty = baseline, as an empty "sdpq" block in a DeepSpeed config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=["fsdp2", "deepspeed"], default="fsdp2")
    p.add_argument("--config", default=None, help="DeepSpeed JSON with an 'sdpq' block, or a bare sdpq block")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16", action="store_true", help="bf16 parameters and compute")
    p.add_argument(
        "--mixed-precision",
        choices=["bf16"],
        default=None,
        help="bf16 compute on full-precision parameters: FSDP2 MixedPrecisionPolicy(param_dtype=bf16, "
        "reduce_dtype=fp32), DeepSpeed bf16 mode (fp32 master)",
    )
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument(
        "--data", default=None, help="directory of text files or Megatron .bin/.idx prefix (default: stdlib source)"
    )
    p.add_argument("--ranks-per-node", default="auto", help="'auto' (launcher's LOCAL_WORLD_SIZE) or an integer")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--save-at", type=int, default=None, help="save a checkpoint after this step")
    p.add_argument("--resume", action="store_true", help="resume from --checkpoint-dir")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-batches", type=int, default=8, help="validation batches per rank at the end (0 = none)")
    p.add_argument("--out", default=None, help="write the result (JSON) here (rank 0)")
    p.add_argument(
        "--timing",
        action="store_true",
        help="record per-step time spans (compute, codec, communication, optimizer) in the result",
    )
    # The deepspeed launcher appends --local_rank=N; the environment (LOCAL_RANK) says the same.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)


def spec_from_args(args: argparse.Namespace) -> RunSpec:
    rpn = args.ranks_per_node if args.ranks_per_node == "auto" else int(args.ranks_per_node)
    return RunSpec(
        backend=args.backend,
        model=GPTConfig(seq_len=args.seq_len, n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model),
        sdpq=_sdpq_block(args.config),
        steps=args.steps,
        micro_batch=args.micro_batch,
        grad_accum=args.grad_accum,
        lr=args.lr,
        warmup=args.warmup,
        bf16=args.bf16,
        mixed_precision=args.mixed_precision,
        seed=args.seed,
        data=args.data,
        ranks_per_node=rpn,
        checkpoint_dir=args.checkpoint_dir,
        save_at=args.save_at,
        resume=args.resume,
        log_every=args.log_every,
        eval_batches=args.eval_batches,
        timing=args.timing,
    )


def train(spec: RunSpec) -> RunResult:
    """Dispatch to the backend (each module imports its framework only when chosen)."""
    if spec.backend == "fsdp2":
        from . import fsdp_backend

        return fsdp_backend.train(spec)
    from . import deepspeed_backend

    return deepspeed_backend.train(spec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sdpq.train", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    spec = spec_from_args(args)
    from ..launch.env import init_distributed

    job = init_distributed()
    if job.rank == 0:
        print(
            f"[sdpq.train] launcher={job.launcher} world={job.world_size} local={job.local_world_size} "
            f"backend={spec.backend} sdpq={'on' if spec.sdpq is not None else 'off'}",
            flush=True,
        )
    result = train(spec)
    if job.rank == 0:
        summary = {k: v for k, v in asdict(result).items() if k != "losses"}
        summary["final_loss"] = result.losses[-1] if result.losses else None
        if "timing" in summary["extra"]:  # per-rank, per-step spans: in --out only
            summary["extra"] = {k: v for k, v in summary["extra"].items() if k != "timing"}
        print(json.dumps(summary, default=str), flush=True)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({"spec": asdict(spec), **asdict(result)}, indent=1, default=str))
    import torch.distributed as dist

    # Note: every rank must be done with the group before any destroys it; a rank that tears
    # gloo down while a peer still talks to it aborts ("terminate called ...").
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
