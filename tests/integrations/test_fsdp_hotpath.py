"""No host synchronisation in sdpq's FSDP2 hooks: full training steps on 4 gloo ranks (2 nodes x 2)
with the hot-path guard enabled (`sdpq.comm.hotpath`), so any `.item()`, `bool()`, `float()`,
`.tolist()` or `.cpu()` inside the all-gather, reduce-scatter or all-reduce hooks (or the
collectives they run) raises. On a GPU each of those would stall the CPU until the device caught
up, inside the communication FSDP2 overlaps with compute.

Covered: 1-D FSDP2 and HSDP (sdpq's replicate all-reduce); the default config (statistics on),
one that samples the quantization error on every call, verifies the weight references every
second version and keeps error feedback, and the other modes (direct weights, exact gradients);
a parameter that gets no gradient on some steps (its module's reduce-scatter is then smaller than
the one built in `apply`).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

WORLD, RPN = 4, 2
EXACT_DIRECT = {"weights": {"mode": "direct", "bits": 8}, "gradients": {"mode": "exact"}}
SAMPLED = {"stats": {"error_sample_every": 1}, "weights": {"verify_every": 2}, "gradients": {"error_feedback": True}}


@pytest.fixture
def dist(dist):
    """Fresh workers: the HSDP case builds a device mesh, whose cached sub-meshes must not outlive
    the process groups of an earlier run (see test_fsdp_hsdp.py)."""
    dist.discard(WORLD)
    return dist


class _Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.side = nn.Linear(d, d)  # used on even steps only: no gradient on odd ones

    def forward(self, x: torch.Tensor, use_side: bool) -> torch.Tensor:
        x = x + self.out(torch.nn.functional.gelu(self.fc(self.norm(x))))
        return x + self.side(x) if use_side else x


class _Net(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 64, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(_Block(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor, use_side: bool) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x, use_side)
        return self.head(x)


def _train(ctx, config, hsdp: bool, steps: int, inject: str | None = None, plain: bool = False):
    """Train the small net under sdpq (`config`; plain=True: FSDP2 alone) with the guard on."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import sdpq
    from sdpq.comm import hotpath
    from sdpq.comm.weights import WeightGather

    torch.manual_seed(0)
    model = _Net()
    kw: dict = {}
    replicate = None
    if hsdp:
        mesh = init_device_mesh("cpu", (WORLD // RPN, RPN), mesh_dim_names=("replicate", "shard"))
        kw["mesh"], replicate = mesh["shard"], mesh["replicate"]
    for b in model.blocks:
        fully_shard(b, **kw)
    fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if not plain:
        sdpq.fsdp.apply(model, config, optimizer=opt, replicate=replicate)  # builds every collective
    orig_gather = WeightGather.gather
    if inject == "gather":  # a sync inside the all-gather hook's collective must be caught

        def gather(self, shard, out=None):
            shard.sum().item()
            return orig_gather(self, shard, out)

        WeightGather.gather = gather  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(1 + ctx.rank)
    losses = []
    try:
        with hotpath.guard_enabled():
            for step in range(steps):
                idx = torch.randint(0, 64, (4, 16), generator=g)
                logits = model(idx, use_side=step % 2 == 0)
                loss = nn.functional.cross_entropy(logits.flatten(0, 1), ((idx * 5 + 1) % 64).flatten())  # learnable
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.detach())
    finally:
        WeightGather.gather = orig_gather  # type: ignore[method-assign]
    # Read outside the hot path: summary() is where the sampled errors are read.
    stats = None if plain else sdpq.stats.summary(model)[1]
    shards = [p.to_local().clone() for p in model.parameters()]
    return [float(x) for x in losses], stats, shards


CASES = {
    "fsdp_default": (None, False),
    "fsdp_sampled": (SAMPLED, False),
    "hsdp_default": (None, True),
    "hsdp_sampled": (SAMPLED, True),
    "fsdp_direct_weights_exact_gradients": (EXACT_DIRECT, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_training_steps_run_under_the_hot_path_guard(dist, case):
    config, hsdp = CASES[case]
    steps = 5
    res = dist.run(_train, WORLD, RPN, config, hsdp, steps, timeout=120)
    for losses, stats, _ in res:
        assert len(losses) == steps and all(math.isfinite(x) for x in losses)
        assert losses[-1] < losses[0]
        grads = stats["gradients"]
        link = "inter" if "inter" in grads else "intra"
        # Every module reduce-scattered once per step (3 FSDP modules; HSDP adds its all-reduce).
        assert grads[link]["calls"] >= 3 * steps
        if config is SAMPLED:
            # The sampled errors were accumulated on the device and read by summary() alone.
            assert grads[link]["error_samples"] > 0 and 0 < grads[link]["relative_error_mean"] < 0.5
            if not hsdp:
                w = stats["weights"]["inter"]
                assert w["error_samples"] > 0 and 0 <= w["relative_error_max"] < 0.5


def test_a_step_without_some_gradients_is_exact(dist):
    """The smaller reduce-scatter of a step where a parameter got no gradient, zero-padded into
    the collective apply built: with sdpq's exact modes, bitwise plain FSDP2's, every shard."""
    exact = {"weights": {"mode": "exact"}, "gradients": {"mode": "exact"}}
    plain = dist.run(_train, WORLD, RPN, None, False, 3, None, True, timeout=120)
    ours = dist.run(_train, WORLD, RPN, exact, False, 3, timeout=120)
    for (lp, _, sp), (lo, _, so) in zip(plain, ours):
        assert lp == lo
        assert all(torch.equal(a, b) for a, b in zip(sp, so))


def test_the_guard_covers_the_hooks(dist):
    """A host sync placed inside the all-gather's collective raises on every rank: the hooks run
    inside the guard, so the test above cannot pass for want of coverage."""
    from harness import DistTestError

    sync = r"HostSyncError: Tensor.item\(\) inside sdpq's hot path \(FSDP2 all-gather hook\)"
    with pytest.raises(DistTestError, match=sync):
        dist.run(_train, WORLD, RPN, None, False, 1, "gather", timeout=60)
