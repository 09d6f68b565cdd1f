"""A small byte-level GPT (pre-norm, causal SDPA, tied embeddings) for tests, demo and benchmarks,
and `model_from_config`, which builds it or the Llama-shaped model (sdpq/train/llama.py) from
its config: what both training backends call.

Small on purpose: several million parameters train on 4 CPU ranks in minutes. The embedding is
tied to the output head because tied weights are a case integrations must handle (one parameter
used twice in a step).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from .llama import Llama, LlamaConfig

__all__ = ["GPTConfig", "GPT", "ModelConfig", "MODELS", "model_from_config", "model_config_from_dict"]


@dataclass(frozen=True)
class GPTConfig:
    kind: ClassVar[str] = "gpt"  # the --model name (LlamaConfig's is "llama")
    vocab_size: int = 256  # bytes
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 256
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig: d_model={self.d_model} must be divisible by n_head={self.n_head}")


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.wte.weight
        self.apply(self._init)
        for b in self.blocks:  # GPT-2: scale residual projections by depth
            assert isinstance(b, Block)
            for lin in (b.proj, b.out):
                nn.init.normal_(lin.weight, std=0.02 / (2 * cfg.n_layer) ** 0.5)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


ModelConfig = GPTConfig | LlamaConfig
# The --model names (python -m sdpq.train, sdpq demo) and their configs.
MODELS: dict[str, type[GPTConfig] | type[LlamaConfig]] = {"gpt": GPTConfig, "llama": LlamaConfig}


def model_from_config(cfg: ModelConfig) -> GPT | Llama:
    """The model `cfg` describes: GPT for a GPTConfig, Llama for a LlamaConfig (on the current
    torch RNG: seed it for the same initial weights on every rank)."""
    if isinstance(cfg, LlamaConfig):
        return Llama(cfg)
    if isinstance(cfg, GPTConfig):
        return GPT(cfg)
    raise TypeError(f"model_from_config: a {type(cfg).__name__}; allowed: GPTConfig, LlamaConfig")


def model_config_from_dict(d: dict[str, Any]) -> ModelConfig:
    """The inverse of dataclasses.asdict(cfg): a LlamaConfig where `d` has a field only LlamaConfig
    has (asdict writes them all), else a GPTConfig; a key neither has is an error naming it."""
    gpt, llama = {f.name for f in fields(GPTConfig)}, {f.name for f in fields(LlamaConfig)}
    unknown = sorted(set(d) - gpt - llama)
    if unknown:
        raise ValueError(f"model config: unknown key(s) {unknown}; allowed: {sorted(gpt | llama)}")
    return LlamaConfig(**d) if set(d) - gpt else GPTConfig(**d)
