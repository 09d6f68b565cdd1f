"""Randomized blockwise Walsh-Hadamard transform: scaled orthogonal, invertible, overflow-free, smoothing."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sdpq.quant import QuantSpec, dequantize, hadamard, inverse_hadamard, quantize


def _dense_hadamard(B: int) -> torch.Tensor:
    H = torch.ones(1, 1, dtype=torch.float64)
    while H.shape[0] < B:  # Sylvester construction
        H = torch.cat((torch.cat((H, H), 1), torch.cat((H, -H), 1)), 0)
    return H


@settings(deadline=None, max_examples=50)
@given(log_b=st.integers(0, 10), blocks=st.integers(1, 6), rows=st.integers(1, 3), seed=st.integers(0, 2**31))
def test_norm_scaled_and_inverse_exact_to_fp32(log_b, blocks, rows, seed):
    B = 1 << log_b
    x = torch.randn(rows, B * blocks, generator=torch.Generator().manual_seed(seed))
    y = hadamard(x, B, seed)
    assert y.shape == x.shape
    # H D / B is sqrt(B) times an orthonormal map: ||y|| = ||x|| / sqrt(B).
    torch.testing.assert_close(y.norm(dim=-1) * math.sqrt(B), x.norm(dim=-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(inverse_hadamard(y, B, seed), x, rtol=0, atol=1e-5 * x.abs().max().item())


@pytest.mark.parametrize("B", [2, 8, 32, 128])
def test_matches_dense_matrix_times_signs(B):
    x = torch.randn(3 * B, dtype=torch.float64)
    y = hadamard(x, B, seed=11).double()
    signs = hadamard(torch.eye(B), B, seed=11).double()[:, :].T  # columns = H D e_i
    H = _dense_hadamard(B) / B
    D = torch.diag(torch.linalg.solve(H, signs)[range(B), range(B)])  # recover D from H D / B
    assert set(D.diagonal().round().tolist()) <= {-1.0, 1.0}
    expected = (H @ D @ x.view(3, B).T).T.reshape(-1)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("B", [2, 16, 128, 1024])
@pytest.mark.parametrize("top", [1e37, 3e37, 3.4e38, torch.finfo(torch.float32).max])
def test_finite_inputs_up_to_the_fp32_max_never_overflow(B, top):
    # Equal values are the worst case of an unnormalized butterfly (its sums reach B * top).
    g = torch.Generator().manual_seed(B)
    x = torch.cat((torch.full((B,), top), (torch.rand(4 * B, generator=g) * 2 - 1) * top))
    y = hadamard(x, B, seed=3)
    assert torch.isfinite(y).all() and y.abs().max() <= top  # the forward never exceeds max|x|
    back = inverse_hadamard(y, B, seed=3)
    # Note: the round trip is exact to a few ulps, so at the fp32 max itself an output may round
    # up to inf: only the forward (what goes on the wire) is checked there.
    if top < torch.finfo(torch.float32).max:
        assert torch.isfinite(back).all()
        torch.testing.assert_close(back, x, rtol=0, atol=1e-5 * top)
    # Halving is exact, so values near the fp32 max are rounded exactly as the same values scaled
    # down by a power of two: no precision is lost at the top of the range.
    p2 = 2.0 ** -math.floor(math.log2(top))
    assert torch.equal(y * p2, hadamard(x * p2, B, seed=3))


def test_linear_so_partial_sums_add_in_the_transformed_domain():
    a, b = torch.randn(2, 4096)
    torch.testing.assert_close(hadamard(a, 128, 3) + hadamard(b, 128, 3), hadamard(a + b, 128, 3), atol=1e-5, rtol=0)


def test_seed_changes_signs_same_seed_same_result():
    x = torch.randn(1024)
    assert torch.equal(hadamard(x, 64, 1), hadamard(x, 64, 1))
    assert not torch.equal(hadamard(x, 64, 1), hadamard(x, 64, 2))


def test_smoothing_cuts_4bit_error_on_outliers():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1 << 16, generator=g)
    x[::64] *= 50  # outlier channels: every 64th feature is 50x larger
    spec = QuantSpec(bits=4, group_size=128)
    plain = (dequantize(quantize(x, spec)) - x).norm() / x.norm()
    y = hadamard(x, 128, 5)
    smoothed = (inverse_hadamard(dequantize(quantize(y, spec)), 128, 5) - x).norm() / x.norm()
    assert smoothed < plain / 2


def test_bad_shapes_are_clear_errors():
    with pytest.raises(ValueError, match="power of two"):
        hadamard(torch.randn(96), 48, 0)
    with pytest.raises(ValueError, match="multiple of block=64"):
        hadamard(torch.randn(100), 64, 0)
