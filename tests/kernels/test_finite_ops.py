"""torch.ops.sdpq.first_nonfinite (sdpq/csrc/finite.cpp) against torch.isfinite."""

import pytest
import torch

from sdpq.kernels import finite_ops

if not finite_ops.cpu_available():
    pytest.skip("the C++ kernel could not be built (see the CppBuildWarning)", allow_module_level=True)

first_nonfinite = torch.ops.sdpq.first_nonfinite
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _reference(tensors):
    return next((i for i, t in enumerate(tensors) if not torch.isfinite(t).all()), -1)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64], ids=str)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_finds_the_first_tensor_with_a_non_finite_value(dtype, bad):
    """Sizes across the 4096-value blocks of the scan, the bad value at the very end of its
    tensor, and extreme finite values (largest, smallest subnormal, -0) everywhere else."""
    info = torch.finfo(dtype)
    extremes = torch.tensor([info.max, -info.max, info.tiny, info.smallest_normal / 2, -0.0], dtype=dtype)
    ts = [torch.cat([torch.randn(n).to(dtype), extremes]) for n in (0, 1, 4090, 4096, 9000, 3)]
    assert first_nonfinite(ts) == -1
    for i in (5, 3, 0):
        ts[i][-1] = bad
        assert first_nonfinite(ts) == i == _reference(ts)


def test_empty_tensors_are_finite():
    assert first_nonfinite([torch.empty(0), torch.empty(0, 3, dtype=torch.bfloat16)]) == -1


def test_other_layouts_and_dtypes_take_torch_s_check():
    """A strided view (its bad value lies outside the view, then inside) and an integer tensor."""
    x = torch.zeros(8, 8)
    x[0, 1] = float("nan")
    assert first_nonfinite([x[:, ::2], torch.arange(5)]) == -1
    x[2, 2] = float("inf")
    assert first_nonfinite([torch.arange(5), x[:, ::2]]) == 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_agrees_with_torch_on_every_bit_pattern(dtype):
    """Every 16-bit pattern (bf16 / fp16), and for fp32 every exponent with random mantissas."""
    if dtype == torch.float32:
        bits = (torch.arange(256, dtype=torch.int32) << 23) | torch.randint(0, 1 << 23, (256,), dtype=torch.int32)
        values = torch.cat([bits, bits | (1 << 31)]).view(torch.float32)
    else:
        values = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    singles = list(values.split(1))
    got = [first_nonfinite([t]) for t in singles]
    assert got == [-1 if torch.isfinite(t).item() else 0 for t in singles]
