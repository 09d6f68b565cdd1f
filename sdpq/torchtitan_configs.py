"""torchtitan configs with sdpq, for torchtitan's `--module` (torchtitan 0.3.0 imports the module
named there and calls the function `--config` names):

    torchrun --nproc_per_node 8 -m torchtitan.train --module sdpq.torchtitan_configs --config llama3_8b

Each function returns torchtitan's config of the same name (`torchtitan.models.llama3.config_registry`)
whose model spec applies sdpq after the spec's own post_optimizer_build_fn
(`sdpq.torchtitan.model_spec_with_sdpq`). `sdpq` (a sdpq.Config or a dict) replaces sdpq's
defaults: torchtitan calls these without arguments, your own config module can call them with it.
Every other option stays torchtitan's, on the command line as usual. See docs/torchtitan.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchtitan.models.llama3 import config_registry as _llama3

from .config import Config as _Config
from .integrations.torchtitan import model_spec_with_sdpq as _model_spec_with_sdpq

# Note: torchtitan lists a module's lower-case callables as its configs: only configs here are public.
__all__ = ["llama3_debugmodel", "llama3_8b"]

SdpqArg = _Config | Mapping[str, Any] | None


def llama3_debugmodel(sdpq: SdpqArg = None):
    """torchtitan's llama3 debug model (256 wide, 6 layers) with sdpq."""
    return _with_sdpq(_llama3.llama3_debugmodel(), sdpq)


def llama3_8b(sdpq: SdpqArg = None):
    """torchtitan's Llama-3 8B recipe with sdpq."""
    return _with_sdpq(_llama3.llama3_8b(), sdpq)


def _with_sdpq(trainer_config, sdpq: SdpqArg):
    trainer_config.model_spec = _model_spec_with_sdpq(trainer_config.model_spec, sdpq)
    return trainer_config
