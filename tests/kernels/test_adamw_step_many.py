"""torch.ops.sdpq.adamw_step_many: adamw_step for every parameter of a list in one call."""

import pytest
import torch

from sdpq.kernels import adamw_ops

if not adamw_ops.cpu_available():
    pytest.skip("the C++ AdamW kernel could not be built (see the CppBuildWarning)", allow_module_level=True)

G = 16
FP8 = ("e4m3", "e5m2")


def _moment(fmt, rows, cols, gen):
    if fmt in FP8:  # a valid state: codes of small values with unit metadata
        groups = -(-cols // G)
        return [torch.randint(0, 0x50, (rows, cols), dtype=torch.uint8, generator=gen)] + [
            torch.ones(rows, groups) for _ in range(3)
        ]
    if fmt == "pair":
        return [torch.rand(rows, cols, generator=gen).to(torch.bfloat16), torch.zeros(rows, cols, dtype=torch.bfloat16)]
    return [torch.rand(rows, cols, generator=gen).to(torch.float32 if fmt == "fp32" else torch.bfloat16)]


def _param(m_format, v_format, shape, mcf, seed):
    """One parameter's arguments of adamw_step (param, param_lo, grad, exp_avg, exp_avg_sq)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen).to(torch.bfloat16 if mcf else torch.float32)
    lo = torch.zeros_like(w) if mcf else None
    grad = torch.randn(shape, generator=gen).to(torch.bfloat16)
    return [w, lo, grad, _moment(m_format, *shape, gen), _moment(v_format, *shape, gen), m_format, v_format]


LAYOUTS = [
    ("e4m3", "e4m3", (3, 40)),
    ("bf16", "pair", (2, 33)),
    ("fp32", "fp32", (1, 7)),
    ("e4m3", "e5m2", (4, 16)),
    ("fp32", "e4m3", (0, 5)),
]
HYPER = (1e-3, 0.9, 0.95, 1e-8, 0.1)


def _many_args(params, steps):
    mcf = params[0][1] is not None
    return (
        [p[0] for p in params],
        [p[1] for p in params] if mcf else [],
        [p[2] for p in params],
        [t for p in params for t in p[3]],
        [t for p in params for t in p[4]],
        [p[5] for p in params],
        [p[6] for p in params],
        *HYPER,
        steps,
        G,
    )


@pytest.mark.parametrize("mcf", [True, False], ids=["mcf", "native"])
def test_equals_one_call_per_parameter(mcf):
    """Mixed formats, shapes (an empty one included) and step numbers: bitwise the same states
    and weights as adamw_step parameter by parameter."""
    one = [_param(*layout, mcf, seed) for seed, layout in enumerate(LAYOUTS)]
    many = [_param(*layout, mcf, seed) for seed, layout in enumerate(LAYOUTS)]
    steps = [1, 5, 2, 30, 7]
    for p, step in zip(one, steps):
        torch.ops.sdpq.adamw_step(*p, *HYPER, step, G)
    torch.ops.sdpq.adamw_step_many(*_many_args(many, steps))
    for a, b in zip(one, many):
        tensors = lambda p: [p[0]] + ([p[1]] if mcf else []) + p[3] + p[4]  # noqa: E731
        assert all(torch.equal(x, y) for x, y in zip(tensors(a), tensors(b)))
    assert not torch.equal(one[0][0], _param(*LAYOUTS[0], mcf, 0)[0])  # the step did something


def test_opcheck():
    params = [_param(*layout, True, seed) for seed, layout in enumerate(LAYOUTS[:2])]
    torch.library.opcheck(
        torch.ops.sdpq.adamw_step_many.default,
        _many_args(params, [1, 2]),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )


def test_rejects_lists_that_do_not_match():
    params = [_param(*layout, True, seed) for seed, layout in enumerate(LAYOUTS[:2])]
    args = list(_many_args(params, [1, 2]))
    with pytest.raises(RuntimeError, match="2 params need as many grads"):
        torch.ops.sdpq.adamw_step_many(*args[:-2], [1], G)
    args[4] = args[4][:-1]  # the pair v of the second parameter lacks its low half
    with pytest.raises(RuntimeError, match="parameter 1 needs more exp_avg / exp_avg_sq tensors"):
        torch.ops.sdpq.adamw_step_many(*args)
    args = list(_many_args(params, [1, 2]))
    args[3] = args[3] + [torch.zeros(1)]
    with pytest.raises(RuntimeError, match="more exp_avg / exp_avg_sq tensors than the formats take"):
        torch.ops.sdpq.adamw_step_many(*args)
