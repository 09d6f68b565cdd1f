"""Properties of FP8 group quantization with COAT dynamic range expansion."""

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sdpq.quant.fp8 import FORMATS, dequantize_fp8, fp8_empty, nonfinite_groups, quantize_fp8

FAST = settings(deadline=None, max_examples=25)
FMTS = st.sampled_from(["e4m3", "e5m2"])


def adam_like(seed: int, sigma: float, signed: bool, shape=(16, 1024)) -> torch.Tensor:
    """Second moments are lognormal over many decades; first moments are signed and narrower."""
    g = torch.Generator().manual_seed(seed)
    x = torch.exp(torch.randn(shape, generator=g) * sigma)
    if signed:
        x = x * torch.randn(shape, generator=g).sign()
    return x


def rel_err(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """|y - x| / |x|, and |y - x| where x == 0 (randn can return 0.0: 0/0 would make the mean
    NaN; an exact zero that decodes exactly then contributes 0)."""
    err = (y - x).abs()
    return torch.where(x != 0, err / x.abs(), err)


@FAST
@given(seed=st.integers(0, 2**31 - 1), sigma=st.floats(0.5, 8.0), signed=st.booleans(), fmt=FMTS)
@example(seed=9083, sigma=1.0, signed=True, fmt="e4m3")  # holds an exact 0.0 (failed CI once)
def test_expansion_beats_plain_fp8_on_adam_like_states(seed, sigma, signed, fmt):
    x = adam_like(seed, sigma, signed)
    e_exp = rel_err(x, dequantize_fp8(quantize_fp8(x, fmt))).mean()
    e_plain = rel_err(x, dequantize_fp8(quantize_fp8(x, fmt, expand=False))).mean()
    assert e_exp < e_plain, (e_exp, e_plain)


def test_expansion_keeps_small_second_moments_that_plain_e4m3_flushes():
    x = adam_like(0, 5.0, signed=False)  # ~10 decades inside each group
    plain = dequantize_fp8(quantize_fp8(x, expand=False))
    expanded = dequantize_fp8(quantize_fp8(x))
    assert (plain == 0).float().mean() > 0.1  # plain FP8 flushes the small v -> m/sqrt(v) blows up
    assert (expanded == 0).sum() == 0
    assert rel_err(x, expanded).mean() < 0.1 * rel_err(x, plain).mean()


@FAST
@given(
    seed=st.integers(0, 2**31 - 1), n=st.integers(1, 700), fmt=FMTS, expand=st.booleans(), zero_frac=st.floats(0.0, 0.9)
)
def test_zeros_stay_exactly_zero_any_length(seed, n, fmt, expand, zero_frac):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, n, generator=g) * torch.exp(torch.randn(3, n, generator=g) * 2)
    x[torch.rand(3, n, generator=g) < zero_frac] = 0.0
    q = quantize_fp8(x, fmt, expand=expand)
    assert q.codes.shape == x.shape and q.codes.dtype == torch.uint8  # padding never visible
    y = dequantize_fp8(q)
    assert y.shape == x.shape
    assert torch.equal(y[x == 0], torch.zeros_like(y[x == 0]))
    if expand:  # nothing non-zero flushes to zero with expansion
        assert (y[x != 0] != 0).all()


def test_zero_at_every_offset_does_not_collapse_k():
    G = 128
    base = torch.exp(torch.linspace(-6, 6, G))  # R = e^12 spread over the group
    batch = base.repeat(G, 1)
    # row o has an exact zero at offset o; the min and max elements are moved next to it
    for o in range(G):
        batch[o] = base.roll(o + 1)
        batch[o, o] = 0.0
    nz = batch.clone()
    nz[nz == 0] = math.inf
    mn, mx = nz.amin(1).double(), batch.amax(1).double()
    k_ref = torch.floor(16 * math.log2(448**2 / 2) / torch.log2(mx / mn)) / 16
    q = quantize_fp8(batch, group_size=G)
    assert torch.equal(q.k.squeeze(1).double(), k_ref)
    y = dequantize_fp8(q)
    assert (y[batch == 0] == 0).all()
    assert rel_err(batch[batch != 0], y[batch != 0]).max() < 0.25


def test_all_zero_groups_and_mixed_rows():
    x = torch.randn(4, 640)
    x[1] = 0.0
    x[2, 128:256] = 0.0
    x[3, 600:] = 0.0  # zero tail inside the partial last group
    q = quantize_fp8(x)
    y = dequantize_fp8(q)
    assert torch.equal(y[1], torch.zeros(640)) and torch.equal(y[2, 128:256], torch.zeros(128))
    assert torch.equal(y[3, 600:], torch.zeros(40))
    assert all(torch.isfinite(t).all() for t in q.tensors()[1:])
    assert not nonfinite_groups(q).any()
    assert torch.equal(dequantize_fp8(fp8_empty((5, 300))), torch.zeros(5, 300))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_groups_with_equal_magnitudes_have_k_one_and_decode_exactly(fmt):
    g = torch.Generator().manual_seed(1)
    signs = torch.randn(3, 256, generator=g).sign()
    x = signs * torch.tensor([[0.37], [3e-20], [12345.0]])
    x[0, :5] = 0.0  # zeros do not count: R is still 1
    q = quantize_fp8(x, fmt)
    assert torch.equal(q.k, torch.ones_like(q.k))
    torch.testing.assert_close(dequantize_fp8(q), x, rtol=1e-6, atol=0)  # fp32 log2/exp2


@FAST
@given(seed=st.integers(0, 2**31 - 1), sigma=st.floats(0.1, 12.0), fmt=FMTS, n=st.integers(1, 520))
def test_error_bound_from_the_stored_metadata(seed, sigma, fmt, n):
    """|c - x'/s| <= max(half ulp relative, half the subnormal spacing) in the code domain,
    so x_hat / x = (c / c_true)^(1/k) is bounded per element."""
    g = torch.Generator().manual_seed(seed)
    x = torch.exp(torch.randn(2, n, generator=g) * sigma) * torch.randn(2, n, generator=g).sign()
    q = quantize_fp8(x, fmt)
    y = dequantize_fp8(q).double()
    fi = torch.finfo(FORMATS[fmt])
    half_rel, half_sub = fi.eps / 2, fi.smallest_normal * fi.eps / 2
    G = q.group_size
    k = q.k.double().repeat_interleave(G, -1)[:, :n]
    gm = q.gm.double().repeat_interleave(G, -1)[:, :n]
    s = q.scale.double().repeat_interleave(G, -1)[:, :n]
    c_true = (x.double().abs() / gm) ** k / s
    r = torch.maximum(torch.full_like(c_true, half_rel), half_sub / c_true)
    assert (r < 1).all()  # the smallest code sits at >= 2/fmax: nothing flushes to zero
    # x_hat/x = (c/c_true)^(1/k) with c/c_true in [1-r, 1+r]; + slack for fp32 log2/exp2
    bound = torch.maximum((1 + r) ** (1 / k) - 1, 1 - (1 - r) ** (1 / k)) * 1.001 + 1e-5
    assert (rel_err(x.double(), y) <= bound).all()
    assert (c_true <= fi.max * (1 + 1e-5)).all() and (c_true >= 2 / fi.max * (1 - 1e-5)).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_metadata_is_fp32_whatever_the_input_dtype(dtype):
    x = (torch.rand(3, 300) * 9 + 1).to(dtype)  # one decade: k >= 1, error <= 2^-4 (+ output rounding)
    q = quantize_fp8(x)
    assert q.scale.dtype == q.k.dtype == q.gm.dtype == torch.float32
    assert q.scale.shape == (3, 3)
    y = dequantize_fp8(q, dtype=dtype)
    assert y.dtype == dtype
    assert rel_err(x.float(), y.float()).max() < 2.0**-4 + 2.0**-8


def test_codes_are_uint8_views_of_float8_and_plain_mode_is_absmax():
    x = torch.randn(2, 256)
    q = quantize_fp8(x, expand=False)
    assert q.k is None and q.gm is None and q.nbytes == 2 * 256 + 4 * 4
    s = x.view(2, 2, 128).abs().amax(-1) / 448
    torch.testing.assert_close(q.scale, s)
    manual = (x.view(2, 2, 128) / s.unsqueeze(-1)).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(q.codes, manual.view(2, 256))
    assert torch.equal(q.codes.view(torch.float8_e4m3fn).view(torch.uint8), q.codes)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("expand", [True, False])
def test_non_finite_input_is_reported_never_finite(bad, expand):
    x = torch.randn(2, 384)
    x[1, 200] = bad
    q = quantize_fp8(x, expand=expand)
    assert nonfinite_groups(q).tolist() == [[False] * 3, [False, True, False]]
    y = dequantize_fp8(q)
    assert y[1, 128:256].isnan().all()
    assert torch.isfinite(y[0]).all() and torch.isfinite(y[1, :128]).all() and torch.isfinite(y[1, 256:]).all()


def test_preallocated_buffers_and_blocks_are_written_in_place():
    x = torch.randn(6, 1000) * torch.exp(torch.randn(6, 1000) * 3)
    whole = quantize_fp8(x)
    buf = fp8_empty((6, 1000))
    ptrs = [t.data_ptr() for t in buf.tensors()]
    # two row blocks x two group-aligned column blocks, like the optimizer's chunks
    for rows in (slice(0, 4), slice(4, 6)):
        for cols in (slice(0, 512), slice(512, 1000)):
            quantize_fp8(x[rows, cols], out=buf.block(rows, cols))
    assert [t.data_ptr() for t in buf.tensors()] == ptrs
    # same groups -> same result; log2/exp2 may differ by an fp32 ulp between SIMD body and tail
    assert torch.equal(buf.k, whole.k)
    torch.testing.assert_close(buf.scale, whole.scale, rtol=1e-6, atol=0)
    torch.testing.assert_close(buf.gm, whole.gm, rtol=1e-6, atol=0)
    assert (buf.codes != whole.codes).float().mean() < 1e-3
    out = torch.empty(6, 1000)
    assert dequantize_fp8(buf, out=out) is out
    same = buf.codes == whole.codes
    torch.testing.assert_close(out[same], dequantize_fp8(whole)[same], rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match="group boundary"):
        buf.block(slice(0, 1), slice(5, 128))
    with pytest.raises(ValueError, match="out is"):
        quantize_fp8(x, "e5m2", out=buf)


def test_argument_errors_name_the_argument():
    with pytest.raises(ValueError, match="fmt='e3m4'"):
        quantize_fp8(torch.ones(4), "e3m4")
    with pytest.raises(TypeError, match="floating-point"):
        quantize_fp8(torch.ones(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="group_size=0"):
        fp8_empty((4,), group_size=0)


def test_scalar_and_empty_tensors():
    for x in (torch.tensor(-2.5), torch.zeros(0), torch.zeros(3, 0)):
        y = dequantize_fp8(quantize_fp8(x))
        assert y.shape == x.shape
        torch.testing.assert_close(y, x)
