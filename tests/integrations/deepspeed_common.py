"""Shared pieces of the DeepSpeed ZeRO-3 tests: a tiny GPT trained on 4 gloo ranks as 2 simulated
nodes x 2, a few steps per run (the 200-step convergence runs are benchmarks/deepspeed_convergence.py)."""

from __future__ import annotations

import dataclasses
import warnings

import torch

import sdpq.integrations.deepspeed as sds
from benchmarks.zeropp.groups import reset_deepspeed_groups
from sdpq.train.model import GPTConfig
from sdpq.train.run import RunSpec

TIMEOUT = 180
TINY = GPTConfig(n_layer=2, d_model=64, n_head=4, seq_len=32)
# Parameters under 1000 elements (biases, norms) stay gathered (ZeRO-3 "persistent", gathered
# once per step after the optimizer), larger ones are gathered per module in forward/backward:
# both gather paths are exercised.
ZERO = {"zero_optimization": {"stage3_param_persistence_threshold": 1000}}
SPEC = RunSpec(
    backend="deepspeed",
    model=TINY,
    steps=4,
    micro_batch=2,
    grad_accum=2,
    lr=3e-3,
    warmup=2,
    eval_batches=1,
    log_every=0,
    ranks_per_node=2,
)
EXACT = {"weights": {"mode": "exact"}, "gradients": {"mode": "exact"}, "optimizer": {"enabled": False}}
# A non-empty block; every section left out takes its defaults: the full method (two-level
# gradients, FP8 + MCF AdamW). An empty block would be plain DeepSpeed.
FULL_BLOCK = {"weights": {"mode": "diff"}, "workarounds": {"deepspeed_alias_bf16_master": True}}


def skip_shm_op_build() -> None:
    """DeepSpeed's first communication start JIT-builds a shared-memory op (~40 s on 2 cores)
    that only inference all-reduce uses: skipped, as sdpq.deepspeed.initialize skips it, for
    the runs that start DeepSpeed without the block (plain arms, Accelerate, the Trainer)."""
    import importlib

    # Note: the attribute `deepspeed.comm.torch` is PyTorch itself; the module needs importlib.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def fresh_deepspeed() -> None:
    """DeepSpeed caches process groups in module globals; the harness destroys the previous run's
    groups, so forget them (a real job has one engine per process)."""
    reset_deepspeed_groups()
    skip_shm_op_build()
    import logging

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)


def train_fn(ctx, spec, overrides=None):
    """One training run on this rank (`deepspeed_backend.train` with checks); picklable results."""
    from sdpq.train import deepspeed_backend

    fresh_deepspeed()
    r = deepspeed_backend.train(spec, checks=True, ds_overrides=overrides if overrides is not None else ZERO)
    return {
        "losses": r.losses,
        "val": r.val_loss,
        "extra": {k: v for k, v in r.extra.items() if k != "step_times"},
        "comm": r.comm["per_rank"][ctx.rank],
        "cross": r.cross_node_bytes_per_step,
        "opt_bytes": r.optimizer_bytes_per_param,
    }


def run4(dist, spec, overrides=None):
    """`train_fn` on 4 ranks as 2 x 2."""
    return dist.run(train_fn, 4, 2, spec, overrides, timeout=TIMEOUT)


def build_engine(block, *, threshold=1000, bf16=False, lr=3e-3, zero=None):
    """A ZeRO-3 engine of the tiny GPT with `block` (no training loop); `zero`: more
    "zero_optimization" keys (e.g. offload_param)."""
    from sdpq.train import deepspeed_backend
    from sdpq.train.model import GPT

    torch.manual_seed(0)
    model = GPT(TINY)
    spec = dataclasses.replace(SPEC, sdpq=block, bf16=bf16, lr=lr, grad_accum=1)
    zero = {"stage3_param_persistence_threshold": threshold, **(zero or {})}
    cfg = deepspeed_backend.ds_config(spec, {"zero_optimization": zero})
    return sds.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]


def train_steps(engine, rank: int, n: int, start: int = 0) -> list[float]:
    """`n` training steps of `engine` on this rank's batches of the stdlib text (losses read on the
    host after each step, outside sdpq's hooks)."""
    from sdpq.train.data import TokenData

    data, losses = TokenData.stdlib(), []
    for s in range(start, start + n):
        x, y = data.batch(s, rank, 2, TINY.seq_len)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses
