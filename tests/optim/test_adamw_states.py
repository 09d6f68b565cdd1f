"""sdpq.optim.AdamW: compressed state contents, memory, non-finite steps, argument errors."""

import logging
import re

import pytest
import torch
from optim_problems import mlp, set_grads, train

from sdpq.kernels import finite_ops
from sdpq.optim import AdamW, memory_report
from sdpq.optim import states as S
from sdpq.quant.fp8 import dequantize_fp8, quantize_fp8


def rel_err(x, y):
    nz = x != 0
    return ((y[nz] - x[nz]).abs() / x[nz].abs()).mean().item()


def test_expansion_reduces_state_quantization_error_on_real_adam_states():
    """m and v of an fp32 AdamW run on the MLP, quantized both ways (figures printed)."""
    _, params, opt = train(
        mlp(n=512), lambda ps, lr: torch.optim.AdamW(ps, lr=lr, betas=(0.9, 0.999)), torch.float32, steps=100, lr=1e-2
    )
    for name in ("exp_avg", "exp_avg_sq"):
        xs = [opt.state[p][name] for p in params]  # quantized per parameter, as the optimizer does
        x = torch.cat([t.flatten() for t in xs])
        for fmt in ("e4m3", "e5m2"):

            def roundtrip(expand, fmt=fmt, xs=xs):
                return torch.cat([dequantize_fp8(quantize_fp8(t, fmt, expand=expand)).flatten() for t in xs])

            e_exp, e_plain = rel_err(x, roundtrip(True)), rel_err(x, roundtrip(False))
            print(f"{name} {fmt}: mean relative error expanded {e_exp:.4f}, plain {e_plain:.4f}")
            assert e_exp < e_plain


def test_zeros_in_states_and_all_zero_groups_stay_exact():
    p = torch.randn(4, 300, requires_grad=True)
    p0 = p.detach().clone()
    mask = torch.ones(4, 300)
    mask[1] = 0.0  # a whole row: two full groups and a partial one never see a gradient
    mask[:, ::7] = 0.0  # and scattered zeros at every offset of the other groups
    opt = AdamW([p], lr=1e-2, weight_decay=0.0, states="fp8", master="native")
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        p.grad = torch.randn(4, 300, generator=g) * torch.exp(torch.randn(4, 300, generator=g) * 3) * mask
        opt.step()
    st = opt.state[p]
    for name in ("exp_avg", "exp_avg_sq"):
        v = S.decode(st, name)
        assert torch.equal(v[mask == 0], torch.zeros_like(v[mask == 0]))
        assert (v[mask != 0] != 0).all()
        assert torch.isfinite(st[name + "_k"]).all() and (st[name + "_k"] > 0).all()
    assert torch.equal(p.detach()[mask == 0], p0[mask == 0])  # untouched weights did not move
    assert (p.detach()[mask != 0] != p0[mask != 0]).all()


def _model_params(dtype):
    g = torch.Generator().manual_seed(0)
    shapes = [(1024, 256), (256, 1024), (1024,), (256,), (3, 1000), (7,)]  # partial groups included
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in shapes]


def _stepped(opt, params):
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return opt


def test_memory_report_fp8_mcf_vs_fp32_adamw():
    params = _model_params(torch.bfloat16)
    sdpq = memory_report(_stepped(AdamW(params, states="fp8", master="mcf"), params))
    masters = _model_params(torch.float32)
    compute_copies = [p.detach().to(torch.bfloat16) for p in masters]  # bf16 weights next to fp32 master
    base = memory_report(_stepped(torch.optim.AdamW(masters), masters), extra_weights=compute_copies)
    print(f"fp8 states + MCF: {sdpq['bytes_per_param']:.3f} B/param {sdpq['per_param']}")
    print(f"torch AdamW, fp32 master + bf16 weights: {base['bytes_per_param']:.3f} B/param {base['per_param']}")
    assert sdpq["bytes_per_param"] <= 6.3
    assert sdpq["per_param"]["weights"] == 2.0 and sdpq["per_param"]["master"] == 2.0
    assert sdpq["per_param"]["states"] == 2.0
    assert base["bytes_per_param"] == pytest.approx(14.0, abs=1e-3)
    for states, master, pair, expected in (
        ("bf16", "mcf", False, 8.0),
        ("fp8", "mcf", True, 9.0),
        ("fp8", "native", False, 2 + 2),
    ):
        params = _model_params(torch.bfloat16)
        r = memory_report(_stepped(AdamW(params, states=states, master=master, mcf_second_moment=pair), params))
        assert r["bytes_per_param"] == pytest.approx(expected, abs=0.2)


def _snapshot(opt, params):
    return [p.detach().clone() for p in params], {
        id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params
    }


@pytest.mark.parametrize("scan", ["native", "torch"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_gradient_skips_the_whole_step(bad, scan, caplog, monkeypatch):
    """The guard's C++ scan (one call over every gradient) and its torch check alike."""
    if scan == "torch":
        monkeypatch.setattr(finite_ops, "cpu_available", lambda: False)
    elif not finite_ops.cpu_available():
        pytest.skip("the C++ kernel could not be built")
    prob = mlp(n=64)
    params = [t.to(torch.bfloat16).requires_grad_() for t in prob.init]
    opt = AdamW(params, lr=1e-2, states="fp8", master="mcf")
    for _ in range(3):
        set_grads(prob, params)
        opt.step()
    before, states = _snapshot(opt, params)
    set_grads(prob, params)
    params[2].grad[0, 5] = bad  # one element of one (late) parameter
    with caplog.at_level(logging.WARNING, logger="sdpq.optim"):
        opt.step()
    assert opt.skipped_steps == 1
    assert "param_groups[0]['params'][2]" in caplog.text and "skipped" in caplog.text
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b)
        for k, v in opt.state[p].items():
            assert torch.equal(v, states[id(p)][k])  # step counter included
    set_grads(prob, params)
    opt.step()  # the next finite step proceeds normally
    assert float(opt.state[params[0]]["step"]) == 4.0


def test_non_finite_gradient_can_raise():
    p = torch.randn(10, requires_grad=True)
    opt = AdamW([p], states="fp8", master="native", on_nonfinite="raise")
    p.grad = torch.full((10,), float("nan"))
    with pytest.raises(FloatingPointError, match=r"param_groups\[0\]\['params'\]\[0\]"):
        opt.step()
    assert not opt.state.get(p)


def test_argument_errors_name_the_argument():
    p = torch.zeros(4, requires_grad=True)
    cases = [
        (dict(states="int8"), "AdamW.states: invalid value 'int8'"),
        (dict(master="fp32"), "AdamW.master: invalid value 'fp32'"),
        (dict(v_format="e3m4"), "AdamW.v_format: invalid value 'e3m4'"),
        (dict(group_size=0), "AdamW.group_size: invalid value 0"),
        (dict(group_size=100), "AdamW.group_size: invalid value 100; allowed: a power of two"),
        (dict(betas=(0.9, 1.0)), "AdamW.betas: invalid value (0.9, 1.0)"),
        (dict(lr=-1.0), "AdamW.lr: invalid value -1.0"),
        (dict(lr=float("inf")), "AdamW.lr: invalid value inf"),
        (dict(eps=float("nan")), "AdamW.eps: invalid value nan"),
        (dict(on_nonfinite="ignore"), "on_nonfinite='ignore'"),
        (dict(mcf_second_moment=1), "mcf_second_moment"),
    ]
    for kw, msg in cases:
        kw.setdefault("master", "native")
        with pytest.raises(ValueError, match=re.escape(msg)):
            AdamW([p], **kw)
    with pytest.raises(ValueError, match="master='mcf' needs bfloat16 parameters.*torch.float32"):
        AdamW([p], master="mcf")


@pytest.mark.parametrize("states", ["fp32", "fp8"])
def test_chunked_step_matches_one_chunk(states, monkeypatch):
    """The step runs in chunks (bounded temporaries); chunk boundaries never split an FP8 group."""
    from sdpq.optim import layout

    g = torch.Generator().manual_seed(0)
    init = [torch.randn(5000, generator=g), torch.randn(37, 300, generator=g)]  # flat partition + matrix
    grads = [[torch.randn(t.shape, generator=g) for t in init] for _ in range(5)]
    results = []
    for chunk in (1 << 30, 256):  # one chunk vs column blocks of 2 groups and row blocks of 1 row
        monkeypatch.setitem(layout.CHUNK_NUMEL, "cpu", chunk)
        params = [t.clone().requires_grad_() for t in init]
        opt = AdamW(params, lr=1e-2, states=states, master="native")
        for gs in grads:
            for p, gr in zip(params, gs):
                p.grad = gr
            opt.step()
        results.append(params)
    for a, b in zip(*results):
        if states == "fp32":
            assert torch.equal(a, b)
        else:  # log2/exp2 may differ by an fp32 ulp between a SIMD body and its tail
            torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


def test_from_config_takes_the_sections_options():
    """Every caller (DeepSpeed integration, training backends) builds the AdamW this way."""
    import sdpq

    section = sdpq.Config.from_dict(
        {"optimizer": {"states": "bf16", "master": "native", "group_size": 64, "v_format": "e5m2"}}
    ).optimizer
    opt = AdamW.from_config([torch.nn.Parameter(torch.zeros(4))], section, lr=0.5, betas=(0.8, 0.9), weight_decay=0.0)
    g = opt.param_groups[0]
    assert (g["states"], g["master"], g["group_size"], g["v_format"]) == ("bf16", "native", 64, "e5m2")
    assert (g["lr"], g["betas"], g["weight_decay"]) == (0.5, (0.8, 0.9), 0.0)


def test_adamw_and_the_config_share_defaults_and_validation():
    """sdpq.optim.AdamW takes its defaults from OptimizerConfig / ADAMW_HYPERPARAMETERS and refuses
    what the config refuses, with the same message (its own key path)."""
    import inspect

    from sdpq.config import ADAMW_HYPERPARAMETERS, ConfigError, OptimizerConfig

    params = inspect.signature(AdamW).parameters
    assert {k: params[k].default for k in OptimizerConfig().adamw_options()} == OptimizerConfig().adamw_options()
    assert {k: params[k].default for k in ADAMW_HYPERPARAMETERS} == ADAMW_HYPERPARAMETERS
    p = torch.zeros(4, requires_grad=True)
    for bad in ({"group_size": 100}, {"group_size": 8192}, {"states": "fp16"}, {"mcf_second_moment": "yes"}):
        with pytest.raises(ConfigError) as from_config:
            OptimizerConfig(**bad)
        with pytest.raises(ConfigError) as from_class:
            AdamW([p], master="native", **bad)
        assert str(from_class.value) == str(from_config.value).replace("sdpq.optimizer.", "sdpq.optim.AdamW.")
