"""The C++ CPU codec (torch.ops.sdpq.encode_rows / decode_rows / reduce_rows, sdpq/csrc/codec.cpp)
against the PyTorch reference of sdpq.quant.rows.

Nearest rounding must agree bitwise with the reference: same fp32 operations in the same order,
for every layout (bits, group size, scale dtype, Hadamard block, segments, input dtype, short
last groups, inf/NaN groups, any number of summed rows). Stochastic rounding draws from a
counter-based stream instead of torch's generator: it is held to the quantizer's bound (less
than one step from the value, on the two neighbouring codes) and to unbiasedness, and must not
depend on the number of threads.

The operators are called directly, next to the reference functions. (The collectives' tests in
tests/comm run the same kernels through sdpq.kernels, which calls them for CPU tensors.)
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from extremes import top_of_range_rows

from sdpq.kernels import codec_ops
from sdpq.quant import QuantSpec
from sdpq.quant.groupwise import dequantize
from sdpq.quant.hadamard import signs
from sdpq.quant.rows import decode_rows_ref as _decode_rows_ref
from sdpq.quant.rows import encode_rows_ref as _encode_rows_ref
from sdpq.quant.rows import reduce_rows_ref as _reduce_rows_ref
from sdpq.quant.wire import unpack

if not codec_ops.cpu_available():
    pytest.skip("the C++ codec could not be built (see the CppBuildWarning)", allow_module_level=True)

OPS = torch.ops.sdpq


def _args(spec: QuantSpec) -> tuple:
    return spec.bits, spec.group_size, spec.rounding == "stochastic", spec.scale_dtype == torch.bfloat16


def _signs(h):
    return None if h is None else signs(h[0], h[1], torch.device("cpu"))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise-equal values, NaN == NaN."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.nan_to_num(123.0), b.nan_to_num(123.0))


def _data(rows: int, n: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g) * torch.logspace(-3, 3, n)  # groups of very different scales
    x[0, : n // 3] = 0  # all-zero groups
    return x.to(dtype)


SPECS = [
    QuantSpec(4, 2048),
    QuantSpec(8, 128),
    QuantSpec(4, 128, scale_dtype=torch.bfloat16),
    QuantSpec(8, 64, scale_dtype=torch.bfloat16),
    QuantSpec(8, 16),
    QuantSpec(4, 6),
    QuantSpec(2, 2048),  # below four bits: 4 codes a byte; 8 codes in 3 bytes
    QuantSpec(3, 128),
    QuantSpec(3, 64, scale_dtype=torch.bfloat16),
    QuantSpec(2, 8),
]


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("hadamard", [None, (16, 4), (64, 3), (128, 5)], ids=str)
@pytest.mark.parametrize("segments", [1, 2])
def test_encode_bitwise(spec, dtype, hadamard, segments):
    n = 2 * 3 * 2048 if segments > 1 else 3 * 2048 + (0 if hadamard else 100)  # short last group
    if segments > 1 and n % spec.group_size:
        pytest.skip("segmented rows are whole groups")
    x = _data(4, n, seed=n + segments, dtype=dtype)
    x[2, 7] = float("inf")
    x[3, 5000] = float("nan")
    for ref in (None, _data(4, n, seed=1, dtype=dtype)) if segments == 1 else (None,):
        got = OPS.encode_rows(x, ref, segments, *_args(spec), _signs(hadamard), 1, 0)
        want = _encode_rows_ref(x, spec, ref, segments, hadamard, 1, None)
        assert torch.equal(got[0], want[0])  # the wire bytes: codes and scales
        assert _same(got[1], want[1].reshape(got[1].shape))  # the kept fp32 rows
        assert bool(got[2]) == bool(want[2]) is True


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("add", [False, True])
def test_decode_bitwise(spec, out_dtype, add):
    n = 3 * 2048 + 36
    x = _data(3, n, seed=7)
    x[1, 100] = float("nan")
    wire = _encode_rows_ref(x, spec, None, 1, None, None, None)[0]
    base = _data(3, n, seed=8, dtype=out_dtype)
    got, want = base.clone(), base.clone()
    OPS.decode_rows(wire, n, spec.bits, spec.group_size, spec.scale_dtype == torch.bfloat16, got, add)
    _decode_rows_ref(wire, spec, n, want, add)
    assert _same(got, want)


def test_reduce_requantize_rows_that_do_not_start_on_a_group():
    """Re-encoded rows of 2064 values (not a multiple of the received 128-groups): a 32-block of
    the second row can straddle two received groups, and must take each group's scale."""
    spec, enc, n, rows = QuantSpec(8, 128), QuantSpec(4, 32), 2 * 2064, 2
    wire = _encode_rows_ref(_data(rows, n, seed=3), spec, None, 1, None, None, None)[0]
    own = _data(1, n, seed=4).reshape(-1)
    for own_row in (0, 1):
        got = OPS.reduce_rows(
            wire, n, *_args(spec)[:2], False, own, own_row, torch.tensor(False), None, *_args(enc), n // 2, 1, 0
        )
        want = _reduce_rows_ref(wire, spec, n, own, own_row, torch.zeros(1), None, enc, n // 2, 1, None)
        assert torch.equal(got[0], want[0]) and _same(got[1], want[1])


@pytest.mark.parametrize("rows", [1, 2, 5])  # 5: torch's sum(0) would reorder; the row order is the contract
@pytest.mark.parametrize("bad", [False, True])
@pytest.mark.parametrize("hadamard", [None, (16, 1), (128, 2)], ids=str)
# groups that hold a 128-block (two rows are then summed in one pass) and groups it spans
@pytest.mark.parametrize(
    "spec", [QuantSpec(8, 128), QuantSpec(4, 2048), QuantSpec(4, 32), QuantSpec(3, 128), QuantSpec(2, 32)], ids=str
)
def test_reduce_bitwise(rows, bad, hadamard, spec):
    n = 4 * 2048
    wire = _encode_rows_ref(_data(rows, n, seed=rows), spec, None, 1, None, None, None)[0]
    own = _data(1, n, seed=11).reshape(-1)
    flag = torch.tensor(bad)
    bad_f = torch.where(flag, float("nan"), 0.0).reshape(1)
    for own_row in {0, rows - 1}:
        got = OPS.reduce_rows(
            wire, n, *_args(spec)[:2], False, own, own_row, flag, _signs(hadamard), 0, 2, False, False, n, -1, 0
        )[0]
        assert _same(got, _reduce_rows_ref(wire, spec, n, own, own_row, bad_f, hadamard, None, 0, -1, None))
    enc = QuantSpec(spec.bits if spec.bits < 4 else 4, 128)  # the inter-node stage's width
    for own_seg in (0, 1):
        got = OPS.reduce_rows(wire, n, *_args(spec)[:2], False, own, 0, flag, None, *_args(enc), n // 2, own_seg, 0)
        want = _reduce_rows_ref(wire, spec, n, own, 0, bad_f, None, enc, n // 2, own_seg, None)
        assert torch.equal(got[0], want[0]) and _same(got[1], want[1]) and bool(got[2]) == bool(want[2]) == bad


def test_stochastic_rounding_bound_and_unbiased():
    """Codes are floor(y) or floor(y) + 1 of y = v / scale, and their mean over many seeds is y."""
    spec = QuantSpec(8, 128, rounding="stochastic")
    x = _data(1, 4096, seed=3)
    draws = []
    for seed in range(200):
        wire = OPS.encode_rows(x, None, 1, *_args(spec), None, -1, seed)[0]
        draws.append(dequantize(unpack(wire, spec, x.shape[1])).reshape(-1))
    draws = torch.stack(draws)
    scales = x.reshape(-1, 128).abs().amax(1, keepdim=True) / 127
    step = scales.expand(-1, 128).reshape(-1)
    diff = (draws - x.reshape(-1)).abs()
    zero = step == 0  # all-zero groups decode to exact zeros
    assert (diff[:, zero] == 0).all() and (diff[:, ~zero] < step[~zero] * (1 + 1e-6)).all()  # within one step
    assert not torch.equal(draws[0], draws[1])  # the seed matters
    err = ((draws.mean(0) - x.reshape(-1)) / step)[~zero]  # mean error in steps: ~N(0, 0.5 / sqrt(200))
    assert err.abs().mean() < 0.05 and err.mean().abs() < 0.01


def test_results_do_not_depend_on_the_thread_count():
    spec = QuantSpec(4, 128, rounding="stochastic")
    x, own = _data(4, 1 << 17, seed=5), _data(1, 1 << 18, seed=6).reshape(-1)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            wire = OPS.encode_rows(x, None, 2, *_args(spec), _signs((128, 1)), 0, 42)[0]
            red = OPS.reduce_rows(
                wire, 1 << 18, *_args(spec)[:2], False, own, 0, torch.tensor(False), None, *_args(spec), 1 << 17, 0, 9
            )[0]
            outs.append((wire, red))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_operators_pass_opcheck():
    """Schemas, fake (meta) implementations and aliasing as torch.library checks them."""
    x, ref = _data(2, 512, seed=1), _data(2, 512, seed=2)
    wire = OPS.encode_rows(x, ref, 1, 4, 128, False, False, None, -1, 0)[0]
    torch.library.opcheck(OPS.encode_rows, (x, ref, 1, 4, 128, False, False, None, -1, 0))
    torch.library.opcheck(OPS.encode_rows, (x, None, 2, 8, 128, False, True, _signs((128, 1)), 0, 0))
    torch.library.opcheck(OPS.decode_rows, (wire, 512, 4, 128, False, torch.zeros(2, 512), True))
    torch.library.opcheck(
        OPS.reduce_rows,
        (wire, 512, 4, 128, False, torch.randn(512), 0, torch.tensor(False), None, 8, 128, False, False, 256, 1, 0),
    )


def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "TRITON_INTERPRET": "0", "SDPQ_TRITON": "0", **env},
    )


def test_disabled_cpp_path_falls_back_to_the_reference():
    res = _run(
        """
        import warnings, torch
        warnings.simplefilter("error")  # an explicit opt-out is not warned about
        from sdpq import kernels as F
        from sdpq.quant import QuantSpec, rows as R
        x = torch.randn(2, 4096)
        assert not F.uses_cpp(x)
        got = F.encode_rows(x, QuantSpec(4, 128))[0]
        assert torch.equal(got, R.encode_rows_ref(x, QuantSpec(4, 128), None, 1, None, None, None)[0])
        print("ok")
    """,
        SDPQ_CPP="0",
    )
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr


def test_missing_compiler_warns_once_and_falls_back(tmp_path):
    res = _run(
        """
        import warnings, torch
        from sdpq.kernels.native import CppBuildWarning
        from sdpq import kernels as F
        from sdpq.quant import QuantSpec, rows as R
        x = torch.randn(2, 4096)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for _ in range(3):
                got = F.encode_rows(x, QuantSpec(4, 128))[0]
        built = [m for m in w if issubclass(m.category, CppBuildWarning)]
        assert len(built) == 1 and "could not be built" in str(built[0].message), [str(m.message) for m in w]
        assert torch.equal(got, R.encode_rows_ref(x, QuantSpec(4, 128), None, 1, None, None, None)[0])
        print("ok")
    """,
        SDPQ_CACHE=str(tmp_path),
        CXX="/nonexistent/c++",
    )
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr


@pytest.mark.parametrize("spec", [QuantSpec(4, 128), QuantSpec(8, 64, scale_dtype=torch.bfloat16)], ids=str)
def test_decode_rows_inverse_hadamard_is_decode_then_inverse(spec):
    """The fused decode + inverse transform (reduce_rows of each row and a zero row) gives the two
    passes' bits: the reference decoding and sdpq.quant.hadamard.inverse_hadamard."""
    from sdpq.kernels import decode_rows_inverse_hadamard
    from sdpq.quant.hadamard import inverse_hadamard

    numel, had = 4096, (64, 9)
    x = torch.randn(3, numel, generator=torch.Generator().manual_seed(2))
    x[1, :200] = 0  # zero groups: -0.0 / +0.0 must not matter
    wire = _encode_rows_ref(x, spec, None, 1, had, None, None)[0]
    want = inverse_hadamard(dequantize(unpack(wire, spec, numel)), *had)
    got = decode_rows_inverse_hadamard(wire, spec, numel, had)
    assert torch.equal(got, want)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_bf16_scales_at_the_top_of_the_fp32_range_match_reference(bits):
    """Groups within 2^-8 of the fp32 maximum: the capped bf16 scale (sdpq.quant.groupwise's
    Note) is the reference's, bitwise, and every value decodes finite."""
    spec = QuantSpec(bits, 128, scale_dtype=torch.bfloat16)
    x = top_of_range_rows(bits)
    got = OPS.encode_rows(x, None, 1, *_args(spec), None, 1, 0)
    want = _encode_rows_ref(x, spec, None, 1, None, 1, None)
    assert torch.equal(got[0], want[0])
    out = torch.empty(2, 512)
    OPS.decode_rows(got[0], 512, *_args(spec)[:2], _args(spec)[3], out, False)
    assert torch.isfinite(out).all()
