"""sdpq.optim.compress: any torch optimizer with states compressed between steps."""

import copy
import io

import pytest
import torch
from optim_problems import least_squares, mlp, set_grads, train

from sdpq.optim import compress, measure_peak, memory_report

OPTIMIZERS = {
    "sgd_momentum": (lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9), 0.02),
    "adam": (lambda ps, lr: torch.optim.Adam(ps, lr=lr), 0.05),
}
PROBLEMS = {"least_squares": least_squares, "mlp": lambda: mlp(n=2048, hidden=32)}


@pytest.mark.parametrize("problem", sorted(PROBLEMS))
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("states", ["fp8", "bf16"])
def test_wrapped_optimizer_tracks_its_uncompressed_run(problem, name, states):
    make, lr = OPTIMIZERS[name]
    ref, _, _ = train(PROBLEMS[problem](), make, torch.float32, lr=lr)
    final, _, opt = train(
        PROBLEMS[problem](), lambda ps, lr: compress(make(ps, lr), states=states), torch.float32, lr=lr
    )
    print(f"{problem} {name} {states}: final loss {final:.5f} vs uncompressed {ref:.5f} ({(final - ref) / ref:+.3%})")
    assert abs(final - ref) / ref < 0.02


def _big_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(512, 512, generator=g).requires_grad_() for _ in range(8)]


def _grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_state_memory_and_step_peak(name):
    """States shrink ~4x (fp8) / 2x (bf16); the step's extra memory is about one parameter's
    decoded state plus the wrapped optimizer's own temporaries, whatever the parameter count."""
    make, _ = OPTIMIZERS[name]
    one_param = 512 * 512 * 4
    rows = {}
    for states in (None, "fp8", "bf16"):
        params = _big_params()
        inner = make(params, 1e-2)
        if name == "adam":
            inner = torch.optim.Adam(params, lr=1e-2, foreach=True)  # torch's fast path, for comparison
        opt = inner if states is None else compress(inner, states=states)
        _grads(params, 0)
        opt.step()  # states exist from here on
        _grads(params, 1)
        _, peak = measure_peak(opt.step)
        r = memory_report(opt)
        rows[states] = (r["states"] + r["metadata"], peak)
        print(
            f"{name} states={states or 'uncompressed'}: state bytes/param {rows[states][0] / (8 * 512 * 512):.3f}, "
            f"peak extra memory during step {peak / one_param:.2f} x one parameter's fp32 size"
        )
    n_states = {"sgd_momentum": 1, "adam": 2}[name]
    full = rows[None][0]
    assert full == pytest.approx(n_states * 8 * one_param, rel=0.01)
    assert rows["fp8"][0] < 0.3 * full and rows["bf16"][0] < 0.51 * full
    for states in ("fp8", "bf16"):
        assert rows[states][1] is not None and rows[states][1] <= 4.5 * one_param  # not 8 parameters' worth


def test_checkpoint_resume_export_and_inner_state_dicts():
    prob = mlp(n=256)

    def run(opt, params, steps):
        out = []
        for _ in range(steps):
            set_grads(prob, params)
            opt.step()
            out.append([p.detach().clone() for p in params])
        return out

    params = [t.float().requires_grad_() for t in prob.init]
    opt = compress(torch.optim.Adam(params, lr=1e-2, weight_decay=0.01), states="fp8")
    run(opt, params, 5)
    buf = io.BytesIO()
    torch.save({"model": [p.detach() for p in params], "optim": opt.state_dict()}, buf)
    straight = run(opt, params, 10)
    buf.seek(0)
    ckpt = torch.load(buf)
    params2 = [t.clone().requires_grad_() for t in ckpt["model"]]
    opt2 = compress(torch.optim.Adam(params2, lr=99.0), states="fp8")
    opt2.load_state_dict(ckpt["optim"])
    assert opt2.param_groups[0]["lr"] == 1e-2 and opt2.inner.param_groups[0]["weight_decay"] == 0.01
    for a, b in zip(straight, run(opt2, params2, 10)):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    # export: the wrapped optimizer's own format, loadable without sdpq
    exported = opt2.export_state_dict()
    assert set(exported["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    plain = torch.optim.Adam([p.detach().clone().requires_grad_() for p in params2], lr=1.0)
    plain.load_state_dict(copy.deepcopy(exported))
    # and an uncompressed optimizer's state_dict loads into a wrapper (compressed on load)
    opt3 = compress(torch.optim.Adam([p.detach().clone().requires_grad_() for p in params2]), states="bf16")
    opt3.load_state_dict(plain.state_dict())
    for q in opt3.param_groups[0]["params"]:
        assert opt3.state[q]["exp_avg"].dtype == torch.bfloat16 and q not in opt3.inner.state
        torch.testing.assert_close(
            opt3.export_state_dict()["state"][0]["exp_avg"],
            plain.state[plain.param_groups[0]["params"][0]]["exp_avg"],
            rtol=1e-2,
            atol=0,
        )


def test_adafactor_keeps_factored_statistics_and_skips_non_finite_steps():
    params = [torch.randn(64, 32, requires_grad=True), torch.randn(32, requires_grad=True)]
    opt = compress(torch.optim.Adafactor(params, lr=1e-2), states="fp8")
    for seed in range(3):
        _grads(params, seed)
        opt.step()
    st_matrix, st_vector = opt.state[params[0]], opt.state[params[1]]
    assert st_matrix["row_var"].dtype == torch.float32  # factored statistics are tiny: kept as is
    assert "variance_codes" in st_vector and st_vector["variance_codes"].dtype == torch.uint8
    before = [p.detach().clone() for p in params]
    codes = st_vector["variance_codes"].clone()
    _grads(params, 5)
    params[1].grad[3] = float("inf")
    opt.step()
    assert opt.skipped_steps == 1 and torch.equal(st_vector["variance_codes"], codes)
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))


def test_argument_errors():
    p = torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError, match="states='int4'"):
        compress(torch.optim.SGD([p], lr=0.1), states="int4")
    with pytest.raises(TypeError, match="compress\\(\\) takes an uncompressed"):
        compress(compress(torch.optim.SGD([p], lr=0.1)))
