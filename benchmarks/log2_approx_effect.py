"""What approximate log2 and exp2 do to FP8 (E4M3, expanded) moment codes.

Compiled for a GPU, sdpq's fused AdamW takes log2 and exp2 from the approximate instructions
(``lg2.approx.f32``: error below 2^-22 absolute for x in [0.5, 2] and 2^-22 of the result
elsewhere, about 2 ulp; ``ex2.approx.f32``: about 2^-22 of the result) where it used CUDA's math
library (log2 within 1 ulp; its exp2 was already the approximate instruction). No GPU is needed
to compare the two: this runs the PyTorch reference encode (``sdpq.quant.fp8``) as it is and
with every log2 and exp2 result moved by a uniform error up to each model's bound, on
moment-like tensors, and prints how many codes and group exponents k change and how far the
decoded values move, relative to each group's largest value (the GPU check's ``adamw`` step
allows 2^-3 of it and 0.1% of the codes changed), beside the encode's own error.

    .venv/bin/python benchmarks/log2_approx_effect.py      # ~5 s on 2 cores
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from sdpq.quant import fp8

EXP2_REL = 2.0**-22  # ex2.approx.f32, in both models
LOG2_MODELS = {  # the bound of a log2 result y: rel * max(1, |y|)
    "math library log2 (1 ulp)": 2.0**-23,
    "approximate log2 (2 ulp)": 2.0**-22,
}


@contextlib.contextmanager
def perturbed_log2_exp2(gen: torch.Generator, log2_rel: float):
    """Tensor.log2 / log2_ / exp2 / exp2_ with a uniform error up to the model's bounds."""
    log2, log2_, exp2, exp2_ = torch.Tensor.log2, torch.Tensor.log2_, torch.Tensor.exp2, torch.Tensor.exp2_

    def uniform(y):  # in [-1, 1); 0 where y is not finite (log2 0 = -inf stays -inf)
        return torch.where(y.isfinite(), torch.rand(y.shape, generator=gen) * 2 - 1, 0.0)

    def approx_log2(t):
        y = log2(t)
        return y + uniform(y) * log2_rel * y.abs().clamp(min=1.0).nan_to_num(posinf=1.0)

    def approx_exp2(t):
        y = exp2(t)
        return y * (1 + uniform(y) * EXP2_REL)

    torch.Tensor.log2, torch.Tensor.log2_ = approx_log2, lambda t: t.copy_(approx_log2(t))
    torch.Tensor.exp2, torch.Tensor.exp2_ = approx_exp2, lambda t: t.copy_(approx_exp2(t))
    try:
        yield
    finally:
        torch.Tensor.log2, torch.Tensor.log2_, torch.Tensor.exp2, torch.Tensor.exp2_ = log2, log2_, exp2, exp2_


def compare(x: torch.Tensor, gen: torch.Generator, log2_rel: float, group: int = 128) -> dict:
    exact = fp8.quantize_fp8(x, group_size=group)
    with perturbed_log2_exp2(gen, log2_rel):
        approx = fp8.quantize_fp8(x, group_size=group)
    de, da = fp8.dequantize_fp8(exact), fp8.dequantize_fp8(approx)
    amax = x.view(-1, group).abs().amax(1, keepdim=True)
    return {
        "codes_equal": (exact.codes == approx.codes).float().mean().item(),
        "k_equal": (exact.k == approx.k).float().mean().item(),
        "max_move": ((de - da).view(-1, group).abs() / amax).max().item(),
        "encode_error": ((de - x).view(-1, group).abs() / amax).max().item(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=1 << 20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    g = torch.randn(1, args.numel, generator=gen) * 1e-3
    heavy = torch.randn(1, args.numel, generator=gen) * torch.rand(1, args.numel, generator=gen).pow(8)
    tensors = {"m (normal)": g, "v = g^2": g * g, "v, heavy-tailed": heavy * heavy}
    print(f"{'model':28s} {'tensor':16s} codes equal  k equal   largest move / group absmax  (encode's own error)")
    for model, rel in LOG2_MODELS.items():
        for name, x in tensors.items():
            r = compare(x, gen, rel)
            print(
                f"{model:28s} {name:16s} {r['codes_equal']:.6f}     {r['k_equal']:.4f}    {r['max_move']:.2e}"
                f"                     ({r['encode_error']:.2e})"
            )


if __name__ == "__main__":
    main()
