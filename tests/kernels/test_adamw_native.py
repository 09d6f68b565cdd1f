"""The C++ AdamW step (torch.ops.sdpq.adamw_step, sdpq/csrc/adamw.cpp) against the PyTorch
path of sdpq.optim.AdamW (kernels_enabled=False, the reference), from identical states.

Without FP8 there is no log2 / exp2 in the step: every tensor must match bitwise. With FP8, the
kernel's log2 / exp2 round differently from torch's (MKL / Sleef): decoded moments stay within
one FP8 step of the reference and nearly always on the same code; weights within one FP8 step of
each update plus one rounding of the master per step.
"""

import itertools
import os
import subprocess
import sys

import pytest
import torch

from sdpq.kernels import adamw_ops
from sdpq.optim import AdamW, states

if not adamw_ops.cpu_available():
    pytest.skip("the C++ AdamW kernel could not be built (see the CppBuildWarning)", allow_module_level=True)

LR, STEPS, G = 1e-2, 5, 128
M_FORMATS = ("fp8", "bf16", "fp32")
V_FORMATS = ("e4m3", "e5m2", "bf16", "fp32", "pair")
MASTERS = {
    "mcf": torch.bfloat16,
    "native-fp32": torch.float32,
    "native-bf16": torch.bfloat16,
    "native-fp16": torch.float16,
}
ULP = {"mcf": 2**-16, "native-fp32": 2**-23, "native-bf16": 2**-8, "native-fp16": 2**-11}  # of each master
FP8 = ("e4m3", "e5m2")
LAYOUTS = list(itertools.product(M_FORMATS, V_FORMATS, ("mcf", "native-fp32", "native-bf16")))


def _layout_id(layout):
    return "-".join(layout)


def make(layout, shape, kernels, group_size=G):
    """A parameter and its optimizer with m, v and master as in layout; v is re-stored in its
    own format when the optimizer's options tie it to m's (the step reads the stored format)."""
    m_fmt, v_fmt, master = layout
    p = torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(MASTERS[master]))
    opt = AdamW(
        [p],
        lr=LR,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        states=m_fmt,
        master=master.split("-")[0],
        mcf_second_moment=v_fmt == "pair",
        v_format="e5m2" if v_fmt == "e5m2" else "e4m3",
        group_size=group_size if group_size & (group_size - 1) == 0 else G,
    )
    # Note: AdamW takes powers of two (the config's rule); the kernels take any even group size,
    # and the tests of that general case (groups of 48 and 100) set it on the parameter group.
    opt.param_groups[0]["group_size"] = group_size
    opt.kernels_enabled = kernels
    st = opt._state_for(p, opt.param_groups[0])
    stored = "fp8" if v_fmt in FP8 else v_fmt
    if states.stored_format(st, "exp_avg_sq") != stored:
        states.encode(st, "exp_avg_sq", stored, torch.zeros(shape), opt.param_groups[0]["v_format"], group_size)
    return p, opt


def gradients(shape, steps=STEPS, seed=1):
    """Gradients spanning decades, with exact zeros inside groups and, for 2-D shapes, a row
    that never sees a gradient (all-zero groups)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        g = torch.randn(shape, generator=gen) * torch.exp(2 * torch.randn(shape, generator=gen))
        if len(shape):
            g[..., :7] = 0.0
        if len(shape) == 2 and shape[0] > 1:
            g[1] = 0.0
        yield g


def run_both(layout, shape, group_size=G, grad_scale=1.0):
    (p_ref, o_ref), (p_nat, o_nat) = (make(layout, shape, k, group_size) for k in (False, True))
    for g in gradients(shape):
        g *= grad_scale
        for p, o in ((p_ref, o_ref), (p_nat, o_nat)):
            p.grad = g.to(p.dtype)
            o.step()
    return (p_ref, o_ref.state[p_ref]), (p_nat, o_nat.state[p_nat])


def master_value(p, st):
    w = p.detach().double()
    return w + st["master_lo"].double() if "master_lo" in st else w


def per_element(t, codes, group_size):
    """Per-group metadata t [..., groups] spread over the elements of codes [..., cols]."""
    rows, cols = codes.shape[:-1].numel(), codes.shape[-1] if codes.dim() else 1
    return t.reshape(rows, -1).repeat_interleave(group_size, dim=1)[:, :cols].reshape(codes.shape)


def assert_fp8_moment_agrees(s_ref, s_nat, name, fmt, group_size):
    """Same code: the values differ by the metadata's rounding only. Another code: the adjacent
    one (the reference's exp2(k log2|x| + bias) lay within a few ulps of a rounding boundary),
    or a different grid (the floor in k flipped)."""
    c_ref, c_nat = s_ref[name + "_codes"], s_nat[name + "_codes"]
    if not c_ref.numel():
        return
    a, b = states.decode(s_ref, name, fmt, group_size), states.decode(s_nat, name, fmt, group_size)
    same = c_ref == c_nat
    assert torch.equal(a == 0, b == 0)
    assert ((a - b).abs() <= 1e-5 * a.abs())[same].all()
    adjacent = ((c_ref & 0x80) == (c_nat & 0x80)) & ((c_ref & 0x7F).int() - (c_nat & 0x7F).int()).abs().le(1)
    k_same = per_element(s_ref[name + "_k"] == s_nat[name + "_k"], c_ref, group_size)
    assert (adjacent | ~k_same)[~same].all()
    assert same.float().mean() >= 0.9


def assert_steps_agree(layout, ref, nat, group_size=G):
    (p_ref, s_ref), (p_nat, s_nat) = ref, nat
    m_fmt, v_fmt, master = layout
    fp8 = {"exp_avg": "e4m3" if m_fmt == "fp8" else None, "exp_avg_sq": v_fmt if v_fmt in FP8 else None}
    if not any(fp8.values()):
        assert torch.equal(p_ref, p_nat)
        assert all(torch.equal(s_ref[k], s_nat[k]) for k in s_ref)
        return
    for name, fmt in fp8.items():
        if fmt is None:  # m and v do not depend on each other: the non-FP8 one is exact
            keys = states.storage_keys(name, states.stored_format(s_ref, name))
            assert all(torch.equal(s_ref[k], s_nat[k]) for k in keys)
        else:
            assert_fp8_moment_agrees(s_ref, s_nat, name, fmt, group_size)
    # Weights: nearly all within one rounding of the master per step; none further apart than
    # two Adam steps per step (|m_hat / sqrt(v_hat)| <= 1 for b1 = 0.9 < sqrt(b2)), which a
    # moment one FP8 step away can cost.
    w_ref, w_nat = master_value(p_ref, s_ref), master_value(p_nat, s_nat)
    rounding = STEPS * ULP[master] * w_ref.abs().clamp_min(1.0)
    assert ((w_ref - w_nat).abs() <= rounding + 2 * STEPS * LR).all()
    if w_ref.numel():
        assert ((w_ref - w_nat).abs() <= rounding + LR * 2**-10).float().mean() >= 0.99


@pytest.mark.parametrize("shape", [(5, 300), (300,)], ids=["2d", "1d"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=_layout_id)
def test_native_step_matches_the_reference(layout, shape):
    ref, nat = run_both(layout, shape)
    assert_steps_agree(layout, ref, nat)


@pytest.mark.parametrize("layout", [("fp8", "e4m3", "mcf"), ("fp8", "e5m2", "native-fp32")], ids=_layout_id)
def test_many_groups(layout):
    """64 x 1000: a few codes among ~10^6 encodings land next to the reference's."""
    ref, nat = run_both(layout, (64, 1000))
    assert_steps_agree(layout, ref, nat)


@pytest.mark.parametrize("v_fmt", ["e4m3", "e5m2"])
def test_moments_in_the_subnormal_range(v_fmt):
    """Gradients ~1e-20: v ~1e-40 is an fp32 subnormal (log2 rescales it; decoding leaves the
    per-group factor tables, which need normal numbers)."""
    layout = ("fp8", v_fmt, "native-fp32")
    ref, nat = run_both(layout, (4, 256), grad_scale=1e-20)
    assert (ref[1]["exp_avg_sq_codes"] != 0).any()
    assert_steps_agree(layout, ref, nat)


@pytest.mark.parametrize("v_fmt", ["e4m3", "e5m2"])
def test_vector_and_scalar_encodes_agree(v_fmt):
    """A group of 100 is encoded 64 values with AVX2 and 36 by the scalar loop: the same value
    must get the same code either way. Each row holds 50 values twice (columns j and j + 50), so
    after a first step from zero states (m = 0.1 g, v = 0.05 g^2 exactly) columns 14..49 (vector)
    and 64..99 (scalar) hold equal moments. Rows: values spanning decades, the same with zeros,
    and fp32 subnormals (the vector path's rescaling)."""
    gen = torch.Generator().manual_seed(3)
    half = torch.randn(3, 50, generator=gen).sign() * torch.exp(torch.randn(3, 50, generator=gen) * 3)
    half[1, ::4] = 0.0
    half[2] *= 1e-38  # v = 0.05 g^2 underflows to zero here; m = 0.1 g is subnormal
    layout = ("fp8", v_fmt, "native-fp32")
    p, opt = make(layout, (3, 100), True, group_size=100)
    p.grad = torch.cat([half, half], dim=1)
    opt.step()
    for name in ("exp_avg", "exp_avg_sq"):
        codes = opt.state[p][name + "_codes"]
        assert torch.equal(codes[:, 14:50], codes[:, 64:100]), name
        assert len(codes[0].unique()) > 20  # many codes, not one


@pytest.mark.parametrize("v_fmt", ["e4m3", "e5m2"])
def test_groups_that_are_not_a_power_of_two(v_fmt):
    layout = ("fp8", v_fmt, "mcf")
    ref, nat = run_both(layout, (4, 100), group_size=48)
    assert_steps_agree(layout, ref, nat, group_size=48)


@pytest.mark.parametrize("layout", [("fp8", "e4m3", "mcf"), ("fp32", "fp32", "native-fp32")], ids=_layout_id)
@pytest.mark.parametrize("shape", [(), (0, 7), (0,)], ids=["0d", "empty-2d", "empty-1d"])
def test_scalar_and_empty_parameters(layout, shape):
    ref, nat = run_both(layout, shape)
    assert_steps_agree(layout, ref, nat)
    assert float(ref[1]["step"]) == float(nat[1]["step"]) == STEPS


def test_native_fp32_states_equal_torch_adamw():
    """fp32 states, native fp32 master: torch.optim.AdamW's single-tensor step, bitwise (7 x 33:
    torch's vectorized loops end with a scalar tail)."""
    init = torch.randn(7, 33, generator=torch.Generator().manual_seed(0))
    ours, theirs = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    opt = AdamW([ours], lr=LR, weight_decay=0.1, states="fp32", master="native")
    topt = torch.optim.AdamW([theirs], lr=LR, weight_decay=0.1, foreach=False)
    for g in gradients((7, 33)):
        ours.grad, theirs.grad = g.clone(), g.clone()
        opt.step()
        topt.step()
    assert torch.equal(ours, theirs)
    for name in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(opt.state[ours][name], topt.state[theirs][name])


@pytest.mark.parametrize("layout", [("fp32", "fp32", "native-fp16"), ("fp8", "e4m3", "native-fp16")], ids=_layout_id)
def test_float16_parameters(layout):
    ref, nat = run_both(layout, (5, 300))
    assert_steps_agree(layout, ref, nat)


@pytest.mark.parametrize(
    "layout", [("fp8", "e4m3", "mcf"), ("fp8", "e5m2", "native-fp32"), ("bf16", "pair", "mcf")], ids=_layout_id
)
def test_results_do_not_depend_on_the_number_of_threads(layout):
    shape = (64, 1200)  # ~11 tiles of 6 rows: several tasks per thread
    results = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            p, opt = make(layout, shape, True)
            for g in gradients(shape, steps=2):
                p.grad = g.to(p.dtype)
                opt.step()
            results.append([p.detach().clone()] + [t.clone() for t in opt.state[p].values()])
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("layout", [("fp8", "e4m3", "mcf"), ("fp8", "e5m2", "native-fp32")], ids=_layout_id)
def test_whole_rows_step_as_single_rows_do(layout):
    """Tiles of whole rows of whole groups (40 x 384: tiles of 21 rows, then 19) are worked as
    one run of groups; each row stepped as a parameter of its own must come out bitwise the same."""
    shape = (40, 384)
    p, opt = make(layout, shape, True)
    rows = [make(layout, (1, shape[1]), True) for _ in range(shape[0])]
    with torch.no_grad():
        for i, (q, _) in enumerate(rows):
            q.copy_(p[i : i + 1])
    for g in gradients(shape, steps=3):
        p.grad = g.to(p.dtype)
        opt.step()
        for i, (q, o) in enumerate(rows):
            q.grad = g[i : i + 1].to(q.dtype)
            o.step()
    whole = opt.state[p]
    for i, (q, o) in enumerate(rows):
        assert torch.equal(p[i : i + 1], q)
        for key, t in o.state[q].items():
            assert torch.equal(whole[key][i : i + 1] if t.dim() else whole[key], t), key


def _count_native_steps(monkeypatch):
    calls = []
    native_step = AdamW._native_step
    monkeypatch.setattr(AdamW, "_native_step", lambda self, *a: calls.append(1) or native_step(self, *a))
    return calls


def test_nonfinite_gradient_skips_the_step_before_the_kernel(monkeypatch):
    calls = _count_native_steps(monkeypatch)
    p, opt = make(("fp8", "e4m3", "mcf"), (3, 200), True)
    p.grad = next(gradients((3, 200))).to(p.dtype)
    opt.step()
    before = [p.detach().clone()] + [t.clone() for t in opt.state[p].values()]
    p.grad[1, 5] = float("inf")
    opt.step()
    assert opt.skipped_steps == 1 and len(calls) == 1
    assert all(torch.equal(a, b) for a, b in zip(before, [p.detach()] + list(opt.state[p].values())))


def test_kernels_disabled_or_unavailable_take_the_reference_path(monkeypatch):
    calls = _count_native_steps(monkeypatch)
    for kernels, available in ((False, True), (True, False), (True, True)):
        monkeypatch.setattr(adamw_ops, "cpu_available", lambda available=available: available)
        p, opt = make(("fp8", "e4m3", "mcf"), (2, 130), kernels)
        p.grad = torch.ones(2, 130, dtype=p.dtype)
        opt.step()
    assert len(calls) == 1


def test_sdpq_cpp_0_turns_the_kernel_off():
    code = (
        "import torch; from sdpq.kernels import adamw_ops; from sdpq.optim import AdamW\n"
        "p = torch.nn.Parameter(torch.ones(2, 3, dtype=torch.bfloat16)); p.grad = torch.ones_like(p)\n"
        "AdamW([p]).step(); print(adamw_ops.cpu_available(), p.dtype)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "SDPQ_CPP": "0"},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert out.stdout.split() == ["False", "torch.bfloat16"]


@pytest.mark.parametrize("fmt, codes", [("e4m3", (0x7F, 0xFF)), ("e5m2", (0x7C, 0x7E))])
def test_nonfinite_codes_decode_like_the_reference(fmt, codes):
    """NaN / inf codes inside otherwise finite groups (a foreign or damaged state) decode to NaN /
    inf; their groups are re-encoded as non-finite (NaN scale), as in the reference."""
    layout = ("fp8", fmt, "native-fp32")
    pair = [make(layout, (2, 256), k) for k in (False, True)]
    for g in gradients((2, 256), steps=2):
        for p, o in pair:
            p.grad = g.clone()
            o.step()
    for p, o in pair:
        o.state[p]["exp_avg_sq_codes"][0, 3], o.state[p]["exp_avg_sq_codes"][1, 200] = codes
        p.grad = torch.ones(2, 256)
        o.step()
    (p_ref, o_ref), (p_nat, o_nat) = pair
    bad = o_ref.state[p_ref]["exp_avg_sq_scale"].isnan()
    assert bad.sum() == 2 and torch.equal(bad, o_nat.state[p_nat]["exp_avg_sq_scale"].isnan())
    assert p_ref.isnan().any() and torch.equal(p_ref.isnan(), p_nat.isnan())


def _op_args(m_format="e4m3", v_format="e4m3", n_rows=3, cols=40, group_size=16):
    groups = -(-cols // group_size)
    w = torch.randn(n_rows, cols).to(torch.bfloat16)

    def moment(fmt):
        if fmt in FP8:
            return [torch.zeros(n_rows, cols, dtype=torch.uint8)] + [torch.zeros(n_rows, groups) for _ in range(3)]
        if fmt == "pair":
            return [torch.zeros(n_rows, cols, dtype=torch.bfloat16) for _ in range(2)]
        return [torch.zeros(n_rows, cols, dtype=torch.float32 if fmt == "fp32" else torch.bfloat16)]

    return (
        w,
        torch.zeros_like(w),
        torch.randn(n_rows, cols).to(torch.bfloat16),
        moment(m_format),
        moment(v_format),
        m_format,
        v_format,
        1e-3,
        0.9,
        0.95,
        1e-8,
        0.1,
        1,
        group_size,
    )


@pytest.mark.parametrize("formats", [("e4m3", "e4m3"), ("bf16", "pair")])
def test_opcheck(formats):
    torch.library.opcheck(
        torch.ops.sdpq.adamw_step.default,
        _op_args(*formats),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )


def test_op_rejects_bad_arguments():
    with pytest.raises(RuntimeError, match="m_format='e3m4'"):
        torch.ops.sdpq.adamw_step(*_op_args()[:5], "e3m4", *_op_args()[6:])
    with pytest.raises(RuntimeError, match="m_format='pair' is not a layout"):
        torch.ops.sdpq.adamw_step(*_op_args("pair", "pair"))
    args = list(_op_args())
    args[3][1] = torch.zeros(3, 2)  # 40 columns in groups of 16 need 3 metadata columns
    with pytest.raises(RuntimeError, match="FP8 metadata"):
        torch.ops.sdpq.adamw_step(*args)


def test_cuda_implementation_names_the_layouts_it_lacks():
    with pytest.raises(NotImplementedError, match="E4M3 m and v with an MCF master"):
        adamw_ops._adamw_step_cuda(*_op_args("bf16", "bf16"))
