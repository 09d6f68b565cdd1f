"""Checkpoints of sdpq.optim.AdamW: bitwise resume, moving in and out of torch AdamW, format
conversion, and DeepSpeed ZeRO-3 style flat partitions swapped into param_groups."""

import copy
import io

import pytest
import torch
from optim_problems import mlp, set_grads

from sdpq.optim import AdamW
from sdpq.optim import states as S

MODES = [
    dict(states="fp8", master="mcf"),
    dict(states="fp8", master="native", v_format="e5m2"),
    dict(states="bf16", master="mcf", mcf_second_moment=True),
    dict(states="fp32", master="native"),
]


def _params(prob, kw):
    dtype = torch.bfloat16 if kw["master"] == "mcf" else torch.float32
    return [t.to(dtype).requires_grad_() for t in prob.init]


def _run(prob, params, opt, steps):
    out = []
    for t in range(steps):
        for g in opt.param_groups:  # a schedule: resumed runs must get the same lr too
            g["lr"] = 1e-2 * (1 - 0.01 * t)
        set_grads(prob, params)
        opt.step()
        out.append([p.detach().clone() for p in params])
    return out


@pytest.mark.parametrize("kw", MODES, ids=lambda kw: "-".join(str(v) for v in kw.values()))
def test_resume_is_bitwise_identical(kw):
    prob = mlp(n=256)
    params = _params(prob, kw)
    opt = AdamW(params, lr=1e-2, **kw)
    _run(prob, params, opt, 10)
    buf = io.BytesIO()
    torch.save({"model": [p.detach() for p in params], "optim": opt.state_dict()}, buf)
    straight = _run(prob, params, opt, 20)
    buf.seek(0)
    ckpt = torch.load(buf)
    params2 = [t.clone().requires_grad_() for t in ckpt["model"]]
    opt2 = AdamW(params2, lr=123.0, **kw)  # lr comes back from the checkpoint
    opt2.load_state_dict(ckpt["optim"])
    resumed = _run(prob, params2, opt2, 20)
    for a, b in zip(straight, resumed):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    for p, q in zip(params, params2):
        for k, v in opt.state[p].items():
            assert torch.equal(v, opt2.state[q][k]), k


def test_export_to_torch_adamw_and_back():
    prob = mlp(n=256)
    params = [t.float().requires_grad_() for t in prob.init]
    opt = AdamW(params, lr=1e-2, weight_decay=0.05, states="fp8", master="native")
    _run(prob, params, opt, 10)
    exported = opt.export_state_dict()
    assert set(exported["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert exported["state"][0]["exp_avg"].dtype == torch.float32
    # leave sdpq: torch AdamW continues from the exported state like sdpq's fp32 reference would
    twin = [p.detach().clone().requires_grad_() for p in params]
    topt = torch.optim.AdamW(twin, lr=1.0)
    topt.load_state_dict(copy.deepcopy(exported))
    assert topt.param_groups[0]["weight_decay"] == 0.05 and topt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    ref = [p.detach().clone().requires_grad_() for p in params]
    ropt = AdamW(ref, lr=1.0, states="fp32", master="native")
    ropt.load_state_dict(copy.deepcopy(exported))
    for _ in range(5):
        set_grads(prob, twin), set_grads(prob, ref)
        topt.step(), ropt.step()
    for a, b in zip(twin, ref):
        assert torch.equal(a, b)
    # come back: a torch AdamW state loads into the FP8 optimizer (converted on load)
    back = [p.detach().clone().requires_grad_() for p in twin]
    opt3 = AdamW(back, lr=1.0, states="fp8", master="native")
    opt3.load_state_dict(topt.state_dict())
    for p, q in zip(twin, back):
        for name in ("exp_avg", "exp_avg_sq"):
            x, y = topt.state[p][name], S.decode(opt3.state[q], name)
            nz = x != 0
            assert ((y[nz] - x[nz]).abs() / x[nz].abs()).max() < 0.25
        assert float(opt3.state[q]["step"]) == float(topt.state[p]["step"])


def test_load_converts_between_formats():
    prob = mlp(n=256)
    params = [t.to(torch.bfloat16).requires_grad_() for t in prob.init]
    opt = AdamW(params, lr=1e-2, states="fp8", master="mcf", v_format="e5m2", group_size=64)
    _run(prob, params, opt, 5)
    sd = opt.state_dict()
    for kw in (dict(states="bf16", mcf_second_moment=True), dict(states="fp8", group_size=128), dict(states="fp32")):
        opt2 = AdamW([p.detach().clone().requires_grad_() for p in params], master="mcf", **kw)
        opt2.load_state_dict(sd)
        for p, q in zip(params, opt2.param_groups[0]["params"]):
            for name, f8 in (("exp_avg", "e4m3"), ("exp_avg_sq", "e5m2")):
                x = S.decode(opt.state[p], name, f8, 64)
                y = S.decode(opt2.state[q], name, opt2.param_groups[0]["v_format"], opt2.param_groups[0]["group_size"])
                torch.testing.assert_close(y, x, rtol=0.15, atol=0)
            assert torch.equal(opt2.state[q]["master_lo"], opt.state[p]["master_lo"])
    with pytest.raises(ValueError, match="amsgrad=True"):
        t = torch.optim.AdamW([torch.zeros(3, requires_grad=True)], amsgrad=True)
        AdamW([torch.zeros(3, requires_grad=True)], master="native").load_state_dict(t.state_dict())


class _ZeRO3Like:
    """DeepSpeed ZeRO-3's pattern: flat partitions exist all the time, but each one is put
    into param_groups only around the step() that updates it (several sub-groups per group)."""

    def __init__(self, opt, partitions):
        self.opt, self.partitions = opt, partitions
        self._clear()

    def _clear(self):
        for g in self.opt.param_groups:
            g["params"] = []

    def step(self, grads):
        for part, g in zip(self.partitions, grads):
            part.grad = g
            self.opt.param_groups[0]["params"] = [part]
            self.opt.step()
            self.opt.param_groups[0]["params"] = []
            part.grad = None

    def state_dict(self):  # _rigid_state_dict: all partitions in, state_dict, out again
        self.opt.param_groups[0]["params"] = list(self.partitions)
        sd = copy.deepcopy(self.opt.state_dict())
        self._clear()
        return sd

    def load_state_dict(self, sd):
        self.opt.param_groups[0]["params"] = list(self.partitions)
        self.opt.load_state_dict(sd)
        self._clear()


@pytest.mark.parametrize("kw", [dict(states="fp8", master="mcf"), dict(states="fp8", master="native")])
def test_zero3_flat_partitions_swapped_into_param_groups(kw):
    dtype = torch.bfloat16 if kw["master"] == "mcf" else torch.float32
    g = torch.Generator().manual_seed(0)
    sizes = (1000, 1000, 777)  # two sub-groups of equal size share group 0 and position 0
    parts = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    steady = [p.clone() for p in parts]
    zero = _ZeRO3Like(AdamW([p for p in parts], lr=1e-2, **kw), parts)
    ref = AdamW(steady, lr=1e-2, **kw)  # the same tensors permanently in param_groups
    for _ in range(6):
        grads = [torch.randn(n, generator=g).to(dtype) for n in sizes]
        zero.step(grads)
        for p, gr in zip(steady, grads):
            p.grad = gr
        ref.step()
    for a, b in zip(parts, steady):
        assert torch.equal(a, b)
    sd = zero.state_dict()
    assert sorted(sd["state"]) == [0, 1, 2] and sd["param_groups"][0]["params"] == [0, 1, 2]
    fresh = [p.clone() for p in parts]
    zero2 = _ZeRO3Like(AdamW(list(fresh), lr=1e-2, **kw), fresh)
    zero2.load_state_dict(sd)
    grads = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    zero.step(grads), zero2.step(grads)
    for a, b in zip(parts, fresh):
        assert torch.equal(a, b)
    # a partition that changed size (a different flat tensor behind the same object) is refused
    parts[0].data = torch.zeros(10, dtype=dtype)
    with pytest.raises(ValueError, match="1000 elements but the parameter now has 10"):
        zero.step([torch.zeros(10, dtype=dtype)] + grads[1:])


def test_state_keys_may_be_fqns_as_torch_distributed_checkpoint_passes_them():
    prob = mlp(n=64)
    params = [t.float().requires_grad_() for t in prob.init]
    opt = AdamW(params, lr=1e-2, states="fp8", master="native")
    _run(prob, params, opt, 3)
    sd = opt.state_dict()
    names = ["w1", "b1", "w2", "b2"]  # set_optimizer_state_dict keys the state by parameter FQN
    by_fqn = {
        "state": {names[i]: v for i, v in sd["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]],
    }
    opt2 = AdamW([p.detach().clone().requires_grad_() for p in params], states="fp8", master="native")
    opt2.load_state_dict(copy.deepcopy(by_fqn))
    for p, q in zip(params, opt2.param_groups[0]["params"]):
        assert all(torch.equal(v, opt2.state[q][k]) for k, v in opt.state[p].items())
