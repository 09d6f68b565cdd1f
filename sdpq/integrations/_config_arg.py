"""The `config` argument every integration's entry point takes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..config import Config

__all__ = ["as_config"]


def as_config(config: Config | Mapping[str, Any] | None, where: str) -> Config:
    """A Config from a Config, a dict (validated, ConfigError naming the key) or None (the
    defaults); a TypeError naming `where` for anything else."""
    if config is None:
        return Config()
    if isinstance(config, Config):
        return config
    if isinstance(config, Mapping):
        return Config.from_dict(config)
    raise TypeError(f"{where}: config must be a sdpq.Config, a dict or None, got {type(config).__name__}")
