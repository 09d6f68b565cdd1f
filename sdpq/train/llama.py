"""A small byte-level Llama-shaped decoder, the second model `python -m sdpq.train --model llama` trains.

Llama's choices on GPT's skeleton (sdpq/train/model.py): RMSNorm with a weight and no bias,
attention and MLP projections without biases, rotary position embeddings (or, as an option,
GPT's learned ones), grouped-query attention, a SwiGLU MLP and an output head untied from the
embedding (Llama 3's choice; `tie_embeddings` ties them). It has what the training backends use
of GPT: `forward(idx, targets=None)` returns the logits, or the mean cross-entropy (computed in
fp32) when given targets; `blocks` is the ModuleList the FSDP2 backend shards one by one; and
`num_params()`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LlamaConfig", "Llama", "POSITIONS", "default_ffn_hidden", "rotary_tables", "apply_rotary"]

POSITIONS = ("rotary", "learned")


def default_ffn_hidden(d_model: int) -> int:
    """SwiGLU's hidden width as Llama sizes it: 8/3 * d_model (two thirds of GPT's 4 * d_model, so
    that its three matrices hold about as many parameters as GPT's two), rounded up to a multiple
    of 64 (matrix shapes the hardware tiles well; Llama's own code rounds to 256, which at this
    scale would move the width far from 8/3). d_model 256 -> 704, 4096 -> 10944."""
    return -(-8 * d_model // (3 * 64)) * 64


@dataclass(frozen=True)
class LlamaConfig:
    """The Llama-shaped model's shape. n_kv_head None = n_head (no grouped-query attention);
    ffn_hidden None = default_ffn_hidden(d_model); both are filled in at construction."""

    kind: ClassVar[str] = "llama"  # the --model name (GPTConfig's is "gpt")
    vocab_size: int = 256  # bytes
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int | None = None
    d_model: int = 256
    ffn_hidden: int | None = None
    positions: str = "rotary"  # or "learned" (GPT's position embedding table)
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0  # rotary base: Llama 2's (Llama 3 uses 500000 for its long contexts)

    def __post_init__(self) -> None:
        kv = self.n_head if self.n_kv_head is None else self.n_kv_head
        object.__setattr__(self, "n_kv_head", kv)
        if self.ffn_hidden is None and isinstance(self.d_model, int):
            object.__setattr__(self, "ffn_hidden", default_ffn_hidden(self.d_model))
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "n_kv_head", "d_model", "ffn_hidden"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig.{name}: {value!r}; allowed: an integer >= 1")
        if self.d_model % self.n_head:
            raise ValueError(f"LlamaConfig.d_model: {self.d_model} must be divisible by n_head={self.n_head}")
        if self.n_head % kv:
            raise ValueError(
                f"LlamaConfig.n_kv_head: {kv}; allowed: a divisor of n_head={self.n_head} "
                "(each key/value head serves n_head / n_kv_head query heads)"
            )
        if self.positions not in POSITIONS:
            raise ValueError(f"LlamaConfig.positions: {self.positions!r}; allowed: 'rotary', 'learned'")
        head_dim = self.d_model // self.n_head
        if self.positions == "rotary" and head_dim % 2:
            raise ValueError(
                f"LlamaConfig.d_model: rotary embeddings rotate pairs of dimensions, so the head dimension "
                f"d_model / n_head = {head_dim} must be even"
            )
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"LlamaConfig.tie_embeddings: {self.tie_embeddings!r}; allowed: True, False")
        for name in ("norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"LlamaConfig.{name}: {value!r}; allowed: a number > 0")


def rotary_tables(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of the rotary angles, [seq_len, head_dim / 2] in fp32: position t turns the pair
    (i, i + head_dim / 2) by t * theta^(-2i / head_dim)."""
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x` [..., T, head_dim] rotated pairwise by the tables' angles (the half-split pairing),
    computed in fp32 and returned in x's dtype. Scores q.k of rotated vectors depend on the two
    positions only through their difference."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


class Block(nn.Module):
    """Pre-norm decoder block: x + attention(RMSNorm(x)), then x + SwiGLU(RMSNorm(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        d, self.n_head = cfg.d_model, cfg.n_head
        self.n_kv_head = cfg.n_kv_head or cfg.n_head
        self.head_dim = d // cfg.n_head
        self.rotary, self.rope_theta = cfg.positions == "rotary", cfg.rope_theta
        ffn = cfg.ffn_hidden or default_ffn_hidden(d)
        self.attn_norm = nn.RMSNorm(d, eps=cfg.norm_eps)
        self.q = nn.Linear(d, cfg.n_head * self.head_dim, bias=False)
        self.k = nn.Linear(d, self.n_kv_head * self.head_dim, bias=False)
        self.v = nn.Linear(d, self.n_kv_head * self.head_dim, bias=False)
        self.o = nn.Linear(cfg.n_head * self.head_dim, d, bias=False)
        self.mlp_norm = nn.RMSNorm(d, eps=cfg.norm_eps)
        self.gate = nn.Linear(d, ffn, bias=False)
        self.up = nn.Linear(d, ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        h = self.attn_norm(x)
        q = self.q(h).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k(h).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v(h).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        if self.rotary:
            # Note: the tables are made here, in fp32, not held in buffers or passed in from the
            # root: a bf16 model (.to(bfloat16), DeepSpeed's bf16 mode) would round buffers, and
            # FSDP2's mixed precision casts a block's floating-point inputs to bf16. A
            # [T, head_dim / 2] table per block is negligible beside the projections.
            cos, sin = rotary_tables(T, self.head_dim, self.rope_theta, x.device)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_head != self.n_head)
        x = x + self.o(att.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        # Learned positions: GPT's table, added to the token embedding; rotary ones live in the blocks.
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model) if cfg.positions == "learned" else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        self.apply(self._init)
        for b in self.blocks:  # as GPT: residual projections scaled down by depth
            assert isinstance(b, Block)
            for lin in (b.o, b.down):
                nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):  # RMSNorm keeps its ones
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.embed(idx)
        if self.pos is not None:
            x = x + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
