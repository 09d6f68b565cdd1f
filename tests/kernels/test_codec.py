"""Fused Triton codec kernels against the PyTorch reference (sdpq.quant.rows).

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, numpy underneath);
with one they are compiled and run on CUDA tensors. Nearest rounding must agree bitwise (same
fp32 operations in the same order); stochastic rounding draws from a different stream, so it is
held to the quantizer's bound (< one step per element) and to unbiasedness.
"""

import math
import os

import pytest
import torch

triton = pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it before any import
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)

from extremes import top_of_range_rows  # noqa: E402

from sdpq.kernels import codec  # noqa: E402
from sdpq.quant import QuantSpec  # noqa: E402
from sdpq.quant.hadamard import signs  # noqa: E402
from sdpq.quant.rows import decode_rows_ref as _decode_rows_ref  # noqa: E402
from sdpq.quant.rows import encode_rows_ref as _encode_rows_ref  # noqa: E402
from sdpq.quant.rows import reduce_rows_ref as _reduce_rows_ref  # noqa: E402

DEV = "cuda" if CUDA else "cpu"


def _kernel_signs(h, device):
    """(block, seed) -> the (block, signs tensor) the Triton wrappers take."""
    return None if h is None else (h[0], signs(h[0], h[1], device))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise-equal values (NaN == NaN; -0.0 == 0.0 as the reference's sums may flip zero signs)."""
    return a.shape == b.shape and torch.equal(a.float().nan_to_num(123.0), b.float().nan_to_num(123.0))


SPECS = [
    QuantSpec(4, 32),
    QuantSpec(8, 32),
    QuantSpec(4, 128, scale_dtype=torch.bfloat16),
    QuantSpec(8, 128, scale_dtype=torch.bfloat16),
    QuantSpec(4, 2048),
    QuantSpec(2, 2048),
    QuantSpec(3, 128),
    QuantSpec(3, 32, scale_dtype=torch.bfloat16),
    QuantSpec(2, 8),
]


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("n", [1, 100, 4096 + 36])
def test_encode_decode_bitwise(spec, n):
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(3, n, generator=g) * torch.logspace(-3, 3, n)).to(DEV)
    x[1, : n // 2] = 0  # all-zero groups
    ref = torch.randn(3, n, generator=g).to(DEV)
    for r in (None, ref):
        wire, own, flag = codec.encode_rows(x, spec, ref=r)
        want, _, bad = _encode_rows_ref(x, spec, r, 1, None, None, None)
        assert torch.equal(wire, want) and own is None and int(flag[0]) == 0 and not bool(bad)
    for dtype in (torch.float32, torch.bfloat16):
        got = codec.decode_rows(want, spec, n, torch.empty(3, n, dtype=dtype, device=DEV))
        assert _same(got, _decode_rows_ref(want, spec, n, torch.empty(3, n, dtype=dtype, device=DEV), False))
        base = torch.randn(3, n, generator=g).to(DEV, dtype)
        got = codec.decode_rows(want, spec, n, base.clone(), add=True)
        assert _same(got, _decode_rows_ref(want, spec, n, base.clone(), True))


def test_encode_bf16_input_and_strided_rows():
    spec = QuantSpec(4, 64)
    x = torch.randn(4, 700, device=DEV).to(torch.bfloat16)[:, 50:650]  # row stride 700, not contiguous
    wire, _, _ = codec.encode_rows(x, spec)
    assert torch.equal(wire, _encode_rows_ref(x, spec, None, 1, None, None, None)[0])


@pytest.mark.parametrize("segments,own_row", [(1, None), (2, 1), (3, 0)])
# blocks 2 and 8: butterflies in registers only; 32, 128: and warp shuffles; 256: the rotating form
@pytest.mark.parametrize("block", [2, 8, 32, 128, 256])
def test_segmented_hadamard_encode_bitwise(segments, own_row, block):
    spec = QuantSpec(8, 128, rounding="nearest")
    P, n = 2, 768  # not a power of two: the last tile is masked
    x = torch.randn(segments * P, n + 64, device=DEV)[:, 64:]  # a column slice, like one pipeline slice
    x[0, 7] = 300.0  # an outlier for the transform to spread
    wire, own, _ = codec.encode_rows(
        x, spec, segments=segments, hadamard=_kernel_signs((block, 5), x.device), own_row=own_row
    )
    want, want_own, _ = _encode_rows_ref(x, spec, None, segments, (block, 5), own_row, None)
    assert torch.equal(wire, want)
    assert (own is None) == (want_own is None) and (own is None or _same(own, want_own))


def test_nonfinite_groups_match_reference():
    spec = QuantSpec(4, 32)
    x = torch.randn(2, 256, device=DEV)
    x[0, 3], x[1, 200] = float("inf"), float("nan")
    wire, _, flag = codec.encode_rows(x, spec)
    want, _, bad = _encode_rows_ref(x, spec, None, 1, None, None, None)
    assert int(flag[0]) == 2 and bool(bad)
    cb = spec.code_bytes(256)
    assert torch.equal(wire[:, :cb], want[:, :cb])  # codes of the bad groups are zeroed alike
    got = codec.decode_rows(wire, spec, 256, torch.empty(2, 256, device=DEV))
    assert _same(got, _decode_rows_ref(want, spec, 256, torch.empty(2, 256, device=DEV), False))
    assert got[0, :32].isnan().all() and got[1, 192:224].isnan().all() and got[0, 32:].isfinite().all()


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_stochastic_within_one_step_and_unbiased(bits):
    spec = QuantSpec(bits, 64, rounding="stochastic")
    x = torch.randn(1, 256, device=DEV)
    scale = x.view(4, 64).abs().amax(1, keepdim=True) / spec.qmax
    # N draws in one launch: N copies of the row, each row with its own stream (the rows' Philox
    # offsets differ). N = 48 keeps the interpreter's time small; the 5-sigma bound (0.36 of a
    # step) still catches nearest or floor rounding, whose bias reaches 0.5 and 1 step.
    N = 48
    wire, _, _ = codec.encode_rows(x.expand(N, 256).contiguous(), spec, seed=3)
    d = codec.decode_rows(wire, spec, 256, torch.empty(N, 256, device=DEV)).view(N, 4, 64)
    assert ((d - x.view(4, 64)).abs() < scale).all()  # floor(y + u): strictly within one step
    # Mean of N draws: each has variance <= s^2 / 4, so 5 sigma = 5 * s / (2 sqrt(N)).
    assert ((d.mean(0) - x.view(4, 64)).abs() <= 5 * scale / (2 * math.sqrt(N))).all()
    assert len({tuple(t.flatten().tolist()) for t in d[:5]}) == 5  # rows draw apart
    seeds = [codec.encode_rows(x, spec, seed=seed)[0] for seed in range(3)]
    assert len({tuple(w.flatten().tolist()) for w in seeds}) == 3  # so do seeds


@pytest.mark.parametrize("bits", [2, 8])
def test_stochastic_draws_are_independent_within_a_run_of_eight(bits):
    """Eight neighbours share one Philox call but not its draw: values halfway between two codes
    round up about half the time, and a run of eight agrees on all eight (up or down) ~1/128 of
    the time (it would always, if the run shared one draw; ~1/2 if the two 16-bit halves of one
    32-bit draw were the same)."""
    spec = QuantSpec(bits, 64, rounding="stochastic")
    x = torch.full((1, 2048), 0.5, device=DEV)
    x[0, ::64] = 1.0  # each group's absmax: the others sit at qmax / 2 = k + 1/2 (qmax is odd)
    wire, _, _ = codec.encode_rows(x, spec, seed=7)
    d = codec.decode_rows(wire, spec, 2048, torch.empty(1, 2048, device=DEV))
    up = (d > 0.5).view(-1, 8).float()  # runs of eight
    up = up[(torch.arange(256, device=DEV) % 8) != 0]  # skip every run with a group's absmax
    assert 0.4 < float(up.mean()) < 0.6
    same = ((up.sum(1) == 0) | (up.sum(1) == 8)).float().mean()
    assert float(same) < 0.06, float(same)  # ~1/128 when independent
    halves = up.view(-1, 4, 2)  # neighbours 2k, 2k + 1: the low and high halves of one 32-bit draw
    assert float((halves[..., 0] == halves[..., 1]).float().mean()) < 0.65  # ~1/2 when independent


def _wire_rows(R, numel, spec, seed):
    g = torch.Generator().manual_seed(seed)
    return _encode_rows_ref(torch.randn(R, numel, generator=g).to(DEV), spec, None, 1, None, None, None)[0]


@pytest.mark.parametrize("R", [2, 4, 11])  # 11: a chunk of 8 rows in flight, then 3 of a second
@pytest.mark.parametrize("block", [None, 4, 128, 256])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_reduce_inverse_hadamard_bitwise(R, block, bits):
    spec, numel = QuantSpec(bits, 128), 1280  # not a power of two: the last tile is masked
    buf = _wire_rows(R, numel, spec, R)
    own = torch.randn(numel, device=DEV)
    had = (block, 3) if block else None
    own_row = R - 2  # in the second chunk when R = 11
    for bad in (False, True):
        b = torch.tensor(float("nan") if bad else 0.0, device=DEV).reshape(1)
        got = codec.reduce_rows(buf, spec, numel, own, own_row, b, hadamard=_kernel_signs(had, buf.device))
        want = _reduce_rows_ref(buf, spec, numel, own, own_row, b, had, None, 0, -1, None)
        assert _same(got, want)
        assert got.isnan().all() == bad


@pytest.mark.parametrize("own_row", [-1, 11, 16])  # 11, 16: one chunk of 8 rows in flight and a partial one
def test_reduce_refuses_an_own_row_outside_the_rows(own_row):
    spec = QuantSpec(4, 128)
    buf = _wire_rows(11, 256, spec, 0)
    with pytest.raises(ValueError, match=f"own_row {own_row} is not one of the 11"):
        codec.reduce_rows(buf, spec, 256, torch.zeros(256, device=DEV), own_row, torch.zeros(1, device=DEV))


@pytest.mark.parametrize("R,nodes", [(2, 2), (4, 2), (2, 4)])
@pytest.mark.parametrize("bits_out", [2, 3, 4])
def test_reduce_then_encode_bitwise(R, nodes, bits_out):
    spec_in = QuantSpec(8, 128)
    spec_out = QuantSpec(bits_out, 128, scale_dtype=torch.bfloat16)
    S = 512
    buf = _wire_rows(R, nodes * S, spec_in, 7)
    own = torch.randn(nodes * S, device=DEV)
    zero = torch.zeros(1, device=DEV)
    wire, own_out, flag = codec.reduce_rows(
        buf, spec_in, nodes * S, own, 0, zero, encode_spec=spec_out, encode_rows_n=S, own_seg=nodes - 1
    )
    want, want_own, bad = _reduce_rows_ref(buf, spec_in, nodes * S, own, 0, zero, None, spec_out, S, nodes - 1, None)
    assert torch.equal(wire, want) and _same(own_out, want_own) and int(flag[0]) == 0 and not bool(bad)


@pytest.mark.skipif(CUDA, reason="compares the interpreter against the CPU operator")
def test_operator_adapters_match_the_cpu_operator():
    """The operators' CUDA kernels (sdpq.kernels.codec_ops.triton_*) take the schema's flat
    arguments: on the same arguments they give bitwise what the C++ CPU operator gives."""
    from sdpq.kernels import codec_ops

    if not codec_ops.cpu_available():
        pytest.skip("no C++ compiler: the CPU operator is not built")
    g = torch.Generator().manual_seed(0)
    signs = torch.where(torch.rand(128, generator=g) < 0.5, -1.0, 1.0)
    x = torch.randn(4, 1024, generator=g)
    enc = (x, None, 2, 4, 128, False, True, signs, 1, 0)  # 2 segments, Hadamard 128, own row 1
    got, want = codec_ops.triton_encode_rows(*enc), torch.ops.sdpq.encode_rows(*enc)
    assert all(_same(a, b) for a, b in zip(got, want))
    wire = want[0]
    out_t = torch.randn(2, 2048, generator=g)
    out_c = out_t.clone()
    codec_ops.triton_decode_rows(wire, 2048, 4, 128, True, out_t, True)
    torch.ops.sdpq.decode_rows(wire, 2048, 4, 128, True, out_c, True)
    assert _same(out_t, out_c)
    own, ok = torch.randn(2048, generator=g), torch.tensor(False)
    for tail in ((0, 2, False, False, 0, -1, 0), (4, 64, False, True, 1024, 1, 0)):  # inverse Hadamard / re-encode
        red = (wire, 2048, 4, 128, True, own, 0, ok, signs if tail[0] == 0 else None, *tail)
        got, want = codec_ops.triton_reduce_rows(*red), torch.ops.sdpq.reduce_rows(*red)
        assert all(_same(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("spec", [QuantSpec(4, 32), QuantSpec(8, 32, scale_dtype=torch.bfloat16)], ids=str)
def test_division_by_the_group_scale_is_ieee(spec):
    """The kernels divide by a group's scale with one reciprocal per group (Markstein's
    correction, _tile.div_by_group): every quotient must still round as IEEE division does.
    Values sit on and one ulp beside each half-integer multiple of the scale (where a quotient
    off by one ulp changes the code), in groups from the subnormal range to near fp32's top."""
    G, q = spec.group_size, spec.qmax
    half = torch.arange(-2 * q, 2 * q + 1, dtype=torch.float32)[: G - 1] / 2  # k / 2 for |k| <= 2 qmax
    rows = []
    for mag in (2.0**-140, 1e-38, 3e-30, 1e-10, 0.37, 1.0, 7e5, 3e29, 2.0**101, 1e38):
        s = torch.tensor(mag / q, dtype=torch.float32)
        base = torch.cat([torch.tensor([mag], dtype=torch.float32), half * s])  # amax = mag: scale ~ s
        for toward in (None, float("inf"), float("-inf")):
            vals = base if toward is None else torch.nextafter(base, torch.full_like(base, toward))
            vals[0] = mag
            rows.append(vals)
    x = torch.stack(rows).to(DEV)
    got = codec.encode_rows(x, spec)[0]
    want = _encode_rows_ref(x, spec, None, 1, None, None, None)[0]
    assert torch.equal(got, want)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_bf16_scales_at_the_top_of_the_fp32_range_match_reference(bits):
    """Groups within 2^-8 of the fp32 maximum: the capped bf16 scale (sdpq.quant.groupwise's
    Note) is the reference's, bitwise, and every value decodes finite."""
    spec = QuantSpec(bits, 128, scale_dtype=torch.bfloat16)
    x = top_of_range_rows(bits).to(DEV)
    wire, _, _ = codec.encode_rows(x, spec)
    want = _encode_rows_ref(x, spec, None, 1, None, None, None)[0]
    assert torch.equal(wire, want)
    got = codec.decode_rows(want, spec, 512, torch.empty(2, 512, device=DEV))
    assert torch.isfinite(got).all()
    assert _same(got, _decode_rows_ref(want, spec, 512, torch.empty(2, 512, device=DEV), False))
