"""Thin adapters that install sdpq's collectives and optimizer into training frameworks.

- `sdpq.integrations.fsdp` (exposed as `sdpq.fsdp`): PyTorch FSDP2 (`fully_shard`).
- `sdpq.integrations.deepspeed` (exposed as `sdpq.deepspeed`): DeepSpeed ZeRO-3.

Submodules are imported on demand, so using one framework never imports the other. Exported
here, without importing torch.distributed or DeepSpeed: the DeepSpeed config check that
`sdpq config --check` runs, and the post-import hook `import sdpq` installs.
"""

from ._ds_config import IncompatibleConfigError
from ._ds_config import check_config as check_deepspeed_config
from ._ds_hook import install as install_deepspeed_hook

__all__ = ["IncompatibleConfigError", "check_deepspeed_config", "install_deepspeed_hook"]
