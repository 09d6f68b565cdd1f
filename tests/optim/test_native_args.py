"""The C++ step's arguments kept per parameter (sdpq/optim/native_args.py): built once, rebuilt
whenever what they view changes, so the kernel never steps a tensor the optimizer let go of."""

import copy

import pytest
import torch

from sdpq.kernels import adamw_ops
from sdpq.optim import AdamW, states
from sdpq.optim.native_args import NativeArgs

if not adamw_ops.cpu_available():
    pytest.skip("the C++ AdamW kernel could not be built (see the CppBuildWarning)", allow_module_level=True)


def _params(n=3, shape=(4, 256)):
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen).to(torch.bfloat16)) for _ in range(n)]


def _grads(params, step):
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def _run(opt, params, steps, first=0):
    for s in range(first, first + steps):
        _grads(params, s)
        opt.step()


def test_arguments_are_built_once_per_parameter(monkeypatch):
    builds = []
    build = NativeArgs.build
    monkeypatch.setattr(NativeArgs, "build", staticmethod(lambda *a: builds.append(1) or build(*a)))
    params = _params()
    _run(AdamW(params, lr=1e-2), params, 4)
    assert len(builds) == len(params)


def test_a_new_parameter_storage_is_the_one_stepped():
    """`p.data = ...` between steps: the step goes to the new storage, the old one stays as it
    was, and the values equal those of a run without the swap."""
    a, b = _params(), _params()
    opt_a, opt_b = AdamW(a, lr=1e-2), AdamW(b, lr=1e-2)
    _run(opt_a, a, 2)
    _run(opt_b, b, 2)
    old = a[1].data
    kept = old.clone()
    a[1].data = old.clone()
    _run(opt_a, a, 2, first=2)
    _run(opt_b, b, 2, first=2)
    assert torch.equal(old, kept)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_re_encoded_state_is_the_one_stepped():
    """A state stored anew (another format, new tensors) is read and written by the next step:
    the same values as an optimizer that never stepped with the old tensors."""
    a, b = _params(), _params()
    opt_a, opt_b = AdamW(a, lr=1e-2), AdamW(b, lr=1e-2)
    _run(opt_a, a, 2)
    _run(opt_b, b, 2)
    for opt, ps in ((opt_a, a), (opt_b, b)):
        st = opt.state[ps[0]]
        states.encode(st, "exp_avg_sq", "fp32", states.decode(st, "exp_avg_sq"))
    opt_b.__dict__.pop("_native_cache")  # b rebuilds everything; a must notice by itself
    _run(opt_a, a, 2, first=2)
    _run(opt_b, b, 2, first=2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert torch.equal(opt_a.state[a[0]]["exp_avg_sq"], opt_b.state[b[0]]["exp_avg_sq"])


def test_loading_a_checkpoint_into_the_same_optimizer_resumes_exactly():
    """The optimizer that saved the checkpoint steps on, then loads it back (its cached views
    point at the states it had): the resumed steps repeat the first ones bit for bit."""
    params = _params()
    opt = AdamW(params, lr=1e-2)
    _run(opt, params, 3)
    saved = copy.deepcopy(opt.state_dict())
    weights = [p.detach().clone() for p in params]
    _run(opt, params, 2, first=3)
    first = [p.detach().clone() for p in params]
    for p, w in zip(params, weights):
        p.data.copy_(w)
    opt.load_state_dict(saved)
    _run(opt, params, 2, first=3)
    assert all(torch.equal(p, f) for p, f in zip(params, first))


def test_parameters_that_leave_the_state_leave_no_arguments_behind():
    params = _params()
    opt = AdamW(params, lr=1e-2)
    _run(opt, params, 1)
    gone = params.pop()
    del opt.state[gone]
    opt.param_groups[0]["params"] = params
    extra = _params(n=1, shape=(2, 128))
    opt.add_param_group({"params": extra})
    _run(opt, params + extra, 1, first=1)
    assert set(opt._native_cache) == {id(p) for p in params + extra}


def test_one_kernel_call_per_group_and_step(monkeypatch):
    """Two groups (MCF and native masters): one adamw_step_many call each per step, and the same
    weights as one optimizer per group."""
    calls = []
    many = torch.ops.sdpq.adamw_step_many
    monkeypatch.setattr(torch.ops.sdpq, "adamw_step_many", lambda *a: calls.append(len(a[0])) or many(*a))
    mcf, native = _params(), [torch.nn.Parameter(p.detach().float()) for p in _params(n=2)]
    mcf_alone, native_alone = _params(), [torch.nn.Parameter(p.detach().float()) for p in _params(n=2)]
    opts = [
        AdamW([{"params": mcf}, {"params": native, "master": "native", "states": "bf16"}], lr=1e-2),
        AdamW(mcf_alone, lr=1e-2),
        AdamW(native_alone, lr=1e-2, master="native", states="bf16"),
    ]
    for s in range(3):
        _grads(mcf + native, s)
        for p, q in zip(mcf + native, mcf_alone + native_alone):
            q.grad = p.grad.clone()
        for opt in opts:
            opt.step()
    assert calls == [3, 2, 3, 2] * 3
    assert all(torch.equal(a, b) for a, b in zip(mcf + native, mcf_alone + native_alone))
    assert not torch.equal(mcf[0], _params()[0])


def test_a_parameter_that_raises_leaves_those_before_it_stepped():
    """As when each parameter stepped on its own: the step counters and the weights agree."""
    params = _params()
    opt = AdamW(params, lr=1e-2)
    _run(opt, params, 1)
    params[2].data = torch.zeros(2, 128, dtype=torch.bfloat16)  # its state no longer fits
    before = [p.detach().clone() for p in params[:2]]
    _grads(params, 1)
    with pytest.raises(ValueError, match="the parameter now has 256"):
        opt.step()
    assert all(not torch.equal(p, b) and float(opt.state[p]["step"]) == 2 for p, b in zip(params, before))


def test_a_kernel_call_that_raises_is_not_made_again(monkeypatch):
    """The cleanup that steps the parameters collected before a failure must not repeat a batch
    whose call itself raised: the kernel may have stepped some of its parameters already."""
    params = _params()
    opt = AdamW(params, lr=1e-2)
    calls = []

    def failing(self, group, batch):
        calls.append(len(batch))
        raise RuntimeError("kernel failed")

    monkeypatch.setattr(AdamW, "_native_step", failing)
    _grads(params, 0)
    with pytest.raises(RuntimeError, match="kernel failed"):
        opt.step()
    assert calls == [3]
