"""The fused AdamW step (FP8 E4M3 moments + MCF master) against sdpq.optim.AdamW's PyTorch path.

log2/exp2 differ between the kernel's math library and torch, so the comparison is within
rounding: weights within a bf16-pair ulp of the update, moments within one E4M3 step.
"""

import os

import pytest
import torch

pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from sdpq.kernels._launch import libdevice_for  # noqa: E402
from sdpq.kernels.adamw import _e4m3_table, _encode_e4m3, adamw_fp8_mcf_step  # noqa: E402
from sdpq.optim import AdamW, states  # noqa: E402
from sdpq.optim.layout import rows  # noqa: E402

DEV = "cuda" if CUDA else "cpu"


@triton.jit
def _enc(x_ptr, out_ptr, n, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0)
    tl.store(out_ptr + i, _encode_e4m3(x, LIBDEVICE).to(tl.uint8), mask=i < n)


def test_e4m3_encoding_is_torch_rounding():
    """Every code, every midpoint between neighbours and values around them encode as torch does."""
    vals = _e4m3_table(torch.device(DEV))
    finite = vals[vals.isfinite()]
    pos = finite[finite >= 0].unique()
    mids = (pos[1:] + pos[:-1]) / 2
    x = torch.cat(
        [finite, mids, -mids, mids * (1 + 2**-20), mids * (1 - 2**-20), torch.tensor([float("nan")], device=DEV)]
    )
    out = torch.empty(x.numel(), dtype=torch.uint8, device=DEV)
    _enc[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024, LIBDEVICE=libdevice_for(x))
    want = x.to(torch.float8_e4m3fn).view(torch.uint8)
    nan = x.isnan()
    assert torch.equal(out[~nan], want[~nan]) and out[nan].item() in (0x7F, 0xFF)


@pytest.mark.parametrize("shape", [(3, 256), (2, 300), (1, 128 * 3 + 5), (2, 2048 * 2 + 300)])  # last: 3 tiles a row
def test_fused_step_matches_pytorch_path(shape):
    torch.manual_seed(0)
    p_ref = torch.nn.Parameter(torch.randn(shape, device=DEV).to(torch.bfloat16))
    p_ker = torch.nn.Parameter(p_ref.detach().clone())
    opts = [
        AdamW([p], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, states="fp8", master="mcf") for p in (p_ref, p_ker)
    ]
    for step in range(5):
        g = torch.randn(shape, device=DEV) * (1 + step)
        g[0, :7] = 0.0  # exact zeros inside a group
        p_ref.grad = g.to(torch.bfloat16)
        p_ker.grad = g.to(torch.bfloat16)
        opts[0].step()
        # The kernel path, driven with the optimizer's own state tensors.
        st = opts[1]._state_for(p_ker, opts[1].param_groups[0])
        st["step"] += 1

        def moment(name, st=st):
            codes = rows(st[name + "_codes"])
            return (codes,) + tuple(st[name + s].reshape(codes.shape[0], -1) for s in ("_scale", "_k", "_gm"))

        adamw_fp8_mcf_step(
            rows(p_ker.data),
            rows(st["master_lo"]),
            rows(p_ker.grad),
            moment("exp_avg"),
            moment("exp_avg_sq"),
            lr=1e-2,
            b1=0.9,
            b2=0.95,
            eps=1e-8,
            wd=0.1,
            step=step + 1,
            group_size=128,
        )
    sr, sk = opts[0].state[p_ref], opts[1].state[p_ker]
    w_ref = p_ref.detach().float() + sr["master_lo"].float()
    w_ker = p_ker.detach().float() + sk["master_lo"].float()
    # 5 steps of size <= ~lr: the pair holds ~16 bits, so differences stay far below lr.
    assert (w_ref - w_ker).abs().max() < 1e-2 * 2**-6
    for name in ("exp_avg", "exp_avg_sq"):
        a = states.decode(sr, name)
        b = states.decode(sk, name)
        rel = ((a - b).abs() / a.abs().clamp_min(1e-30))[a != 0]
        assert rel.max() <= 2**-3 + 1e-6  # at most one E4M3 step (3 mantissa bits)
        # Nearly always the same code: then only the metadata's fp32 log2/exp2 rounding differs.
        assert (rel < 1e-5).float().mean() > 0.9
        assert torch.equal(a == 0, b == 0)
