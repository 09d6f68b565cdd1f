"""A gradient row that is zero on every rank stays exactly zero through sdpq's quantized
collectives (Hadamard on), under FSDP2, HSDP and ZeRO-3.

The model is shaped like today's LLMs: a norm weight without bias registered before an untied
input embedding (its shards shift everything after it off the 128-element Hadamard grid), a
Linear with a bias, an untied head; widths 192 and 320 (not multiples of 128). Every rank's
batch uses even token ids below 100 only, so every other embedding row gets no gradient: with
plain FSDP2 / ZeRO-3 those rows are exactly zero, and Adam would turn any noise in them into a
full-size update of an absent token's embedding.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

VOCAB = 1000
USED = torch.arange(0, 100, 2)  # the token ids the batches use


class Tiny(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d, bias=False)  # 1-D, first in the bucket
        self.emb = nn.Embedding(VOCAB, d)
        self.proj = nn.Linear(d, d)
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, ids):
        return self.head(torch.relu(self.proj(self.norm(self.emb(ids)))))


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    ids = USED[torch.randint(len(USED), (4, 16), generator=g)]
    return ids, torch.roll(ids, 1, dims=1)


def _loss(model, rank):
    x, y = _batch(rank)
    return nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def _absent_rows_nonzero(grad_rows: torch.Tensor, first_row: int) -> tuple[int, int]:
    """(absent rows with a non-zero gradient, absent rows) among rows first_row.. of the embedding."""
    rows = torch.arange(first_row, first_row + grad_rows.shape[0])
    absent = ~torch.isin(rows, USED) & (rows < VOCAB)
    return int((grad_rows[absent] != 0).any(dim=1).sum()), int(absent.sum())


def _fsdp(ctx, d: int, block: dict, hsdp: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import sdpq.fsdp

    torch.manual_seed(0)
    model = Tiny(d)
    kw = {}
    if hsdp:
        mesh = init_device_mesh("cpu", (ctx.nodes, ctx.ranks_per_node), mesh_dim_names=("replicate", "shard"))
        fully_shard(model, mesh=mesh["shard"])
        kw["replicate"] = mesh["replicate"]
    else:
        fully_shard(model)
    if block is not None:
        sdpq.fsdp.apply(model, block, **kw)
    _loss(model, ctx.rank).backward()
    shard = model.emb.weight.grad.to_local()
    per = -(-VOCAB // (ctx.ranks_per_node if hsdp else ctx.world_size))
    first = (ctx.local_rank if hsdp else ctx.rank) * per
    return _absent_rows_nonzero(shard, first)


FSDP_LAYOUTS = [(2, 2), (4, 1), (1, 4), (3, 2)]


@pytest.mark.parametrize("d", [192, 320])
@pytest.mark.parametrize("nodes,rpn", FSDP_LAYOUTS, ids=[f"{n}x{l}" for n, l in FSDP_LAYOUTS])
def test_fsdp2_absent_embedding_rows_stay_zero(dist, nodes, rpn, d):
    if (nodes, rpn, d) == (2, 2, 192):  # once: what plain FSDP2 gives (the property asserted below)
        plain = dist.run(_fsdp, nodes * rpn, rpn, d, None, False, timeout=120)
        assert sum(n for n, _ in plain) == 0 and sum(a for _, a in plain) > 0
    ours = dist.run(_fsdp, nodes * rpn, rpn, d, {}, False, timeout=120)  # the default block
    assert [n for n, _ in ours] == [0] * (nodes * rpn)


@pytest.mark.parametrize("nodes,rpn", [(2, 2), (3, 2)], ids=["2x2", "3x2"])
def test_hsdp_absent_embedding_rows_stay_zero(dist, nodes, rpn):
    dist.discard(nodes * rpn)  # a fresh device mesh (see test_fsdp_hsdp.py)
    ours = dist.run(_fsdp, nodes * rpn, rpn, 192, {}, True, timeout=120)
    assert [n for n, _ in ours] == [0] * (nodes * rpn)
    dist.discard(nodes * rpn)


def _zero3(ctx, d: int, block: dict):
    import deepspeed
    from deepspeed.utils import safe_get_local_grad
    from deepspeed_common import fresh_deepspeed

    import sdpq.deepspeed

    fresh_deepspeed()
    torch.manual_seed(0)
    model = Tiny(d)
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},  # no fused-Adam build on CPU
    }
    init = deepspeed.initialize if block is None else sdpq.deepspeed.initialize
    config = {**cfg, "sdpq": block} if block else cfg
    engine = init(model=model, model_parameters=model.parameters(), config=config)[0]
    x, y = _batch(ctx.rank)
    loss = nn.functional.cross_entropy(engine(x).flatten(0, 1).float(), y.flatten())
    engine.backward(loss)
    part = safe_get_local_grad(model.emb.weight).reshape(-1)
    start = ctx.rank * part.numel()  # this rank's partition of the flat parameter
    lo = -(-start // d) * d  # the whole rows inside it
    n_rows = (start + part.numel() - lo) // d
    rows = part[lo - start : lo - start + n_rows * d].view(n_rows, d)
    return _absent_rows_nonzero(rows, lo // d)


@pytest.mark.parametrize("nodes,rpn", [(2, 2), (3, 2)], ids=["2x2", "3x2"])
def test_zero3_absent_embedding_rows_stay_zero(dist, nodes, rpn):
    pytest.importorskip("deepspeed")
    if nodes == 2:  # once: what plain ZeRO-3 gives
        plain = dist.run(_zero3, nodes * rpn, rpn, 320, None, timeout=180)
        assert sum(n for n, _ in plain) == 0 and sum(a for _, a in plain) > 0
    ours = dist.run(
        _zero3, nodes * rpn, rpn, 320, {"weights": {"mode": "diff"}, "optimizer": {"enabled": False}}, timeout=180
    )
    assert [n for n, _ in ours] == [0] * (nodes * rpn)
