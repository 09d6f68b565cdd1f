"""sdpq.optim.AdamW under FSDP2 on 4 gloo ranks: same result as one process, DTensor states
with the parameter's placements, and a DCP checkpoint resharded from 4 ranks to 2."""

import pytest
import torch

from sdpq.optim import AdamW, compress
from sdpq.optim import states as S

STEPS = 4
MODES = {
    "fp8_native": dict(states="fp8", master="native"),
    "fp8_mcf": dict(states="fp8", master="mcf"),
    "fp32_native": dict(states="fp32", master="native"),
}


def _model(dtype):
    torch.manual_seed(0)  # same initial weights on every rank and in the single process
    # [64, 16] has whole rows per rank; [64] is 1-D (fp32 state fallback); [1, 48] leaves 3 of 4
    # ranks with an empty shard
    m = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 48), torch.nn.Tanh(), torch.nn.Linear(48, 1)
    )
    return m.to(dtype)


def _data(rank, world):
    g = torch.Generator().manual_seed(1)
    X, Y = torch.randn(64, 16, generator=g), torch.randn(64, 1, generator=g)
    n = 64 // world
    return X[rank * n : (rank + 1) * n], Y[rank * n : (rank + 1) * n]


def _train(model, opt, rank, world, dtype):
    X, Y = _data(rank, world)
    for _ in range(STEPS):
        loss = ((model(X.to(dtype)).float() - Y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def _full_states(opt, model):
    """Decoded full m, v per parameter from the DTensor state_dict (collectives on all ranks)."""
    sd = opt.state_dict()
    group = opt.param_groups[0]
    out = []
    for idx, _ in enumerate(model.parameters()):
        entry = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in sd["state"][idx].items()}
        out.append(
            [
                S.decode(entry, n, f8, group["group_size"])
                for n, f8 in (("exp_avg", "e4m3"), ("exp_avg_sq", group["v_format"]))
            ]
        )
    return out


def _sharded_run(ctx, mode, ckpt_dir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    kw = MODES[mode]
    dtype = torch.bfloat16 if kw["master"] == "mcf" else torch.float32
    model = _model(dtype)
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = AdamW(model.parameters(), lr=1e-2, **kw)
    layouts = {}
    if ckpt_dir is None or ctx.world_size == 4:
        _train(model, opt, ctx.rank, ctx.world_size, dtype)
        sd = opt.state_dict()
        for idx, p in enumerate(model.parameters()):
            v = sd["state"][idx]
            key = "exp_avg_codes" if "exp_avg_codes" in v else "exp_avg"
            assert isinstance(v[key], DTensor) and v[key].placements == p.placements and v[key].shape == p.shape
            layouts[tuple(p.shape)] = key
            if key == "exp_avg_codes":  # metadata: the parameter's rows x groups, same placements
                assert v["exp_avg_scale"].shape == p.shape[:-1] + (-(-p.shape[-1] // 128),)
                assert v["exp_avg_scale"].placements == p.placements
        if ckpt_dir is not None:
            dcp.save({"optim": sd}, checkpoint_id=ckpt_dir)
    else:  # load the 4-rank checkpoint on 2 ranks: DCP reshards codes and metadata row-wise
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.param_groups[0]["lr"] = 0.0
        opt.step()  # creates the states (the template DCP loads into)
        template = {"optim": opt.state_dict()}
        dcp.load(template, checkpoint_id=ckpt_dir)
        opt.load_state_dict(template["optim"])
    params = [p.full_tensor() for p in model.parameters()]
    return params, _full_states(opt, model), layouts


def _single_run(mode):
    kw = MODES[mode]
    dtype = torch.bfloat16 if kw["master"] == "mcf" else torch.float32
    model = _model(dtype)
    opt = AdamW(model.parameters(), lr=1e-2, **kw)
    _train(model, opt, 0, 1, dtype)
    return [p.detach() for p in model.parameters()], _full_states(opt, model)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_fsdp2_four_ranks_match_one_process(dist, mode):
    results = dist.run(_sharded_run, 4, 2, mode, None, timeout=120)
    params, states, layouts = results[0]
    assert layouts[(64, 16)] == ("exp_avg" if mode == "fp32_native" else "exp_avg_codes")
    assert layouts[(64,)] == "exp_avg"  # 1-D sharded: its groups would depend on the shards
    ref_params, ref_states = _single_run(mode)
    for r in results[1:]:  # every rank gathered the same full tensors
        assert all(torch.equal(a, b) for a, b in zip(r[0], params))
    init = [p.detach().float() for p in _model(ref_params[0].dtype).parameters()]
    for a, b, w0 in zip(params, ref_params, init):  # only the batch split / reduction order differ
        if mode == "fp32_native":
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        else:  # FP8 codes and bf16 roundings can flip: compare with how far the weights moved
            assert (a.float() - b.float()).norm() < 0.1 * (b.float() - w0).norm()
    for (_, v), (_, rv) in zip(states, ref_states):
        if mode == "fp32_native":
            torch.testing.assert_close(v, rv, rtol=1e-4, atol=1e-9)
        else:  # an FP8 code may land one step away; the bulk agrees
            assert ((v - rv).abs() <= 0.3 * rv.abs() + 1e-9).float().mean() > 0.98


def test_dcp_checkpoint_reshards_from_four_ranks_to_two(dist, tmp_path):
    path = str(tmp_path / "ckpt")
    four = dist.run(_sharded_run, 4, 2, "fp8_mcf", path, timeout=120)
    two = dist.run(_sharded_run, 2, 2, "fp8_mcf", path, timeout=120)
    for (m4, v4), (m2, v2) in zip(four[0][1], two[0][1]):
        assert torch.equal(m4, m2) and torch.equal(v4, v2)  # decoded states bitwise equal


def _wrapped_run(ctx):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model(torch.float32)
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    fully_shard(model, mesh=mesh)
    opt = compress(torch.optim.Adam(model.parameters(), lr=1e-2), states="fp8")
    _train(model, opt, ctx.rank, ctx.world_size, torch.float32)
    sd = opt.state_dict()
    p0 = next(model.parameters())
    return type(sd["state"][0]["exp_avg_codes"]).__name__, sd["state"][0]["exp_avg_codes"].placements == p0.placements


def test_wrapper_under_fsdp2(dist):
    for name, same in dist.run(_wrapped_run, 4, 2, timeout=120):
        assert name == "DTensor" and same
