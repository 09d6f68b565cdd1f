"""Randomized blockwise Walsh-Hadamard transform: orthonormal, invertible, fast, smoothing."""

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
    return H / math.sqrt(B)


@settings(deadline=None, max_examples=50)
@given(log_b=st.integers(0, 10), blocks=st.integers(1, 6), rows=st.integers(1, 3), seed=st.integers(0, 2**31))
def test_norm_preserved_and_inverse_exact_to_fp32(log_b, blocks, rows, seed):
    B = 1 << log_b
    x = torch.randn(rows, B * blocks, generator=torch.Generator().manual_seed(seed))
    y = hadamard(x, B, seed)
    assert y.shape == x.shape
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(inverse_hadamard(y, B, seed), x, rtol=0, atol=1e-5 * x.abs().max().item())


@pytest.mark.parametrize("B", [2, 8, 32, 128])
def test_matches_dense_matrix_times_signs(B):
    x = torch.randn(3 * B, dtype=torch.float64)
    y = hadamard(x, B, seed=11).double()
    signs = hadamard(torch.eye(B), B, seed=11).double()[:, :].T  # columns = H D e_i
    H = _dense_hadamard(B)
    D = torch.diag(torch.linalg.solve(H, signs)[range(B), range(B)])  # recover D from H D
    assert set(D.diagonal().round().tolist()) <= {-1.0, 1.0}
    expected = (H @ D @ x.view(3, B).T).T.reshape(-1)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


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
