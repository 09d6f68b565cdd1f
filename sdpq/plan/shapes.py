"""A model's parameter shapes, grouped as FSDP2 shards them (one unit per block, then the root's
own parameters), from a preset, a Hugging Face config.json, sdpq.train's model flags or a bare
parameter count. Models are built on the meta device: no memory, any size."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..train.llama import LlamaConfig
from ..train.model import ModelConfig, model_from_config

__all__ = ["ModelShape", "PRESETS", "from_config", "from_hf_config", "from_params"]

Shape = tuple[int, ...]

# Llama 2's shapes (vocabulary 32000, sequence 4096); 70B uses grouped-query attention (8 KV heads).
PRESETS = {
    "7b": LlamaConfig(vocab_size=32000, seq_len=4096, n_layer=32, n_head=32, d_model=4096, ffn_hidden=11008),
    "13b": LlamaConfig(vocab_size=32000, seq_len=4096, n_layer=40, n_head=40, d_model=5120, ffn_hidden=13824),
    "70b": LlamaConfig(
        vocab_size=32000, seq_len=4096, n_layer=80, n_head=64, n_kv_head=8, d_model=8192, ffn_hidden=28672
    ),
}


@dataclass(frozen=True)
class ModelShape:
    name: str
    units: tuple[tuple[Shape, ...], ...]  # per FSDP unit: its parameters' shapes
    layers: int
    hidden: int
    vocab: int
    seq: int

    @property
    def params(self) -> int:
        return sum(math.prod(s) for u in self.units for s in u)


def from_config(cfg: ModelConfig, name: str | None = None) -> ModelShape:
    """sdpq.train's GPT or Llama-shaped model (the demo's and the launchers' --model flags)."""
    with torch.device("meta"):
        model = model_from_config(cfg)
    blocks = {id(p) for b in model.blocks for p in b.parameters()}
    units = [tuple(tuple(p.shape) for p in b.parameters()) for b in model.blocks]
    units.append(tuple(tuple(p.shape) for p in model.parameters() if id(p) not in blocks))
    label = name or f"{cfg.kind} d{cfg.d_model} x{cfg.n_layer}"
    return ModelShape(label, tuple(units), cfg.n_layer, cfg.d_model, cfg.vocab_size, cfg.seq_len)


def from_hf_config(path: str | Path) -> ModelShape:
    """A Llama-family Hugging Face config.json (hidden_size, intermediate_size, num_hidden_layers,
    num_attention_heads, num_key_value_heads, vocab_size, tie_word_embeddings)."""
    d = json.loads(Path(path).read_text())
    try:
        cfg = LlamaConfig(
            vocab_size=d["vocab_size"],
            seq_len=d.get("max_position_embeddings", 4096),
            n_layer=d["num_hidden_layers"],
            n_head=d["num_attention_heads"],
            n_kv_head=d.get("num_key_value_heads"),
            d_model=d["hidden_size"],
            ffn_hidden=d["intermediate_size"],
            tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        )
    except KeyError as e:
        raise ValueError(f"{path}: a Llama-family config needs {e.args[0]!r}") from None
    return from_config(cfg, name=Path(path).parent.name or str(path))


def from_params(params: float, layers: int = 32, hidden: int = 4096) -> ModelShape:
    """A bare parameter count: `layers` units of equal 1-D parameters (no shapes to pad)."""
    per = int(params) // layers
    units = tuple(((per,),) for _ in range(layers))
    return ModelShape(f"{params / 1e9:g}B parameters", units, layers, hidden, 32000, 4096)
