"""Speed steps of the GPU check: sdpq's AdamW against torch's fused AdamW, and what sdpq's
kernels add to a training step of a 1.3B- and a 7B-shaped model.

A transformer block here has 12 d^2 weights (attention 4 d^2, an MLP of width 4d: 8 d^2), as
the GPT shapes of sdpq.plan; its forward and backward run under bf16 autocast on fp32 weights, a
micro-batch of `tokens`. sdpq's share of a step is per block: the codec work of one rank of
2 nodes x 8 GPUs (gradient encode, the two reduce stages, the weight difference and its decode
into the reference) plus sdpq's AdamW on that rank's 1/16 of the block, over the block's
forward + backward. Communication is left out: this is what a user pays before any saving.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kernel_steps import codec_block
from .steps import Checks, Ctx
from .timing import device_time

__all__ = ["adamw_speed", "step_share", "Block"]

SHAPES = {"1.3B": (2048, 24), "7B": (4096, 32)}  # d_model, blocks
WORLD, PER_NODE = 16, 8


class Block(torch.nn.Module):
    """A pre-norm transformer block with 12 d^2 weights (no biases), causal attention."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d, bias=False), torch.nn.Linear(d, d, bias=False)
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d, bias=False), torch.nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.n2(x))))


def _block_weights(d: int, parts: int, dev) -> list[torch.Tensor]:
    """The shapes of one block's weights split `parts` ways along dim 0 (a rank's shard)."""
    return [torch.randn(rows // parts, cols, device=dev) for rows, cols in ((3 * d, d), (d, d), (4 * d, d), (d, 4 * d))]


def _fused_adamw(weights: list[torch.Tensor]) -> torch.optim.Optimizer:
    """torch's fused AdamW on fp32 copies of `weights` (fp32 gradients and states), gradients set."""
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=not params[0].is_cpu or None)


def _sdpq_adamw(weights: list[torch.Tensor]) -> torch.optim.Optimizer:
    """sdpq's AdamW (FP8 states, MCF master) on bf16 copies of `weights`, bf16 gradients set."""
    from ..optim import AdamW

    params = [torch.nn.Parameter(w.to(torch.bfloat16)) for w in weights]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return AdamW(params, lr=1e-4, weight_decay=0.1, states="fp8", master="mcf")


def adamw_speed(ctx: Ctx) -> dict:
    """sdpq's AdamW step against torch.optim.AdamW(fused=True) on two 1.3B-shaped blocks."""
    d = 64 if ctx.rehearse else 2048
    weights = _block_weights(d, 1, ctx.device) + _block_weights(d, 1, ctx.device)
    fused, ours = _fused_adamw(weights), _sdpq_adamw(weights)
    reps, launches = (1, 1) if ctx.rehearse else (5, 5)
    t_fused = device_time(fused.step, ctx, reps, launches)
    t_ours = device_time(ours.step, ctx, reps, launches)
    numel = sum(w.numel() for w in weights)
    figures = {
        "parameters": numel,
        "fused_adamw_ms": round(1e3 * t_fused, 3),
        "sdpq_adamw_ms": round(1e3 * t_ours, 3),
        "of_fused": round(t_ours / t_fused, 3),
        "sdpq_gb_s_at_16_4_b_per_param": round(16.4 * numel / t_ours / 1e9, 1),
    }
    c = Checks()
    c.add("both steps timed", t_fused > 0 and t_ours > 0)
    notes = ["goal on the GPU: of_fused <= 0.6 (sdpq moves ~16.4 B/param, fused fp32 AdamW ~28)"]
    return c.result(figures, notes)


def _forward_backward(d: int, tokens: int, dev, ctx: Ctx, blocks: int = 2) -> float:
    """Seconds of forward + backward of one block (the mean over `blocks` stacked blocks)."""
    seq = min(2048, tokens)
    model = torch.nn.Sequential(*(Block(d, max(1, d // 128)) for _ in range(blocks))).to(dev)
    x = torch.randn(tokens // seq, seq, d, device=dev, requires_grad=True)

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            y = model(x)
        y.float().square().mean().backward()

    return device_time(step, ctx, reps=1 if ctx.rehearse else 3, launches=1) / blocks


def step_share(ctx: Ctx) -> dict:
    """Per block of a 1.3B- and a 7B-shaped model: forward + backward, sdpq's codec and AdamW."""
    figures, c = {}, Checks()
    shapes = {"1.3B": (32, 24)} if ctx.rehearse else SHAPES  # rehearsal: the interpreter, one shape
    for name, (d, blocks) in shapes.items():
        tokens = 256 if ctx.rehearse else 16384  # e.g. 8 sequences of 2048 per GPU
        t_fb = _forward_backward(d, tokens, ctx.device, ctx)
        t_codec = device_time(codec_block(ctx.device, d, WORLD, WORLD // PER_NODE), ctx, 1 if ctx.rehearse else 3, 1)
        ours = _sdpq_adamw(_block_weights(d, WORLD, ctx.device))  # no fp32 copy: only ours is timed
        t_adamw = device_time(ours.step, ctx, 1 if ctx.rehearse else 3, 1 if ctx.rehearse else 5)
        share = (t_codec + t_adamw) / t_fb
        figures[name] = {
            "d_model": d,
            "tokens_per_gpu": tokens,
            "forward_backward_ms_per_block": round(1e3 * t_fb, 3),
            "codec_ms_per_block": round(1e3 * t_codec, 3),
            "adamw_ms_per_block": round(1e3 * t_adamw, 3),
            "share_of_compute": round(share, 4),
            "sdpq_ms_per_step": round(1e3 * (t_codec + t_adamw) * blocks, 2),
        }
        c.add(f"{name} timed", t_fb > 0 and t_codec > 0 and t_adamw > 0)
    notes = [
        f"one rank of {WORLD // PER_NODE} nodes x {PER_NODE} GPUs; goal on the GPU: share_of_compute <= 0.05 at 1.3B",
        "rehearsal: d_model 32 (the 1.3B row only) in the interpreter, the times mean nothing",
    ]
    return c.result(figures, notes)
