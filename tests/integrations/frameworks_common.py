"""Shared pieces of the framework tests (Hugging Face Trainer, Accelerate, Lightning): a tiny
GPT-2 built from a config (no downloads), a byte-level dataset, the DeepSpeed config file a user
would have, and an independent byte meter (sdpq/comm/link_bytes.py wraps ProcessGroup)."""

from __future__ import annotations

import json
import os

SEQ = 32
STEPS = 20  # enough for the 1% loss check and the bytes ratio (the suite runs these on 2 cores)
TAIL = 10  # the final loss: the mean of the last TAIL steps
MICRO = 8
LR = 3e-3
# Every section at its defaults: 2-bit weight differences, two-level 8/4-bit gradients, FP8 + MCF AdamW.
# Note: no "auto" values in the block: the Trainer and Accelerate try to fill every "auto" of the
# file and fail on keys they do not know. ranks_per_node defaults to what the launcher says.
BLOCK = {"weights": {"mode": "diff"}}


def write_ds_config(
    path: str, block: dict | None, *, hf_auto: bool = False, lightning: bool = False, stage: int = 3
) -> str:
    """The ZeRO bf16 config a user already has (stage 3 unless told; HF-style "auto" values for
    the Trainer; concrete ones otherwise, without the two keys Lightning owns), plus the "sdpq"
    block when given."""
    auto = "auto" if hf_auto else None
    ds = {
        "train_micro_batch_size_per_gpu": auto or MICRO,
        "gradient_accumulation_steps": auto or 1,
        "gradient_clipping": auto or 1.0,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1000}
        if stage == 3
        else {"stage": stage, "overlap_comm": True, "contiguous_gradients": True},
        "bf16": {"enabled": auto or True},
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": auto or LR,
                "betas": auto or [0.9, 0.95],
                "eps": auto or 1e-8,
                "weight_decay": auto or 0.0,
                # as ds_configs/ on CPU: torch's AdamW, not DeepSpeed's fused Adam (a ~60 s C++ build)
                "torch_adam": True,
            },
        },
    }
    if hf_auto:
        ds["train_batch_size"] = "auto"  # the Trainer brings its own warm-up + linear decay
    else:  # a decaying schedule, so that the last steps' losses compare without lr noise
        ds["scheduler"] = {
            "type": "WarmupDecayLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 4, "total_num_steps": STEPS},
        }
    if lightning:  # Lightning sets these from its Trainer's arguments and refuses them in the file
        del ds["gradient_accumulation_steps"], ds["gradient_clipping"]
    if block is not None:
        ds["sdpq"] = block
    with open(path, "w") as f:
        json.dump(ds, f)
    return path


def warmup_decay(opt):
    """A warm-up and decay like the DeepSpeed files' WarmupDecayLR (linear to LR in 4 steps, then
    linearly to 0 at STEPS) for runs whose script builds the optimizer, so that their last steps'
    losses compare without the noise of a constant learning rate."""
    import torch

    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / 4, max(0.0, (STEPS - s) / (STEPS - 4))))


def tiny_gpt2():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(
            n_layer=2,
            n_embd=128,
            n_head=2,
            n_positions=SEQ,
            vocab_size=256,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    )


def samples(n: int) -> list[dict]:
    """n byte-level sequences of the stdlib corpus: {"input_ids", "labels"} (the model shifts)."""
    from sdpq.train.data import TokenData

    data = TokenData.stdlib()
    out = []
    for i in range(n):
        x, _ = data.batch(i, 0, 1, SEQ)
        out.append({"input_ids": x[0].long(), "labels": x[0].long()})
    return out


def meter(ranks_per_node: int):
    from sdpq.comm.link_bytes import LinkBytes

    return LinkBytes(ranks_per_node)


def cross_node_bytes(m) -> int:
    """This rank's bytes sent across the simulated node boundary, every path."""
    return sum(v["inter"]["bytes"] for v in m.as_dict()["total"].values() if "inter" in v)


def ranks_env(ctx) -> None:
    """A rank ready for a framework run in a reused worker: what a launcher sets and the
    frameworks read (the harness already set RANK & co.), DeepSpeed's cached groups forgotten and
    its logging quiet, and a fresh Accelerate state (its singletons outlive one run)."""
    import logging

    from benchmarks.zeropp.groups import reset_deepspeed_groups

    reset_deepspeed_groups()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    from deepspeed_common import skip_shm_op_build

    skip_shm_op_build()  # Accelerate and the Trainer start DeepSpeed's communication themselves
    try:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
    except ImportError:
        pass
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    os.environ["LOCAL_WORLD_SIZE"] = str(ctx.ranks_per_node)


# Cross-node bytes the default block may send, as a share of the run without it, by the least-
# traffic count (sdpq/comm/traffic.py). ZeRO-3 on this tiny model keeps its gathered weights from
# the forward to the backward: its baseline moves one 16-bit gather and a 16-bit reduce-scatter
# (32 bits a parameter), sdpq a 2-bit difference and 4-bit gradients plus their scales and the
# padding that keeps groups inside the tiny parameters (measured 0.27-0.30 with the earlier 4-bit
# differences). FSDP2 gathers twice
# and reduces in fp32 (64 bits; measured 0.13-0.22, by how the recipe wraps the embeddings).
MAX_RATIO = {"zero3": 0.35, "fsdp2": 0.25}


def run_both_arms(
    dist, fn, out_dir: str, name: str, timeout: float, known_loss_defect: str | None = None, stack: str = "zero3"
) -> tuple[list, list]:
    """`fn(ctx, out_dir, with_block)` on 4 ranks as 2 x 2 without and with the block (fresh
    processes each); checks the must-haves: sdpq attached only with the block, cross-node bytes
    at most MAX_RATIO[stack] of the run without it, loss (mean of the last TAIL steps) at most 1% above it.
    known_loss_defect: a loss above 1% marks the test xfail with that reason (the bytes and the
    attachment are still asserted); a loss within 1% passes. Returns both runs' per-rank results."""
    plain = dist.run(fn, 4, 2, out_dir, False, timeout=timeout)
    dist.discard(4)
    ours = dist.run(fn, 4, 2, out_dir, True, timeout=timeout)
    assert all(r["sdpq"] for r in ours) and not any(r["sdpq"] for r in plain)
    ratio = sum(r["cross"] for r in ours) / sum(r["cross"] for r in plain)
    p, q = plain[0]["losses"], ours[0]["losses"]
    final = (sum(q[-TAIL:]) / TAIL) / (sum(p[-TAIL:]) / TAIL)
    print(f"{name}: cross-node bytes ratio {ratio:.3f}, final loss ratio {final:.4f} ({p[-1]:.4f} vs {q[-1]:.4f})")
    assert ratio <= MAX_RATIO[stack], ratio
    if known_loss_defect and final >= 1.01:
        import pytest

        pytest.xfail(f"final loss ratio {final:.4f} >= 1.01: {known_loss_defect}")
    assert final < 1.01, (p, q)
    return plain, ours


def preload(*modules: str) -> None:
    """Import the frameworks in the test process, before the worker pools fork from it, so that
    the ranks of every run (fresh processes per arm) do not each import them again (~10-20 s
    per run on 2 cores)."""
    import importlib

    for m in ("torch.distributed.fsdp", "transformers.models.gpt2.modeling_gpt2", *modules):
        importlib.import_module(m)
