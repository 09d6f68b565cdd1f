"""The job the DDP fault tests run (test_ddp_faults.py): the tiny GPT wrapped in
DistributedDataParallel with sdpq's comm hook, on 4 gloo ranks as 2 nodes x 2, checkpoints as
docs/ddp.md shows: the model and optimizer in the user's file (written by rank 0: the replicas are
equal), sdpq's state by `sdpq.ddp.save_checkpoint` / `load_checkpoint` (one file per rank)."""

from __future__ import annotations

import os

import numpy.random  # noqa: F401  (see the Note below)
import torch
import torch.distributed as tdist
from faults_common import warm_up_before_fork
from torch.nn.parallel import DistributedDataParallel

import sdpq
import sdpq.integrations.ddp  # noqa: F401  (see the Note below)
from sdpq.comm.reference_health import checksum
from sdpq.train.data import TokenData
from sdpq.train.model import GPT, GPTConfig

# Note (CI time): what every rank would import or load at its first step, done once here, before
# the harness forks the ranks from this process (faults_common.warm_up_before_fork).
warm_up_before_fork()

WORLD, RPN = 4, 2
TINY = GPTConfig(n_layer=1, d_model=64, n_head=2, seq_len=32)
MICRO = 2
# Every piece of state a load restores is live: rounding streams (stochastic gradient rounding),
# error-feedback residuals, the iteration count (the first iteration is exact, DDP's).
BLOCK = {"gradients": {"error_feedback": True, "rounding": "stochastic"}, "optimizer": {"enabled": False}}
OTHER_BLOCK = {"gradients": {"error_feedback": False}, "optimizer": {"enabled": False}}
TRAIN_FILE = "train.pt"  # the user's: model and optimizer


def build(block: dict, seed: int):
    torch.manual_seed(seed)
    model = DistributedDataParallel(GPT(TINY))
    sdpq.ddp.apply(model, block)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train(ctx, model, opt, first: int, n: int) -> None:
    data = TokenData.stdlib()
    for step in range(first, first + n):
        x, y = data.batch(step, ctx.rank, MICRO, TINY.seq_len)
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def replica(model) -> list:
    """The checksum of every parameter: the same on every rank exactly when the replicas are equal."""
    return [checksum(p.detach()).tolist() for p in model.parameters()]


def save(model, opt, path: str) -> None:
    """docs/ddp.md's save: sdpq's state first (every rank's file or none), then the user's file."""
    sdpq.ddp.save_checkpoint(model, path)
    if tdist.get_rank() == 0:
        torch.save({"model": model.module.state_dict(), "optim": opt.state_dict()}, os.path.join(path, TRAIN_FILE))
    tdist.barrier()


def load(model, opt, path: str, train_file: str | None = None) -> None:
    """docs/ddp.md's resume (`train_file`: another file of the user's, on this rank)."""
    state = torch.load(train_file or os.path.join(path, TRAIN_FILE), weights_only=True)
    model.module.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    sdpq.ddp.load_checkpoint(model, path)
