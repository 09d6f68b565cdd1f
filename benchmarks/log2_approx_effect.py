"""What an approximate log2 does to FP8 (E4M3, expanded) moment codes.

Compiled for a GPU, sdpq's fused AdamW takes log2 from the approximate instruction
(``lg2.approx.f32``: absolute error below 2^-22) instead of CUDA's math library. No GPU is
needed to bound the effect: this runs the PyTorch reference encode (``sdpq.quant.fp8``) once as
it is and once with every log2 result moved by a uniform error of up to 2^-22, on moment-like
tensors, and prints how many codes and group exponents k change and by how much the decoded
values move (relative to each group's largest value, beside the encode's own error).

    .venv/bin/python benchmarks/log2_approx_effect.py      # ~10 s on 2 cores
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from sdpq.quant import fp8

ERR = 2.0**-22  # lg2.approx.f32's absolute error bound (PTX ISA)


@contextlib.contextmanager
def noisy_log2(gen: torch.Generator):
    """Tensor.log2 / log2_ with a uniform error in [-ERR, ERR] added to each result."""
    log2, log2_ = torch.Tensor.log2, torch.Tensor.log2_

    def noisy(t):
        y = log2(t)
        return y + (torch.rand(y.shape, generator=gen) * 2 - 1) * ERR

    torch.Tensor.log2 = noisy
    torch.Tensor.log2_ = lambda t: t.copy_(noisy(t))
    try:
        yield
    finally:
        torch.Tensor.log2, torch.Tensor.log2_ = log2, log2_


def compare(x: torch.Tensor, gen: torch.Generator, group: int = 128) -> dict:
    exact = fp8.quantize_fp8(x, group_size=group)
    with noisy_log2(gen):
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
    print("tensor            codes equal   k equal   largest move / group absmax   (encode's own error)")
    for name, x in tensors.items():
        r = compare(x, gen)
        print(
            f"{name:16s}  {r['codes_equal']:.6f}   {r['k_equal']:.6f}   {r['max_move']:.2e}"
            f"                      ({r['encode_error']:.2e})"
        )


if __name__ == "__main__":
    main()
