"""Properties of the Collage multi-component float (bf16 pair) arithmetic."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sdpq.quant.mcf import fast2sum, grow_, mul_, split, split_scalar, value

FAST = settings(deadline=None, max_examples=30)
BF16 = torch.bfloat16


def rand_bf16(seed, n, spread=8.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * spread)).to(BF16)


@FAST
@given(seed=st.integers(0, 2**31 - 1))
def test_fast2sum_is_exact(seed):
    a, b = rand_bf16(seed, 4096), rand_bf16(seed + 1, 4096)
    big = torch.where(a.float().abs() >= b.float().abs(), a, b)
    small = torch.where(a.float().abs() >= b.float().abs(), b, a)
    s, e = fast2sum(big, small)
    assert s.dtype == e.dtype == BF16
    assert torch.equal(s.double() + e.double(), big.double() + small.double())
    assert torch.equal(s, (big.float() + small.float()).to(BF16))


def test_split_scalar_is_exact_in_fp32_and_hi_is_bf16():
    for beta in (0.9, 0.95, 0.98, 0.999, 0.9999):
        hi, lo = split_scalar(beta)
        assert torch.tensor(hi).to(BF16).item() == hi
        assert torch.tensor(hi, dtype=torch.float32) + torch.tensor(lo) == torch.tensor(beta, dtype=torch.float32)
    assert split_scalar(0.999)[0] == 1.0  # plain bf16 beta2 = 1: v would never decay


def test_grow_keeps_1000_tiny_updates_that_plain_bf16_drops():
    g = torch.Generator().manual_seed(0)
    x0 = torch.rand(4096, generator=g) + 0.5
    hi, lo = split(x0)
    plain = hi.clone()
    ref = value(hi, lo, torch.float64)
    for _ in range(1000):
        # every update is below half an ulp of the weight (>= 2^-9): bf16 rounds it away
        d = (torch.rand(4096, generator=g) + 0.5) * 1e-4
        grow_(hi, lo, d)
        plain += d.to(BF16)
        ref += d.double()
    err = ((value(hi, lo).double() - ref).abs() / ref).max()
    err_plain = ((plain.double() - ref).abs() / ref).max()
    assert err < 1e-3, err
    assert torch.equal(plain, x0.to(BF16))  # plain bf16 stalled completely
    assert err_plain > 0.05
    assert torch.equal(hi, (hi.float() + lo.float()).to(BF16))  # pair stays normalised


@FAST
@given(seed=st.integers(0, 2**31 - 1), scale=st.floats(-30, 30))
def test_grow_single_step_is_accurate_and_normalised(seed, scale):
    hi, lo = split(torch.randn(2048, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)))
    d = torch.randn(2048, generator=torch.Generator().manual_seed(seed + 7)) * 2.0**scale
    x = value(hi, lo, torch.float64)
    exact = x + d.double()
    grow_(hi, lo, d)
    err = (value(hi, lo, torch.float64) - exact).abs()
    # ~16 significant bits relative to the operands (d's fp32 bits below that are dropped)
    assert (err <= (x.abs() + d.double().abs()) * 2.0**-15 + 2.0**-133).all()
    assert torch.equal(hi, (hi.float() + lo.float()).to(BF16))


@FAST
@given(seed=st.integers(0, 2**31 - 1), beta=st.floats(0.5, 0.99999))
def test_pair_times_split_scalar_is_accurate(seed, beta):
    hi, lo = split(torch.rand(2048, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)) + 0.01)
    x = value(hi, lo, torch.float64)
    bh, bl = split_scalar(beta)
    mul_(hi, lo, bh, bl)
    b32 = torch.tensor(beta, dtype=torch.float32).double()  # the fp32 beta the split represents
    assert ((value(hi, lo, torch.float64) - x * b32).abs() <= x * b32 * 2.0**-15).all()


def test_pair_times_pair_tensor():
    hi, lo = split(torch.linspace(0.1, 10, 1000, dtype=torch.float64))
    bh, bl = split(torch.linspace(0.5, 2, 1000, dtype=torch.float64))
    x, b = value(hi, lo, torch.float64), value(bh, bl, torch.float64)
    mul_(hi, lo, bh, bl)
    assert ((value(hi, lo, torch.float64) - x * b).abs() <= (x * b) * 2.0**-15).all()


@pytest.mark.parametrize("beta2", [0.95, 0.999])
def test_beta2_decay_with_the_pair_tracks_fp64_and_plain_bf16_does_not(beta2):
    """v <- beta2 v + (1 - beta2) g^2 for 100 steps, as Adam's second moment."""
    g = torch.Generator().manual_seed(3)
    grads = torch.randn(100, 4096, generator=g) * torch.exp(torch.randn(4096, generator=g))
    v0 = grads[0] ** 2
    ref = v0.double()
    hi, lo = split(v0)
    plain = v0.to(BF16)
    bh, bl = split_scalar(beta2)
    for t in range(100):
        g2 = grads[t] ** 2
        mul_(hi, lo, bh, bl)
        grow_(hi, lo, (1 - beta2) * g2)
        plain = (plain * beta2 + (1 - beta2) * g2).to(BF16)  # plain bf16 state
        ref = ref * beta2 + (1 - beta2) * g2.double()
    err_pair = ((value(hi, lo, torch.float64) - ref).abs() / ref).max().item()
    err_plain = ((plain.double() - ref).abs() / ref).max().item()
    assert err_pair < 5e-4, err_pair
    assert err_plain > 20 * err_pair, (err_plain, err_pair)
    print(f"beta2={beta2}: max rel err pair {err_pair:.2e}, plain bf16 {err_plain:.2e}")


def test_product_does_not_alias_its_inputs():
    """The published kernel applied beta2 to an already scaled value: 0.95 -> 0.85 effective."""
    hi, lo = split(torch.ones(8))
    mul_(hi, lo, *split_scalar(0.95))
    torch.testing.assert_close(value(hi, lo), torch.full((8,), 0.95), rtol=2.0**-16, atol=0)


def test_errors_name_the_argument():
    x = torch.ones(4, dtype=BF16)
    with pytest.raises(TypeError, match="bfloat16"):
        grow_(x.float(), x, 1.0)
    with pytest.raises(ValueError, match="shape"):
        grow_(x, torch.ones(3, dtype=BF16), 1.0)
    with pytest.raises(ValueError, match="b_hi=0.999"):
        mul_(x, x.clone(), 0.999)
