"""Expert parallelism as torchtitan lays it out, with sdpq, on 4 gloo ranks as 2 nodes x 2.

The mesh is (dp_mod_ep 2, ep 2): an expert-parallel group inside each node ({0, 1}, {2, 3}) and
the ranks holding the same experts across nodes ({0, 2}, {1, 3}). Each MoE block's experts (one
module, the experts' weights stacked) live on their EP rank and are `fully_shard`ed on the
dp_mod_ep mesh with Shard(1) (dim 0 is the local expert count), with the full data-parallel
degree as gradient divide factor; the dense layers and the root are sharded on all 4 ranks.
Tokens reach the experts of the other EP rank by an all-gather and come back by a reduce-scatter
(the same sums as an all-to-all dispatch, in two collectives with autograd).

sdpq builds one topology per shard group: the experts' group has one rank per node (2 x 1), the
dense one 2 x 2. Compared with the same job in plain FSDP2 on the same seed.
"""

import pytest
import torch
from torch import nn

WORLD, RPN, EP = 4, 2, 2
D, H, EXPERTS, VOCAB, SEQ = 64, 128, 4, 256, 32
SDPQ = {"weights": {"mode": "diff"}, "gradients": {"mode": "two_level"}, "optimizer": {"enabled": False}}


@pytest.fixture
def dist(dist):
    dist.discard(WORLD)  # device meshes of an earlier run must not be found again
    return dist


class Experts(nn.Module):
    """This EP rank's experts: SwiGLU-free two-layer MLPs, weights stacked [local experts, ...]."""

    def __init__(self, local: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(local, D, H) * D**-0.5)
        self.w2 = nn.Parameter(torch.randn(local, H, D) * H**-0.5)

    def forward(self, x: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        # x [T, D]; gates [T, local]: the router's weight of each local expert (0 where not chosen).
        h = torch.relu(torch.einsum("td,edh->eth", x, self.w1))
        return torch.einsum("eth,ehd,te->td", h, self.w2, gates)


class _AllGather(torch.autograd.Function):
    """Rows of every member, stacked (backward: the rows' gradients reduce-scattered back)."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        ctx.group = group
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _ReduceScatter.apply(grad, ctx.group), None


class _ReduceScatter(torch.autograd.Function):
    """The sum over members, member r keeping rows block r (backward: the gradient all-gathered)."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        ctx.group = group
        out = x.new_empty((x.shape[0] // dist.get_world_size(group), *x.shape[1:]))
        dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllGather.apply(grad, ctx.group), None


class MoE(nn.Module):
    def __init__(self, ep_group, ep_rank: int):
        super().__init__()
        self.ep_group, self.ep_rank = ep_group, ep_rank
        self.router = nn.Linear(D, EXPERTS, bias=False)
        self.experts = Experts(EXPERTS // EP)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(x).float(), dim=-1)
        top = probs.argmax(dim=-1)
        gates = probs * nn.functional.one_hot(top, EXPERTS)  # top-1 routing
        # Every EP rank sees the group's tokens, runs its own experts on them, and the partial
        # outputs are summed back to the tokens' owners.
        xs = _AllGather.apply(x, self.ep_group)
        gs = _AllGather.apply(gates, self.ep_group)
        local = EXPERTS // EP
        mine = gs[:, self.ep_rank * local : (self.ep_rank + 1) * local].to(x.dtype)
        return _ReduceScatter.apply(self.experts(xs, mine), self.ep_group)


class Block(nn.Module):
    def __init__(self, ep_group, ep_rank: int):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.dense = nn.Linear(D, D)
        self.moe = MoE(ep_group, ep_rank)

    def forward(self, x):
        x = x + self.dense(self.norm(x))
        return x + self.moe(self.norm(x))


class Model(nn.Module):
    def __init__(self, ep_group, ep_rank: int):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block(ep_group, ep_rank) for _ in range(2))
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx, targets):
        x = self.embed(idx).flatten(0, 1)
        for b in self.blocks:
            x = b(x)
        return nn.functional.cross_entropy(self.head(x), targets.flatten())


def _train(ctx, block, steps):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    import sdpq
    from sdpq.train.data import TokenData

    mesh = init_device_mesh("cpu", (WORLD // EP, EP), mesh_dim_names=("dp_mod_ep", "ep"))
    dp = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    ep_rank = mesh["ep"].get_local_rank()
    torch.manual_seed(0)  # dense weights equal on every rank; experts: seeded per EP rank below
    model = Model(mesh["ep"].get_group(), ep_rank)
    with torch.no_grad():
        g = torch.Generator().manual_seed(100 + ep_rank)
        for b in model.blocks:
            for p in b.moe.experts.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5)
    for b in model.blocks:
        fully_shard(b.moe.experts, mesh=mesh["dp_mod_ep"], shard_placement_fn=lambda p: Shard(1))
        b.moe.experts.set_gradient_divide_factor(float(WORLD))  # the experts see every rank's tokens
        b.moe.experts.set_force_sum_reduction_for_comms(True)  # gloo: no PREMUL_SUM
        fully_shard(b, mesh=dp)
    fully_shard(model, mesh=dp)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if block is not None:
        sdpq.fsdp.apply(model, sdpq.Config.from_dict({**block, "topology": {"ranks_per_node": RPN}}), optimizer=opt)
    data, losses = TokenData.stdlib(), []
    for step in range(steps):
        x, y = data.batch(step, ctx.rank, 2, SEQ, seed=0)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / WORLD)
    out = {"losses": losses}
    if block is not None:
        comms = sdpq.fsdp.module_comms(model)
        out["layouts"] = {name: c.topology.layout for name, c in comms.items()}
        out["stats"] = {name: c.stats.as_dict() for name, c in comms.items()}
    return out


def test_moe_expert_parallel_layout_trains_with_sdpq(dist):
    steps = 8
    plain = dist.run(_train, WORLD, RPN, None, steps, timeout=120)
    dist.discard(WORLD)
    quant = dist.run(_train, WORLD, RPN, SDPQ, steps, timeout=120)
    p, q = plain[0]["losses"], quant[0]["losses"]
    assert q[-1] < q[0] and p[-1] < p[0]
    assert abs(sum(q[-4:]) - sum(p[-4:])) / sum(p[-4:]) < 0.01, (q, p)  # within 1% at the end
    layouts = quant[0]["layouts"]
    assert layouts["blocks.0.moe.experts"] == "2x1" and layouts["blocks.0"] == "2x2" and layouts[""] == "2x2"
    stats = quant[0]["stats"]
    experts = [s for name, s in stats.items() if name.endswith("moe.experts")]
    dense = [s for name, s in stats.items() if not name.endswith("moe.experts")]

    def inter(group, path):
        return sum(s.get(path, {}).get("inter", {}).get("bytes", 0) for s in group)

    # Both kinds of traffic cross nodes quantized: 2-bit weight differences, 4-bit gradients (+ a
    # scale per 128 and, at d = 64, the padding that gives each norm and bias shard whole groups).
    for group in (experts, dense):
        assert inter(group, "weights") > 0 and inter(group, "gradients") > 0
        for s in group:
            assert s["gradients"]["inter"]["bits_per_element"] < 6.5
    print(
        f"MoE 2x2 (experts over 2): final loss sdpq {q[-1]:.4f} vs plain {p[-1]:.4f}; cross-node bytes per rank, "
        f"experts: weights {inter(experts, 'weights')}, gradients {inter(experts, 'gradients')}; dense: weights "
        f"{inter(dense, 'weights')}, gradients {inter(dense, 'gradients')}"
    )
