"""``python -m sdpq.train``: train the small GPT (or ``--model llama``) under any launcher, with FSDP2 or DeepSpeed.

    torchrun --nproc-per-node 4 -m sdpq.train --backend fsdp2 --config ds_configs/zero3_sdpq.json
    deepspeed --hostfile launchers/hostfile -m sdpq.train --backend deepspeed ...
    mpirun -np 4 python -m sdpq.train ...      srun python -m sdpq.train ...

``--config`` takes a DeepSpeed JSON config (the deepspeed backend runs it as written; no "sdpq"
block = baseline) or a file holding just the sdpq block; flags given override it setting by
setting (sdpq/train/settings.py). Rank 0 prints each override, progress, and the result as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from .model import MODELS
from .run import RunResult, RunSpec
from .settings import layout, resolve

__all__ = ["add_arguments", "spec_from_args", "main"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag of python -m sdpq.train, in named groups."""
    for add in (_job, _schedule, _precision, _model, _data, _output):
        add(p)


def _job(p: argparse.ArgumentParser) -> None:
    """Which framework runs and from which DeepSpeed config file."""
    p.add_argument("--backend", choices=["fsdp2", "deepspeed", "ddp"], default="fsdp2")
    p.add_argument(
        "--config",
        default=None,
        help="a DeepSpeed JSON config (run as written by the deepspeed backend; fsdp2 and ddp take its 'sdpq' block, "
        "optimizer params, bf16 and gradient_clipping), or a bare sdpq block. A flag given here overrides the "
        "file for that setting only, and says so at start-up",
    )


def _schedule(p: argparse.ArgumentParser) -> None:
    """Steps, batch and optimizer settings (None: the --config file's, see settings.py)."""
    p.add_argument("--steps", type=int, default=200)
    # Settings a --config file may hold default to None: given = overrides the file (settings.py).
    p.add_argument(
        "--micro-batch", type=int, default=None, help="sequences per rank per micro-step (default: the file's, else 4)"
    )
    p.add_argument(
        "--grad-accum", type=int, default=None, help="micro-steps per optimizer step (default: the file's, else 1)"
    )
    p.add_argument(
        "--lr", type=float, default=None, help="peak learning rate (default: the file's optimizer.params.lr, else 1e-3)"
    )
    p.add_argument(
        "--weight-decay", type=float, default=None, help="AdamW weight decay (default: the file's, else 0.1)"
    )
    p.add_argument(
        "--grad-clip",
        type=float,
        default=None,
        help="gradient clipping norm, 0 = none (default: the file's gradient_clipping, else 1.0)",
    )
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)


def _precision(p: argparse.ArgumentParser) -> None:
    """Parameter and compute precision."""
    p.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bf16 parameters and compute (DeepSpeed: bf16.enabled); --no-bf16 turns a file's bf16 off",
    )
    p.add_argument(
        "--mixed-precision",
        choices=["bf16", "none"],
        default=None,
        help="bf16 compute on full-precision parameters: FSDP2 MixedPrecisionPolicy(param_dtype=bf16, "
        "reduce_dtype=fp32), DeepSpeed bf16 mode (fp32 master); none = fp32 compute",
    )


def _model(p: argparse.ArgumentParser) -> None:
    """The model and its shape."""
    p.add_argument(
        "--model",
        choices=list(MODELS),
        default="gpt",
        help="gpt: the small GPT (learned positions, LayerNorm, GELU MLP, tied embeddings); llama: Llama-shaped "
        "(RMSNorm, rotary positions, SwiGLU MLP, no biases, untied head; sdpq/train/llama.py)",
    )
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument(
        "--n-kv-head",
        type=int,
        default=None,
        help="--model llama: key/value heads, a divisor of --n-head (grouped-query attention; default: --n-head)",
    )
    p.add_argument("--seq-len", type=int, default=128)


def _data(p: argparse.ArgumentParser) -> None:
    """The corpus and the simulated node layout."""
    p.add_argument(
        "--data", default=None, help="directory of text files or Megatron .bin/.idx prefix (default: stdlib source)"
    )
    p.add_argument(
        "--ranks-per-node",
        default=None,
        help="an integer (simulates nodes on one machine), or 'auto': the file's sdpq.topology.ranks_per_node, "
        "else the launcher's LOCAL_WORLD_SIZE; an integer contradicting the file's integer is an error",
    )


def _output(p: argparse.ArgumentParser) -> None:
    """Checkpoints, logging, evaluation and what the run records."""
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
    p.add_argument(
        "--count-bytes",
        choices=["exact", "meter", "off"],
        default="exact",
        help="without an sdpq block: 'exact' counts cross-node bytes with sdpq's exact collectives (bitwise the "
        "framework's own); 'off' runs the framework alone and records 'not counted'; 'meter' (deepspeed "
        "backend, with or without a block): a meter on every process-group collective (plain ZeRO-1/2)",
    )
    # The deepspeed launcher appends --local_rank=N; the environment (LOCAL_RANK) says the same.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)


def spec_from_args(args: argparse.Namespace) -> RunSpec:
    """The RunSpec the arguments (and the --config file they name) resolve to (settings.resolve)."""
    return resolve(args).spec


def train(spec: RunSpec) -> RunResult:
    """Dispatch to the backend (each module imports its framework only when chosen)."""
    if spec.backend == "fsdp2":
        from . import fsdp_backend

        return fsdp_backend.train(spec)
    if spec.backend == "ddp":
        from . import ddp_backend

        return ddp_backend.train(spec)
    from . import deepspeed_backend

    return deepspeed_backend.train(spec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sdpq.train", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    from ..launch.env import discover, init_distributed

    discover()  # the launcher's variables first: ranks_per_node "auto" reads them
    resolved = resolve(args)  # bad flags or files fail here, before any rank waits for another
    spec = resolved.spec
    job = init_distributed()
    if job.rank == 0:
        for line in resolved.lines():
            print(f"[sdpq.train] {line}", flush=True)
        print(
            f"[sdpq.train] launcher={job.launcher} world={job.world_size} local={job.local_world_size} "
            f"backend={spec.backend} model={spec.model.kind} sdpq={'on' if spec.sdpq is not None else 'off'} "
            f"layout={layout(job.world_size, int(spec.ranks_per_node))} "
            f"(ranks per node: {resolved.ranks_per_node_from})",
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
            overrides = [{"line": line, **asdict(o)} for line, o in zip(resolved.lines(), resolved.overrides)]
            record = {"spec": asdict(spec), **asdict(result), "overrides": overrides}
            Path(args.out).write_text(json.dumps(record, indent=1, default=str))
    import torch.distributed as dist

    # Note: every rank must be done with the group before any destroys it; a rank that tears
    # gloo down while a peer still talks to it aborts ("terminate called ...").
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
