"""The job the FSDP2 and HSDP fault tests run (test_fsdp_faults.py): the tiny GPT on 4 gloo ranks
as 2 nodes x 2, sharded with fully_shard (1-D over the world, or HSDP: sharded inside a node,
replicated across nodes through `sdpq.fsdp.apply(replicate=...)`), and sdpq's state saved and
loaded with torch.distributed.checkpoint exactly as docs/fsdp.md shows."""

from __future__ import annotations

import numpy.random  # noqa: F401  (see the Note below)
import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint._fsspec_filesystem  # noqa: F401  (see the Note below)
from faults_common import warm_up_before_fork
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import sdpq
import sdpq.integrations.fsdp  # noqa: F401  (see the Note below)
from sdpq.train.data import TokenData
from sdpq.train.model import GPT, GPTConfig

# Note (CI time): what every rank would import or load at its first step (DCP's file system, sdpq's
# FSDP adapter, numpy's generators for the batches, faults_common.warm_up_before_fork), done once
# here, before the harness forks the ranks from this process.
warm_up_before_fork()

WORLD, RPN = 4, 2
TINY = GPTConfig(n_layer=1, d_model=64, n_head=2, seq_len=32)
MICRO = 2
# Every piece of state a load restores is live: weight references (1-D FSDP across nodes), their
# rounding streams (stochastic weight rounding), error-feedback residuals (both).
BLOCK = {
    "weights": {"mode": "diff", "rounding": "stochastic"},
    "gradients": {"error_feedback": True},
    "optimizer": {"enabled": False},
}
# Another configuration whose state has other keys (no rounding streams, no residuals)
OTHER_BLOCK = {"weights": {"mode": "diff"}, "gradients": {"error_feedback": False}, "optimizer": {"enabled": False}}


def data_file(rank: int) -> str:
    """DCP's file of `rank`'s items (its shards and its sdpq state) in a checkpoint directory."""
    return f"__{rank}_0.distcp"


def hsdp_mesh():
    return init_device_mesh("cpu", (WORLD // RPN, RPN), mesh_dim_names=("replicate", "shard"))


def build(mesh, block: dict, seed: int):
    """(model, optimizer): 1-D FSDP2 if mesh is None, else HSDP on `mesh` (replicate, shard)."""
    torch.manual_seed(seed)
    model = GPT(TINY)
    kw = {} if mesh is None else {"mesh": mesh["shard"]}
    for block_ in model.blocks:
        fully_shard(block_, **kw)
    fully_shard(model, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sdpq.fsdp.apply(model, block, optimizer=opt, replicate=None if mesh is None else mesh["replicate"])
    return model, opt


def train(ctx, model, opt, first: int, n: int) -> list[float]:
    data = TokenData.stdlib()
    losses = []
    for step in range(first, first + n):
        x, y = data.batch(step, ctx.rank, MICRO, TINY.seq_len)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses


def probe(model) -> float:
    """The loss of one batch, the same on every rank: bitwise equal on every rank exactly when every
    rank computes with the same weights (every node's reference, every replica's shards)."""
    x, y = TokenData.stdlib().batch(10_000, 0, MICRO, TINY.seq_len)
    with torch.no_grad():
        return float(model(x, y))


def states(model, opt, checkpoint_id=None) -> dict:
    """docs/fsdp.md's `states()`."""
    return {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, opt),
        "sdpq": sdpq.fsdp.state_dict(model, checkpoint_id=checkpoint_id),
    }


def save(model, opt, path: str) -> None:
    dcp.save(states(model, opt), checkpoint_id=path)


def load(model, opt, path: str) -> None:
    """docs/fsdp.md's resume."""
    sd = states(model, opt, checkpoint_id=path)
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    sdpq.fsdp.load_state_dict(model, sd["sdpq"])


def barrier() -> None:
    tdist.barrier()
