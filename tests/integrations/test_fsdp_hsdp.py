"""sdpq on multi-dimensional FSDP2 meshes, 4 gloo ranks as 2 nodes x 2:

- HSDP (replicate across nodes, shard inside a node): 1-D fully_shard on the shard dim and
  sdpq.fsdp.apply(replicate=...), against FSDP2's mesh HSDP (2-D mesh);
- FSDP x TP on a (dp, tp) mesh: tensor-parallel MLPs inside a node, FSDP (with sdpq) across nodes.
"""

import warnings

import pytest
import torch

from sdpq.comm import TopologyError

WORLD, RPN = 4, 2


@pytest.fixture
def dist(dist):
    """Fresh workers for every test here. Note: the harness destroys a run's process groups after
    it, and an equal device mesh built again in the same process then reaches torch's cached
    sub-meshes of the old one, whose groups are gone ("Could not resolve the process group")."""
    dist.discard(WORLD)
    return dist


TINY = dict(n_layer=2, n_head=2, d_model=64, seq_len=32)
EXACT = {"weights": {"mode": "exact"}, "gradients": {"mode": "exact"}, "optimizer": {"enabled": False}}
QUANT = {"weights": {"mode": "diff"}, "gradients": {"mode": "two_level"}, "optimizer": {"enabled": False}}


def _spec(ctx, sdpq, steps, **kw):
    from sdpq.train.model import GPTConfig
    from sdpq.train.run import RunSpec

    base = dict(
        model=GPTConfig(**TINY),
        sdpq=sdpq,
        steps=steps,
        micro_batch=2,
        warmup=2,
        lr=3e-3,
        eval_batches=0,
        log_every=0,
        ranks_per_node=ctx.ranks_per_node,
    )
    return RunSpec(**{**base, **kw})


def _hsdp_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (WORLD // RPN, RPN), mesh_dim_names=("replicate", "shard"))


def _hsdp_runs(ctx, configs, steps, spec_kw):
    """Train under each config: None = FSDP2's mesh HSDP; a block = 1-D FSDP on the shard dim
    + sdpq's replicate all-reduce."""
    from sdpq.train.fsdp_backend import train

    warnings.simplefilter("error", category=RuntimeWarning)
    out = []
    for cfg in configs:
        mesh = _hsdp_mesh()
        kw = {"mesh": mesh} if cfg is None else {"mesh": mesh["shard"], "replicate": mesh["replicate"]}
        r = train(_spec(ctx, cfg, steps, **spec_kw), checks=True, **kw)
        out.append(
            {
                "losses": r.losses,
                "params": r.extra["param_digests"],
                "fwd": r.extra["forward_digests"],
                "comm": r.comm["per_rank"][ctx.rank],
            }
        )
    return out


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_hsdp_replicate_all_reduce(dist, bf16):
    steps = 4
    res = dist.run(_hsdp_runs, WORLD, RPN, [None, EXACT, QUANT], steps, {"bf16": bf16}, timeout=150)
    native, exact, quant = (list(x) for x in zip(*res))  # [run][rank]
    # sdpq's exact all-reduce (SUM, FSDP divides once by 4) equals FSDP2's mesh HSDP's AVG steps bitwise.
    assert exact[0]["losses"] == native[0]["losses"]
    assert [r["params"] for r in exact] == [r["params"] for r in native]
    # Quantized: both replicas' gathered weights are identical at every step (so are their shards:
    # ranks r and r + 2 hold the same shard of different replicas).
    for step in range(steps):
        assert all(quant[r]["fwd"][step] == quant[0]["fwd"][step] for r in range(WORLD)), f"step {step + 1}"
    assert quant[0]["params"] == quant[2]["params"] and quant[1]["params"] == quant[3]["params"]
    q, n = quant[0]["losses"], native[0]["losses"]
    assert all(abs(a - b) / b < 0.03 for a, b in zip(q, n)), (q, n)
    # Cross-node: only the replicate all-reduce, at 4 bits (+ fp32 scales per 128) in both phases,
    # plus the padding that keeps every group inside one parameter (at d_model 64 a norm's or a
    # bias's 32-element shard takes a whole 128-element group: ~0.2 bits per element here).
    grads = quant[0]["comm"]["gradients"]
    assert 4.25 <= grads["inter"]["bits_per_element"] < 4.6
    assert grads["inter"]["calls"] == 3 * steps * 2  # 3 FSDP modules; each all-reduce counts its 2 phases
    assert "inter" not in quant[0]["comm"].get("weights", {})


def test_hsdp_deferred_all_reduce_runs_once_per_step(dist):
    """4 micro-steps, each reduce-scattered inside the node, with FSDP2's usual deferral of the
    cross-node all-reduce (set_requires_all_reduce(False) on the first 3): sdpq all-reduces once
    per optimizer step, the sum of the 4, like FSDP2's own HSDP."""
    steps, kw = 3, {"grad_accum": 4, "accumulation": "defer_all_reduce"}
    res = dist.run(_hsdp_runs, WORLD, RPN, [None, EXACT, QUANT], steps, kw, timeout=150)
    native, exact, quant = (list(x) for x in zip(*res))
    for run in (exact, quant):  # the replicas' forward weights are the same bits every step
        for step in range(steps):
            assert all(r["fwd"][step] == run[0]["fwd"][step] for r in run), step
    n, e, q = native[0]["losses"], exact[0]["losses"], quant[0]["losses"]
    assert all(abs(a - b) / b < 1e-4 for a, b in zip(e, n)), (e, n)
    assert all(abs(a - b) / b < 0.01 for a, b in zip(q, n)), (q, n)
    modules = 3
    e_inter, q_inter = exact[0]["comm"]["gradients"]["inter"], quant[0]["comm"]["gradients"]["inter"]
    # One all-reduce per module and optimizer step (a quantized one records its two phases).
    assert e_inter["calls"] == modules * steps and q_inter["calls"] == 2 * modules * steps
    assert q_inter["bytes"] <= 0.15 * e_inter["bytes"], (q_inter, e_inter)
    print(
        f"HSDP 2x2, 4 micro-steps deferred: cross-node gradient bytes {q_inter['bytes'] / e_inter['bytes']:.3f} of "
        f"the fp32 all-reduce's; final loss {q[-1]:.4f} vs FSDP2's HSDP {n[-1]:.4f}"
    )


def _resume_runs(ctx, tmp, spec_kw):
    from sdpq.train.fsdp_backend import train

    losses = []
    for kw in ({"save_at": 3}, {"resume": True}):
        mesh = _hsdp_mesh()
        spec = _spec(ctx, {**QUANT, "gradients": {"error_feedback": True}}, 6, checkpoint_dir=tmp, **spec_kw, **kw)
        r = train(spec, checks=True, mesh=mesh["shard"], replicate=mesh["replicate"])
        losses.append(r.losses)
    return losses


def test_hsdp_dcp_resume_is_bitwise(dist, tmp_path):
    res = dist.run(_resume_runs, WORLD, RPN, str(tmp_path), {}, timeout=150)
    full, resumed = res[0]
    assert resumed[3:] == full[3:]  # steps 4-6 after resuming from step 3: the same bits


def _refusals(ctx):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import sdpq
    from sdpq.config import ConfigError
    from sdpq.train.model import GPT, GPTConfig

    mesh = _hsdp_mesh()
    flat = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("replicate", "shard"))
    cases = [
        (mesh, mesh["replicate"]),  # FSDP2's 2-D mesh HSDP
        (mesh["shard"], mesh["shard"]),  # the shard group as replicate group
        (flat["shard"], flat["replicate"]),  # shard groups of one rank
        (mesh["shard"], mesh["replicate"] if ctx.rank else None),  # rank 0 disagrees: an error, no hang
    ]
    errors = []
    for shard_mesh, replicate in cases:
        model = GPT(GPTConfig(**TINY))
        fully_shard(model, mesh=shard_mesh)
        try:
            sdpq.fsdp.apply(model, QUANT, replicate=replicate)
            errors.append(None)
        except (ValueError, TopologyError, ConfigError) as e:
            errors.append(str(e))
    return errors


def test_refused_layouts(dist):
    errors = dist.run(_refusals, WORLD, RPN, timeout=60)[1]
    assert "mesh HSDP" in errors[0] and "mesh['shard']" in errors[0]
    assert "must meet in this rank only" in errors[1]
    assert "sharded over one rank" in errors[2]
    assert errors[3] is not None and "replicate" in errors[3]  # every rank raises, none waits


# ----------------------------------------------------------------------------- FSDP x TP


def _fsdp_tp_run(ctx, cfg, steps, hsdp=False):
    """GPT with tensor-parallel MLPs (fc colwise, out rowwise) on the tp dim (inside a node) and
    FSDP on the dp dim (across nodes); every tp peer reads its dp rank's batch. hsdp (8 ranks as
    2 nodes x 4): a (replicate, shard, tp) mesh, FSDP on the shard dim with sdpq's replicate
    all-reduce (plain: FSDP2's mesh HSDP on (replicate, shard))."""
    import hashlib

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import sdpq
    from sdpq.train.data import TokenData
    from sdpq.train.model import GPT, GPTConfig

    world, replicate = ctx.world_size, None
    if hsdp:
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
        dp_mesh = mesh["replicate", "shard"] if cfg is None else mesh["shard"]
        replicate = None if cfg is None else mesh["replicate"]
        dp_rank = mesh["replicate"].get_local_rank() * 2 + mesh["shard"].get_local_rank()
    else:
        mesh = init_device_mesh("cpu", (world // RPN, RPN), mesh_dim_names=("dp", "tp"))
        dp_mesh, dp_rank = mesh["dp"], mesh["dp"].get_local_rank()
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"fc": ColwiseParallel(), "out": RowwiseParallel()})
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if cfg is not None:
        block_cfg = {**cfg, "topology": {"ranks_per_node": ctx.ranks_per_node}}
        sdpq.fsdp.apply(model, block_cfg, optimizer=opt, replicate=replicate)
    data = TokenData.stdlib()
    losses = []
    for step in range(steps):
        x, y = data.batch(step, dp_rank, 2, TINY["seq_len"], seed=0)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        losses.append(avg.item() / world)
    shards = hashlib.sha256(b"".join(p.to_local().detach().numpy().tobytes() for p in model.parameters()))
    stats = sdpq.stats.of(model).as_dict() if cfg is not None else None
    if cfg is not None:
        sdpq.fsdp.remove(model)
    return {"losses": losses, "stats": stats, "shards": shards.hexdigest()}


def test_fsdp_x_tp(dist):
    steps = 5
    plain = dist.run(_fsdp_tp_run, WORLD, RPN, None, steps, timeout=120)
    dist.discard(WORLD)
    quant = dist.run(_fsdp_tp_run, WORLD, RPN, QUANT, steps, timeout=120)
    p, q = plain[0]["losses"], quant[0]["losses"]
    assert q[-1] < q[0]
    assert all(abs(a - b) / b < 0.03 for a, b in zip(q, p)), (q, p)
    # The dp group is one rank per node: sdpq's traffic is all inter-node, per path.
    s = quant[0]["stats"]
    assert set(s["gradients"]) == {"inter"} and set(s["weights"]) == {"inter"}
    assert s["gradients"]["inter"]["bits_per_element"] < 5


def test_hsdp_x_tp(dist):
    """HSDP x TP, 8 ranks as 2 nodes x 4: (replicate, shard, tp) = (2, 2, 2)."""
    steps = 4
    dist.discard(8)
    plain = dist.run(_fsdp_tp_run, 8, 4, None, steps, True, timeout=180)
    dist.discard(8)
    quant = dist.run(_fsdp_tp_run, 8, 4, QUANT, steps, True, timeout=180)
    dist.discard(8)
    p, q = plain[0]["losses"], quant[0]["losses"]
    assert all(abs(a - b) / b < 0.03 for a, b in zip(q, p)), (q, p)
    # Replica 1 (ranks 4-7) holds bitwise the shards of replica 0 (ranks 0-3), TP shards included.
    assert [r["shards"] for r in quant[:4]] == [r["shards"] for r in quant[4:]]
    assert len({r["shards"] for r in quant[:4]}) == 4
    s = quant[0]["stats"]["gradients"]
    # the replicate all-reduce: 4.25 bits + the padding of small shards to whole groups (see above)
    assert 4.25 <= s["inter"]["bits_per_element"] < 4.6
