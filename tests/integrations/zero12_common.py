"""Shared pieces of the DeepSpeed ZeRO-1/2 tests (test_deepspeed_zero12.py, test_deepspeed_zero12_faults.py):
the tiny GPT on 4 gloo ranks as 2 simulated nodes x 2, bf16, gradient accumulation 2, small buckets."""

from __future__ import annotations

import torch
from deepspeed_common import TIMEOUT, TINY, fresh_deepspeed

import sdpq

__all__ = ["ACCUM", "KINDS", "MICRO", "TIMEOUT", "build", "config", "prints", "train"]

ACCUM, MICRO = 2, 4

# ZeRO-1 with fp32 gradient accumulation: DeepSpeed runs its BF16_Optimizer instead
KINDS = {"zero1": (1, False), "zero2": (2, False), "zero1-fp32-accum": (1, True)}


def config(stage: int | str, block: dict | None) -> dict:
    stage, fp32_accum = KINDS[stage] if isinstance(stage, str) else (stage, False)
    ds = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": 1.0,
        # small buckets: several per step, most with pieces of two owners; ZeRO-2 with overlap_comm
        # (DeepSpeed's reduction stream) as the Trainer's stage-2 config has it, ZeRO-1 without
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 20000,
            "allgather_bucket_size": 20000,
            "overlap_comm": stage == 2,
        },
        "bf16": {"enabled": True},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1, "torch_adam": True},
        },
        "steps_per_print": 1 << 30,
    }
    if fp32_accum:
        ds["data_types"] = {"grad_accum_dtype": "fp32"}
    if block is not None:
        ds["sdpq"] = block
    return ds


def build(stage: int | str, block: dict | None, seed: int):
    from sdpq.train.model import GPT

    fresh_deepspeed()
    torch.manual_seed(seed)
    model = GPT(TINY)
    cfg = config(stage, block)
    return sdpq.deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]


def train(ctx, engine, first: int, n: int, seed: int = 0) -> list[float]:
    """Optimizer steps first .. first + n - 1 (ACCUM micro-batches each); their mean losses."""
    from sdpq.train.data import TokenData

    data, losses = TokenData.stdlib(), []
    for step in range(first, first + n):
        total = 0.0
        for micro in range(ACCUM):
            x, y = data.batch(step * ACCUM + micro, ctx.rank, MICRO, TINY.seq_len, seed=seed)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += float(loss) / ACCUM
        t = torch.tensor([total])
        torch.distributed.all_reduce(t)
        losses.append(float(t) / ctx.world_size)
    return losses


def prints(engine) -> list:
    from sdpq.comm.reference_health import checksum

    opt = engine.optimizer
    flat = opt.bf16_groups_flat if type(opt).__name__ == "BF16_Optimizer" else opt.bit16_groups_flat
    return [checksum(f).tolist() for f in flat]
