"""sdpq: sharded data-parallel quantization for DeepSpeed ZeRO-3 and PyTorch FSDP2.

Public surface: ``sdpq.Config`` (and ``ConfigError``), ``sdpq.stats``, the sub-packages
``sdpq.quant`` (math), ``sdpq.comm`` (collectives), ``sdpq.optim`` (compressed AdamW) and the
integrations ``sdpq.fsdp`` / ``sdpq.deepspeed`` / ``sdpq.hf`` (imported lazily: each pulls in its
framework). docs/api.md lists what each exports.
"""

import importlib

from ._version import __version__
from .config import Config, ConfigError
from .integrations import install_deepspeed_hook

__all__ = ["Config", "ConfigError", "stats", "quant", "comm", "optim", "fsdp", "deepspeed", "hf", "__version__"]

_LAZY = {
    "stats": "sdpq.stats",
    "quant": "sdpq.quant",
    "comm": "sdpq.comm",
    "optim": "sdpq.optim",
    "fsdp": "sdpq.fsdp",
    "deepspeed": "sdpq.deepspeed",
    "hf": "sdpq.hf",
}


def __getattr__(name: str):
    # Lazy so that `import sdpq` (e.g. for Config) does not import DeepSpeed or torch.distributed.
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name])
        globals()[name] = module
        return module
    raise AttributeError(f"module 'sdpq' has no attribute {name!r}")


# Note: from here on a DeepSpeed config with an "sdpq" block gets sdpq in every caller of
# deepspeed.initialize (Hugging Face Trainer, Accelerate, Lightning); deepspeed is not imported.
install_deepspeed_hook()
