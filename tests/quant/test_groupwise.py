"""Integer absmax group quantization: the error bounds the quantizer guarantees."""

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from sdpq.quant import QuantSpec, dequantize, nonfinite_groups, quantize
from sdpq.quant.groupwise import bf16_scale_cap

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _bound_per_element(q, spec_bits_rounding_step: float) -> torch.Tensor:
    """The per-element bound: step * s of the element's group (s/2 nearest, s stochastic)."""
    G = q.group_size
    return (q.scales.repeat_interleave(G, dim=-1)[..., : q.numel]) * spec_bits_rounding_step


@settings(deadline=None, max_examples=60)
@given(
    n=st.integers(1, 3000),
    rows=st.integers(1, 3),
    bits=st.sampled_from([4, 8]),
    group=st.sampled_from([32, 128, 2048]),
    dtype=st.sampled_from(DTYPES),
    log_scale=st.floats(-20, 20),
    seed=st.integers(0, 2**31),
)
def test_nearest_error_within_half_a_step(n, rows, bits, group, dtype, log_scale, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, n, generator=g) * math.exp(log_scale)).to(dtype)
    assume(torch.isfinite(x).all())  # fp16 overflow is the non-finite test's business
    spec = QuantSpec(bits=bits, group_size=group)
    q = quantize(x, spec)
    y = dequantize(q)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert q.codes.abs().max() <= spec.qmax
    # |x - s q| <= s/2, plus the fp32 rounding of the division and the product.
    err = (y - x.float()).abs()
    bound = _bound_per_element(q, 0.5) * (1 + 1e-5) + x.float().abs() * 2e-7
    assert torch.all(err <= bound)


@settings(deadline=None, max_examples=30)
@given(n=st.integers(1, 700), bits=st.sampled_from([4, 8]), seed=st.integers(0, 2**31))
def test_stochastic_error_within_one_step(n, bits, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    spec = QuantSpec(bits=bits, group_size=128, rounding="stochastic")
    q = quantize(x, spec, generator=g)
    err = (dequantize(q) - x).abs()
    assert torch.all(err <= _bound_per_element(q, 1.0) * (1 + 1e-5))


@pytest.mark.parametrize("bits", [4, 8])
def test_stochastic_rounding_is_unbiased(bits):
    # The mean of K independent decodes converges to x: each code is Bernoulli between two
    # neighbours, variance <= s^2/4, so the mean's standard deviation is <= s / (2 sqrt K).
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 512, generator=g)
    spec = QuantSpec(bits=bits, group_size=128, rounding="stochastic")
    K = 4000
    q = quantize(x.expand(K, -1).contiguous(), spec, generator=g)
    mean = dequantize(q).double().mean(0)
    s = q.scales[0].double().repeat_interleave(128)
    z = (mean - x[0].double()) / (s / (2 * math.sqrt(K)))
    # 512 elements at |z| <= 5: a biased quantizer (e.g. round-to-nearest) fails by far.
    assert z.abs().max() < 5
    nearest = dequantize(quantize(x, QuantSpec(bits=bits, group_size=128)))[0].double()
    z_nearest = (nearest - x[0].double()) / (s / (2 * math.sqrt(K)))
    assert z_nearest.abs().max() > 5  # the test can tell a biased rounding apart


def test_deterministic_given_seed():
    x = torch.randn(5000)
    spec = QuantSpec(bits=4, group_size=128, rounding="stochastic")
    a = quantize(x, spec, torch.Generator().manual_seed(7))
    b = quantize(x, spec, torch.Generator().manual_seed(7))
    c = quantize(x, spec, torch.Generator().manual_seed(8))
    assert torch.equal(a.codes, b.codes) and not torch.equal(a.codes, c.codes)


def test_zero_groups_and_padding_are_exact():
    x = torch.zeros(300)
    x[200:] = torch.randn(100)
    q = quantize(x, QuantSpec(bits=4, group_size=128))
    assert q.scales[0] == 0 and torch.all(q.codes[:128] == 0)
    y = dequantize(q)
    assert y.shape == (300,) and torch.all(y[:128] == 0)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_nonfinite_input_is_reported_not_encoded(bad):
    x = torch.randn(2, 512)
    x[1, 300] = bad
    q = quantize(x, QuantSpec(bits=4, group_size=128))
    mask = nonfinite_groups(q)
    assert mask.sum() == 1 and mask[1, 2]
    y = dequantize(q)
    assert torch.isnan(y[1, 256:384]).all()
    assert torch.isfinite(y[0]).all() and torch.isfinite(y[1, :256]).all()


def test_bf16_scales_are_rounded_up_and_what_the_decoder_sees():
    x = torch.randn(1000) * 3
    spec = QuantSpec(bits=8, group_size=128, scale_dtype=torch.bfloat16)
    q = quantize(x, spec)
    assert torch.equal(q.scales, q.scales.bfloat16().float())  # exactly a bf16 value
    amax = torch.nn.functional.pad(x, (0, 24)).abs().view(-1, 128).amax(-1)
    assert torch.all(q.scales >= amax / 127) and torch.all(q.scales <= amax / 127 * (1 + 2**-7))
    # Rounded up, so no value is clipped: the nearest-rounding bound holds for every element.
    assert torch.all((dequantize(q) - x).abs() <= q.scales.repeat_interleave(128)[:1000] * 0.5)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("magnitude", [1e-30, 1e-7, 1.0, 1e6, 1e30])
def test_every_scale_format_round_trips_tiny_and_huge_groups(scale_dtype, bits, magnitude):
    """Gradients of 1e-7 are ordinary in large models; fp16 scales lost them (zeros) and groups
    above ~4.6e5 (NaN). Every offered format keeps the per-element bound |x - s q| <= s / 2."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(bits)) * magnitude
    spec = QuantSpec(bits=bits, group_size=128, scale_dtype=scale_dtype)
    q = quantize(x, spec)
    y = dequantize(q)
    assert torch.isfinite(y).all()
    s = q.scales.repeat_interleave(128)
    assert torch.all((y - x).abs() <= s * 0.5)
    assert torch.all(s <= x.abs().view(-1, 128).amax(-1).repeat_interleave(128) / spec.qmax * (1 + 2**-7))
    rel = float((y - x).double().norm() / x.double().norm())  # fp32 norms under/overflow at 1e-30 / 1e30
    assert rel < (0.15 if bits == 4 else 0.01), rel  # ~ step / sqrt(12) of a N(0, 1) group


def test_fp16_scales_are_refused():
    with pytest.raises(ValueError, match="torch.bfloat16"):
        QuantSpec(scale_dtype=torch.float16)


def test_bad_input_is_a_clear_error():
    with pytest.raises(TypeError, match="int32"):
        quantize(torch.arange(10, dtype=torch.int32), QuantSpec())
    with pytest.raises(ValueError, match="bits.*allowed: 2, 3, 4, 8"):
        QuantSpec(bits=5)
    with pytest.raises(ValueError, match="group_size.*multiple of 8 at 2 or 3 bits"):
        QuantSpec(bits=3, group_size=4)
    with pytest.raises(ValueError, match="rounding"):
        QuantSpec(rounding="up")


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_bf16_scales_at_the_top_of_the_fp32_range_decode_finite(bits, rounding):
    """A group whose absmax is within 2^-8 of the fp32 maximum: its rounded-up bf16 scale would
    decode qmax codes to inf; the cap keeps every value finite and within the quantizer's bound
    (half a step nearest, one step stochastic), the clipped elements by at most 0.016 of a step."""
    top = torch.finfo(torch.float32).max
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(bits)) * 1e37
    x[0, 3], x[1, 200], x[2, 17], x[3, 100] = top, -top, top * (1 - 2**-9), 3.3e38
    spec = QuantSpec(bits=bits, group_size=128, rounding=rounding, scale_dtype=torch.bfloat16)
    q = quantize(x, spec, generator=torch.Generator().manual_seed(0))
    y = dequantize(q)
    assert torch.isfinite(y).all()
    s = q.scales.repeat_interleave(128, dim=-1)
    assert torch.all((y.double() - x.double()).abs() <= s.double() * (0.5 if rounding == "nearest" else 1.0))
    cap = bf16_scale_cap(spec.qmax)
    above = torch.tensor(cap).view(torch.int32).add(0x10000).view(torch.float32)  # the next bf16 value
    assert spec.qmax * cap <= top < spec.qmax * float(above)  # the largest with a finite qmax multiple
    assert (top / spec.qmax - cap) / cap * spec.qmax < 0.016
    assert torch.equal(q.scales, q.scales.bfloat16().float())  # still exactly bf16 values
