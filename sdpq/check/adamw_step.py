"""The AdamW step of the GPU check: the fused FP8 + MCF kernel against sdpq's PyTorch path over
3 steps, odd shapes, more rows than CUDA's grid cap and 64 MiB-1 GiB of parameters."""

from __future__ import annotations

from typing import Any

import torch

from .kernel_steps import large_sizes
from .steps import Checks, Ctx

__all__ = ["adamw"]


def _e4m3_ordinal(codes: torch.Tensor) -> torch.Tensor:
    """E4M3 code bytes -> signed positions on the number line (neighbouring values differ by 1)."""
    c = codes.view(torch.uint8).int()
    mag = c & 0x7F
    return torch.where(c >= 0x80, -mag, mag)


def _adamw_pair(shape, dev, lr=1e-2, steps=3, seed=0) -> dict:
    """The kernel step against the PyTorch path over `steps` steps on the same gradients:
    weight differences (in lr), and per moment the groups whose expansion power k differs
    and how many E4M3 codes apart the codes are where it agrees."""
    from ..optim import AdamW, states
    from ..quant.fp8 import grouped

    g = torch.Generator(device=dev).manual_seed(seed)
    w0 = torch.randn(shape, device=dev, generator=g).to(torch.bfloat16)
    ps = [torch.nn.Parameter(w0.clone()) for _ in range(2)]
    opts = [AdamW([p], lr=lr, betas=(0.9, 0.95), weight_decay=0.1, states="fp8", master="mcf") for p in ps]
    opts[1].kernels_enabled = False  # the reference
    for step in range(steps):
        grad = (torch.randn(shape, device=dev, generator=g) * (1 + step)).to(torch.bfloat16)
        grad.view(-1)[:7] = 0.0
        for p, o in zip(ps, opts):
            p.grad = grad.clone()
            o.step()
    s_k, s_r = opts[0].state[ps[0]], opts[1].state[ps[1]]
    G = opts[0].param_groups[0]["group_size"]
    w_k = ps[0].detach().float() + s_k["master_lo"].float()
    w_r = ps[1].detach().float() + s_r["master_lo"].float()
    dw = (w_k - w_r).abs() / lr
    out: dict[str, Any] = {
        "weight_diff_over_lr": float(dw.max()),
        "weights_off_share": float((dw > 2**-6).float().mean()),  # beyond the tests' bound
    }
    for name in ("exp_avg", "exp_avg_sq"):
        # k is the group's one discrete choice (gm and scale carry log2/exp2 rounding, times k)
        same_k = s_r[name + "_k"].reshape(-1) == s_k[name + "_k"].reshape(-1)
        steps_apart = (_e4m3_ordinal(s_r[name + "_codes"]) - _e4m3_ordinal(s_k[name + "_codes"])).abs()
        groups = grouped(steps_apart, G).reshape(-1, G)  # the moments' groups: rows, zero padded
        a, b = states.decode(s_r, name), states.decode(s_k, name)
        rel = ((a - b).abs() / a.abs().clamp_min(1e-30))[a != 0]
        # differences against each group's largest magnitude: a one-code flip of a tiny element
        # (which moves the group's minimum, hence gm and scale) is large relative to itself only
        pa, pb = grouped(a, G).reshape(-1, G), grouped(b, G).reshape(-1, G)
        of_max = ((pa - pb).abs().amax(1) / pa.abs().amax(1).clamp_min(1e-30)).max()
        out[name] = {
            "groups": same_k.numel(),
            "k_differs": int((~same_k).sum()),
            "codes_equal_share": float((steps_apart == 0).float().mean()),
            "max_code_steps_same_k": int(groups[same_k].max()) if bool(same_k.any()) else 0,
            "value_rel_diff_max": float(rel.max()) if rel.numel() else 0.0,
            "diff_of_group_max": float(of_max),
            "zero_mismatch": int(((a == 0) != (b == 0)).sum()),
        }
    return out


def adamw(ctx: Ctx) -> dict:
    c, figures = Checks(), {}
    shapes = {"3x256": (3, 256), "2x300": (2, 300), "1x389": (1, 389)}
    shapes["rows_over_65535"] = (700, 32) if ctx.rehearse else (70000, 32)
    for name, n in large_sizes(ctx).items():
        shapes[name] = (n // 1024, 1024)  # n bf16 weights: half the bytes the name says, fp32 master
    for name, shape in shapes.items():
        f = figures[name] = _adamw_pair(shape, ctx.device)
        # Note: a code one E4M3 step away (a rounding boundary met by last-bit differences) is
        # a step of the decoded value raised to 1/k, far more than 1/8 where k < 1 (a group
        # spanning > 2^16): hence bounds in code steps, and a share for the weights.
        c.add(
            f"adamw {name} weights",
            f["weights_off_share"] <= 1e-4,
            f"{f['weights_off_share']:.2e} beyond 2^-6 lr (max {f['weight_diff_over_lr']:.2e} lr)",
        )
        for mom in ("exp_avg", "exp_avg_sq"):
            m = f[mom]
            c.add(
                f"adamw {name} {mom}: within one top E4M3 step of each group's largest value",
                m["diff_of_group_max"] <= 2**-3 and m["codes_equal_share"] >= 0.999,
                f"{m['diff_of_group_max']:.2e} of the group max, {m['codes_equal_share']:.5f} codes equal, "
                f"{m['k_differs']}/{m['groups']} groups' k differ, {m['max_code_steps_same_k']} code steps max",
            )
    notes = [
        "a code at a rounding boundary may land one step away; when that element is the group's smallest, "
        "gm and scale move and every code of the group shifts while the values stay close: "
        "hence the bound against each group's largest value",
    ]
    if ctx.rehearse:
        notes.append("rows_over_65535 is 700 x 32 in rehearsal (the interpreter does not enforce CUDA's grid caps)")
    return c.result(figures, notes)
