"""sdpq: sharded data-parallel quantization for DeepSpeed ZeRO-3, PyTorch FSDP2 and DDP.

The front door (``__all__``) is what a training script needs: ``sdpq.Config``, ``sdpq.fsdp.apply``
or ``sdpq.deepspeed.initialize``, ``sdpq.optim.AdamW``, ``sdpq.stats``, ``sdpq.memory`` and
``sdpq.mark_weights_changed``. The rest stays importable (``sdpq.quant`` math, ``sdpq.comm``
collectives, ``sdpq.kernels``, ``sdpq.hf``, ...) and is listed under "Advanced" in docs/api.md.
Sub-packages are imported lazily: each integration pulls in its framework.
"""

import importlib

from ._version import __version__
from .config import Config, ConfigError
from .integrations import install_deepspeed_hook, mark_weights_changed

__all__ = [
    "Config",
    "ConfigError",
    "fsdp",
    "deepspeed",
    "ddp",
    "optim",
    "stats",
    "memory",
    "mark_weights_changed",
    "__version__",
]

_LAZY = {
    "stats": "sdpq.stats",
    "memory": "sdpq.memory",
    "plan": "sdpq.plan",
    "quant": "sdpq.quant",
    "comm": "sdpq.comm",
    "optim": "sdpq.optim",
    "kernels": "sdpq.kernels",
    "fsdp": "sdpq.fsdp",
    "ddp": "sdpq.ddp",
    "deepspeed": "sdpq.deepspeed",
    "hf": "sdpq.hf",
    "torchtitan": "sdpq.torchtitan",
    "torchft": "sdpq.torchft",
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
